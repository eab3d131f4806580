"""A long prefill over FP8 pages runs the 16-bit paged kernel over the step's pages dequantized
into consecutive scratch pages (backend/attention/fp8_widen.py), on the CPU with a fake module:
which calls take that route, the values the kernel is given (the torch path's dequantized ones),
and its page table."""

from __future__ import annotations

import pytest
import torch
from fakes import FakeDecodeModule

from astrai.extension.backend.attention import fp8_widen
from astrai.extension.backend.attention.base import AttentionCall
from astrai.extension.backend.attention.cuda import CudaBackend
from astrai.extension.backend.attention.variant import AttentionVariant
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.ops import attention as attn_ops
from astrai.extension.ops import attention_plan

HQ, HKV, D, PAGE = 4, 2, 64, 4


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


def fp8_cache(history: dict[int, int], layers: int = 2, seed: int = 0) -> PagedKVCache:
    """An e4m3 cache whose sequences already hold ``history[seq]`` tokens, pages handed out shuffled."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(layers, 64, PAGE, HKV, D, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                         kv_scale_granularity="head")
    filler = "filler"
    cache.add_sequence(filler)
    cache.plan([filler], [9])  # the requests' pages are not the first ones, nor consecutive
    for s in history:
        cache.add_sequence(s)
    for s, n in history.items():
        if n:
            cache.plan([s], [n])
            for layer in range(layers):
                kv = torch.randn(1, n, HKV, D, generator=g).bfloat16()
                cache.append(layer, kv * 3, kv - 1)
    return cache


def prefill(cache: PagedKVCache, q_lens: dict[int, int], layer: int, seed: int = 1, **variant):
    g = torch.Generator().manual_seed(seed)
    plan = cache.plan(list(q_lens), list(q_lens.values()))
    total = plan.total_q
    q = torch.randn(1, total, HQ, D, generator=g).bfloat16()
    k = torch.randn(1, total, HKV, D, generator=g).bfloat16()
    call = AttentionCall(cache.device, cache.dtype, D, HQ, HKV, "prefill", None, True, 0, True, PAGE, False,
                         kv_dtype=cache.kv_dtype)
    CudaBackend().forward(call, q, k, k * 2, kv_cache=cache, layer_id=layer, is_causal=True,
                          variant=AttentionVariant(**variant))
    return plan


def test_a_long_prefill_reads_the_dequantized_pages_in_order(module, monkeypatch):
    monkeypatch.setattr(fp8_widen, "WIDEN_MIN_ROWS", 8)
    cache = fp8_cache({"a": 5, "b": 0, "c": 13})
    plan = prefill(cache, {"a": 11, "b": 9, "c": 20}, layer=1)
    widened = plan.launches[("cuda", "prefill-widened")]
    args, keywords = module.launches[-1], module.keywords[-1]
    assert args[1][0] == widened.k.data_ptr() and args[2][0] == widened.v.data_ptr()
    assert "kv_scales" not in keywords  # the scales are in the values
    pages = [-(-n // PAGE) for n in plan.kv_lens_host]  # 4, 3, 9
    assert widened.k.shape == (sum(pages), PAGE, HKV, D) and widened.k.dtype == torch.bfloat16
    kv_indptr, kv_indices = widened.launch.kv_indptr, widened.launch.kv_indices
    assert kv_indptr.tolist() == [0, 4, 7, 16] and kv_indices.tolist() == list(range(16))
    assert args[5][0] == kv_indptr.data_ptr() and args[6][0] == kv_indices.data_ptr()
    # every key and value the torch path attends to, at its place in the scratch pages
    k_ref, v_ref = cache.gather_flat(1, plan)
    slots = torch.cat([torch.arange(n) + first * PAGE
                       for n, first in zip(plan.kv_lens_host, [0, 4, 7])])
    assert torch.equal(widened.k.reshape(-1, HKV, D)[slots], k_ref)
    assert torch.equal(widened.v.reshape(-1, HKV, D)[slots], v_ref)
    expected = [p for s in ("a", "b", "c") for p in cache.page_table(s)[: -(-cache.seq_len(s) // PAGE)]]
    assert widened.source.tolist() == expected and expected != sorted(expected)


def test_the_scratch_is_planned_once_and_refilled_per_layer(module, monkeypatch):
    monkeypatch.setattr(fp8_widen, "WIDEN_MIN_ROWS", 1)
    cache = fp8_cache({"a": 6})
    plan = prefill(cache, {"a": 7}, layer=0)
    widened = plan.launches[("cuda", "prefill-widened")]
    first_k = widened.k.clone()
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 7, HKV, D, generator=g).bfloat16()
    call = AttentionCall(cache.device, cache.dtype, D, HQ, HKV, "prefill", None, True, 0, True, PAGE, False,
                         kv_dtype=cache.kv_dtype)
    CudaBackend().forward(call, torch.randn(1, 7, HQ, D).bfloat16(), k, k, kv_cache=cache, layer_id=1,
                          is_causal=True)
    assert plan.launches[("cuda", "prefill-widened")] is widened
    assert torch.equal(widened.k.reshape(-1, HKV, D)[:13], cache.gather_flat(1, plan)[0])
    assert not torch.equal(widened.k, first_k)  # layer 1's values now
    assert module.launches[-1][1][0] == module.launches[-2][1][0]  # the same scratch


@pytest.mark.parametrize("case", ["short", "window", "never"])
def test_short_or_windowed_prefills_read_the_fp8_pages(module, monkeypatch, case):
    monkeypatch.setattr(fp8_widen, "WIDEN_MIN_ROWS", None if case == "never" else 16)
    cache = fp8_cache({"a": 30})
    variant = {"window_left": 8} if case == "window" else {}
    plan = prefill(cache, {"a": 2 if case == "short" else 40}, layer=0, **variant)
    assert ("cuda", "prefill-widened") not in plan.launches
    args, keywords = module.launches[-1], module.keywords[-1]
    assert args[1][0] == cache.k_cache(0).data_ptr() and "kv_scales" in keywords


def test_the_threshold_counts_query_rows_per_key(monkeypatch):
    monkeypatch.setattr(fp8_widen, "WIDEN_MIN_ROWS", 11)
    cache = fp8_cache({"a": 0, "b": 80})
    plan = cache.plan(["a", "b"], [20, 10])  # (20 * 20 + 10 * 90) / 110 = 11.8 rows a key
    assert fp8_widen.widen_pays(cache, plan, -1)
    assert not fp8_widen.widen_pays(cache, plan, 50)  # a window
    monkeypatch.setattr(fp8_widen, "WIDEN_MIN_ROWS", 12)
    assert not fp8_widen.widen_pays(cache, plan, -1)


def test_explain_says_where_fp8_prefills_widen(monkeypatch):
    cache = fp8_cache({"a": 3})
    call = AttentionCall(cache.device, cache.dtype, D, HQ, HKV, "prefill", None, True, 0, True, PAGE, False,
                         kv_dtype=cache.kv_dtype)
    monkeypatch.setattr(fp8_widen, "WIDEN_MIN_ROWS", 300)
    why = CudaBackend().why_capable(call)
    assert "float8_e4m3fn pages" in why and ">= 300 query rows" in why and "dequantized" in why
    monkeypatch.setattr(fp8_widen, "WIDEN_MIN_ROWS", None)
    assert CudaBackend().why_capable(call) == "attn_paged_prefill reads the float8_e4m3fn pages in the kernel"
    assert CudaBackend().why_capable(call._replace(mode="decode")) is None  # decode reads them in the kernel
    assert CudaBackend().why_capable(call._replace(kv_dtype=None)) is None  # 16-bit pages
