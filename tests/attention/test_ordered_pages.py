"""A long prefill over FP8 or scattered pages runs the 16-bit paged kernel over the step's pages
gathered into consecutive scratch pages (backend/attention/ordered_pages.py), on the CPU with a
fake module: which calls take that route, the values the kernel is given (the torch path's, FP8
pages dequantized), its page table, and what explain() says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fakes import H200, FakeDecodeModule

from astrai.extension.backend.attention import ordered_pages
from astrai.extension.backend.attention.base import AttentionCall
from astrai.extension.backend.attention.cuda import CudaBackend
from astrai.extension.backend.attention.variant import AttentionVariant
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.ops import attention as attn_ops
from astrai.extension.ops import attention_plan

HQ, HKV, D, PAGE = 4, 2, 64, 8  # pages of 8: the Hopper prefill boxes them per panel
GATHERED = ("cuda", "prefill-gathered")
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    """The caches' device says H200 (sm_90: the Hopper prefill reads gathered pages)."""
    monkeypatch.setattr(ordered_pages, "probe_device", lambda device=None: H200)


@pytest.fixture
def module(monkeypatch):
    """A fake compiled module; each launch's positional arguments and keywords are recorded."""
    module = FakeDecodeModule()
    module.Q_TILE_ROWS = 64
    module.keywords = []

    def run(index, entry, head, tail, kwargs=None):
        module.keywords.append(dict(kwargs or {}))
        entry(*head, 0, *tail)

    monkeypatch.setattr(attention_plan._plugin, "require", lambda op, device=None: module)
    monkeypatch.setattr(attn_ops._plugin, "require", lambda op, device=None: module)
    monkeypatch.setattr(attention_plan, "_device_index", lambda t: 0)
    monkeypatch.setattr(attention_plan, "_run", run)
    return module


def cache_with(history: dict[str, int], kv_dtype=FP8, layers: int = 2, seed: int = 0) -> PagedKVCache:
    """A cache whose sequences already hold ``history[seq]`` tokens, written one sequence at a
    time after a filler's 9 tokens: the requests' pages interleave with each other's later ones."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(layers, 64, PAGE, HKV, D, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                         kv_scale_granularity="head")
    cache.add_sequence("filler")
    cache.plan(["filler"], [9])
    for s in history:
        cache.add_sequence(s)
    for s, n in history.items():
        if n:
            cache.plan([s], [n])
            for layer in range(layers):
                kv = torch.randn(1, n, HKV, D, generator=g).bfloat16()
                cache.append(layer, kv * 3, kv - 1)
    return cache


def call_of(cache: PagedKVCache) -> AttentionCall:
    return AttentionCall(cache.device, cache.dtype, D, HQ, HKV, "prefill", None, True, 0, True, PAGE, False,
                         kv_dtype=cache.kv_dtype)


def prefill(cache: PagedKVCache, q_lens: dict[str, int], layer: int, seed: int = 1, **variant):
    g = torch.Generator().manual_seed(seed)
    plan = cache.plan(list(q_lens), list(q_lens.values()))
    q = torch.randn(1, plan.total_q, HQ, D, generator=g).bfloat16()
    k = torch.randn(1, plan.total_q, HKV, D, generator=g).bfloat16()
    CudaBackend().forward(call_of(cache), q, k, k * 2, kv_cache=cache, layer_id=layer, is_causal=True,
                          variant=AttentionVariant(**variant))
    return plan


@pytest.mark.parametrize("kv_dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
def test_a_long_prefill_reads_the_pages_gathered_in_order(module, monkeypatch, kv_dtype):
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 8)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_ROWS", 8)
    cache = cache_with({"a": 5, "b": 0, "c": 13}, kv_dtype)
    plan = prefill(cache, {"a": 11, "b": 9, "c": 20}, layer=1)
    gathered = plan.launches[GATHERED]
    args, keywords = module.launches[-1], module.keywords[-1]
    assert args[1][0] == gathered.k.data_ptr() and args[2][0] == gathered.v.data_ptr()
    assert "kv_scales" not in keywords  # FP8 pages: the scales are in the values
    pages = [-(-n // PAGE) for n in plan.kv_lens_host]  # 2, 2, 5
    assert gathered.k.shape == (sum(pages), PAGE, HKV, D) and gathered.k.dtype == torch.bfloat16
    kv_indptr, kv_indices = gathered.launch.kv_indptr, gathered.launch.kv_indices
    assert kv_indptr.tolist() == [0, 2, 4, 9] and kv_indices.tolist() == list(range(9))
    assert args[5][0] == kv_indptr.data_ptr() and args[6][0] == kv_indices.data_ptr()
    # every key and value the torch path attends to, at its place in the scratch pages
    k_ref, v_ref = cache.gather_flat(1, plan)
    slots = torch.cat([torch.arange(n) + first * PAGE for n, first in zip(plan.kv_lens_host, [0, 2, 4])])
    assert torch.equal(gathered.k.reshape(-1, HKV, D)[slots], k_ref)
    assert torch.equal(gathered.v.reshape(-1, HKV, D)[slots], v_ref)
    expected = [p for s in ("a", "b", "c") for p in cache.page_table(s)[: -(-cache.seq_len(s) // PAGE)]]
    assert gathered.source.tolist() == expected and expected != sorted(expected)


def test_the_scratch_is_planned_once_and_refilled_per_layer(module, monkeypatch):
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 1)
    cache = cache_with({"a": 6})
    plan = prefill(cache, {"a": 7}, layer=0)
    gathered = plan.launches[GATHERED]
    first_k = gathered.k.clone()
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 7, HKV, D, generator=g).bfloat16()
    CudaBackend().forward(call_of(cache), torch.randn(1, 7, HQ, D).bfloat16(), k, k, kv_cache=cache, layer_id=1,
                          is_causal=True)
    assert plan.launches[GATHERED] is gathered
    assert torch.equal(gathered.k.reshape(-1, HKV, D)[:13], cache.gather_flat(1, plan)[0])
    assert not torch.equal(gathered.k, first_k)  # layer 1's values now
    assert module.launches[-1][1][0] == module.launches[-2][1][0]  # the same scratch


@pytest.mark.parametrize("case", ["short", "window", "never", "in order"])
def test_other_prefills_read_the_pages_in_place(module, monkeypatch, case):
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", None if case == "never" else 16)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_ROWS", 16)
    fp8 = case != "in order"
    cache = cache_with({"a": 30}, FP8 if fp8 else torch.bfloat16)  # one sequence: its pages in order
    variant = {"window_left": 8} if case == "window" else {}
    plan = prefill(cache, {"a": 2 if case == "short" else 40}, layer=0, **variant)
    assert GATHERED not in plan.launches
    args, keywords = module.launches[-1], module.keywords[-1]
    assert args[1][0] == cache.k_cache(0).data_ptr() and ("kv_scales" in keywords) == fp8


def test_the_thresholds_count_query_rows_per_key_and_scattered_pages(monkeypatch):
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 11)
    cache = cache_with({"a": 0, "b": 80})
    plan = cache.plan(["a", "b"], [20, 10])  # (20 * 20 + 10 * 90) / 110 = 11.8 rows a key
    assert ordered_pages._pays(cache, plan)
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 12)
    assert not ordered_pages._pays(cache, plan)
    # 16-bit pages: a is in order (3 pages), b's 10 from history + 2 new ones break once: 1 / 13 steps
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_ROWS", 11)
    cache = cache_with({"a": 0, "b": 80}, torch.bfloat16)
    plan = cache.plan(["a", "b"], [20, 10])
    assert ordered_pages.scattered(cache, plan) == pytest.approx(1 / 13)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_BREAKS", 1 / 13)
    assert ordered_pages._pays(cache, plan)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_BREAKS", 1 / 12)
    assert not ordered_pages._pays(cache, plan)


@pytest.mark.parametrize(("sm", "page", "kv_dtype", "gathers"), [
    ((9, 0), 4, FP8, True), ((8, 0), 4, FP8, False), ((10, 0), 4, FP8, False),  # the Hopper prefill only
    ((9, 0), 8, torch.bfloat16, True), ((9, 0), 4, torch.bfloat16, False),  # 16-bit: pages it boxes per panel
    ((9, 0), 256, torch.bfloat16, True), ((9, 0), 3, FP8, True)])
def test_pages_are_gathered_only_for_the_hopper_prefill(monkeypatch, sm, page, kv_dtype, gathers):
    monkeypatch.setattr(ordered_pages, "probe_device", lambda device=None: dataclasses.replace(H200, capability=sm))
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 1)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_ROWS", 1)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_BREAKS", 0.0)
    cache = PagedKVCache(1, 8, page, HKV, D, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    cache.add_sequence("a")
    assert ordered_pages.gather_pays(cache, cache.plan(["a"], [page + 1]), -1) == gathers


def test_the_decision_is_made_once_per_plan_and_never_for_a_window(monkeypatch):
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 1)
    cache = cache_with({"a": 10})
    plan = cache.plan(["a"], [20])
    assert not ordered_pages.gather_pays(cache, plan, 50)  # a window: its pages would be gathered for nothing
    assert ordered_pages.gather_pays(cache, plan, -1)
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", None)
    monkeypatch.setattr(ordered_pages, "scattered", lambda *a: pytest.fail("asked again"))
    assert ordered_pages.gather_pays(cache, plan, -1)  # every layer of the step: the first answer
    assert not ordered_pages.gather_pays(cache, cache.plan(["a"], [20]), -1)  # the next step decides anew


def test_explain_says_where_prefills_are_gathered(monkeypatch):
    call = call_of(cache_with({"a": 3}))
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 300)
    why = CudaBackend().why_capable(call)
    assert "float8_e4m3fn pages" in why and ">= 300 query rows" in why and "dequantized" in why
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", None)
    assert CudaBackend().why_capable(call) == "attn_paged_prefill reads the float8_e4m3fn pages in place"
    assert CudaBackend().why_capable(call._replace(mode="decode")) is None  # decode reads them in the kernel
    why = CudaBackend().why_capable(call._replace(kv_dtype=None))  # 16-bit pages
    assert ">= 2048 query rows over pages out of order" in why and "copied in order" in why
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_ROWS", None)
    why = CudaBackend().why_capable(call._replace(kv_dtype=None))
    assert why == "attn_paged_prefill reads the bfloat16 pages in place"


@pytest.mark.parametrize("kv_dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
def test_the_plugins_gather_kernel_runs_where_the_module_has_it(module, monkeypatch, kv_dtype):
    calls = []
    module.gather_pages = lambda *args, **kwargs: calls.append((args, kwargs))
    monkeypatch.setattr(ordered_pages, "launch", lambda device, entry, *args, **kwargs: entry(*args, 0, **kwargs))
    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 1)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_ROWS", 1)
    cache = cache_with({"a": 5, "b": 13}, kv_dtype)
    plan = prefill(cache, {"a": 11, "b": 20}, layer=1)
    gathered = plan.launches[GATHERED]
    (args, kwargs), = calls
    pointers = [a[0] for a in args[:5]]
    assert pointers == [cache.k_cache(1).data_ptr(), cache.v_cache(1).data_ptr(), gathered.source.data_ptr(),
                        gathered.k.data_ptr(), gathered.v.data_ptr()] and args[5] == 0  # the stream
    assert args[0][3] == (3 if kv_dtype == FP8 else 2)  # the pages' dtype code: the kernel dequantizes e4m3
    if kv_dtype == FP8:
        k_scale, v_scale = cache.kv_scales(1)
        assert [s[0] for s in kwargs["kv_scales"]] == [k_scale.data_ptr(), v_scale.data_ptr()]
    else:
        assert kwargs == {}
    assert module.launches[-1][1][0] == gathered.k.data_ptr()  # then the prefill over the scratch
