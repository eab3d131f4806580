"""Plan once, run many: the paged attention launch plans, on the CPU with a fake compiled module.

The fake records what the ops layer asks of the binary: the planner is called once per
batch (with the batch's longest request), the workspaces and converted page table are the
same objects in every layer's launch, and the CUDA backend's launches are built by
``PagedKVCache.plan`` once the backend has seen the cache.
"""

from __future__ import annotations

import pytest
import torch
from fakes import FakeAppendingModule, FakeDecodeModule, FakeLastAppendingModule

from astrai.extension.backend.attention.base import AttentionCall
from astrai.extension.backend.attention.cuda import CudaBackend
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.ops import attention_plan

HQ, HKV, D, PAGE = 8, 2, 64, 4


def fake_module(monkeypatch, module):
    """``module`` as the compiled module of every launch, on device 0 of an H200's 132 SMs."""
    monkeypatch.setattr(attention_plan._plugin, "require", lambda op, device=None: module)
    monkeypatch.setattr(attention_plan, "_device_index", lambda t: 0)
    monkeypatch.setattr(attention_plan, "_num_sms", lambda device: 132)
    monkeypatch.setattr(attention_plan, "_run", lambda index, entry, head, tail, kwargs=None: entry(*head, 0, *tail))
    monkeypatch.setattr(attention_plan, "current_device", lambda: 0)  # the runners launch on the current stream
    monkeypatch.setattr(attention_plan, "current_stream", lambda index: 0)
    return module


@pytest.fixture
def fake(monkeypatch):
    return fake_module(monkeypatch, FakeDecodeModule())


def decode_cache(lens, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(layers, 64, PAGE, HKV, D, dtype=torch.bfloat16)
    for s, n in enumerate(lens):
        cache.add_sequence(s)
    cache.plan(list(range(len(lens))), list(lens))
    plan = cache.plan(list(range(len(lens))), [1] * len(lens))
    cache.k_pages.copy_(torch.randn(cache.k_pages.shape, generator=g))
    return cache, plan


def test_decode_plan_runs_the_planner_once_with_the_longest_request(fake):
    cache, plan = decode_cache([5, 17, 9])
    launch = attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, q_heads=HQ,
                                              kv_heads=HKV, head_dim=D, max_kv_len=plan.max_kv_len,
                                              page_size=PAGE, num_pages=cache.num_pages)
    assert fake.plans == [(3, HKV, HQ // HKV, D, 18, 132)]
    assert launch.num_splits == 3
    assert launch.ws_o.numel() == 3 * 3 * HQ * D and launch.ws_lse.numel() == 3 * 3 * HQ
    q = torch.randn(3, 1, HQ, D).bfloat16()
    for layer in range(3):
        launch(q, cache.k_cache(layer), cache.v_cache(layer))
    assert len(fake.plans) == 1 and len(fake.launches) == 3
    first = fake.launches[0]
    for args in fake.launches:
        assert args[1][0] == cache.k_cache(fake.launches.index(args)).data_ptr()
        assert args[4:10] == first[4:10]  # page table, split count and workspaces: planned once
        assert args[4][0] == plan.kv_indptr.data_ptr() and args[8][0] == launch.ws_o.data_ptr()
        assert args[-2:] == (None, False)  # no in-kernel merge, no PDL by default


def test_in_kernel_merge_and_pdl_are_options_of_the_plan(fake):
    cache, plan = decode_cache([40])
    launch = attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, q_heads=HQ,
                                              kv_heads=HKV, head_dim=D, max_kv_len=plan.max_kv_len,
                                              page_size=PAGE, num_pages=cache.num_pages,
                                              in_kernel_merge=True, pdl=True)
    assert launch.ws_count is not None and launch.ws_count.dtype == torch.int32
    assert not launch.ws_count.any()  # the kernel needs the counters at 0
    launch(torch.randn(1, 1, HQ, D).bfloat16(), cache.k_cache(0), cache.v_cache(0))
    assert fake.launches[0][-2] == (launch.ws_count.data_ptr(), (HQ,), (1,), 5) and fake.launches[0][-1] is True


def call_of(cache, mode):
    return AttentionCall(cache.device, cache.dtype, D, HQ, HKV, mode, None, True, 0, True, PAGE, False)


def test_cuda_backend_plans_in_the_cache_after_first_use(fake):
    cache, plan = decode_cache([6, 3])
    backend = CudaBackend()
    k = torch.randn(2, 1, HKV, D).bfloat16()
    q = torch.randn(2, 1, HQ, D).bfloat16()
    for layer in range(3):
        out = backend.forward(call_of(cache, "decode"), q, k, k, kv_cache=cache, layer_id=layer, is_causal=True)
        assert out.shape == q.shape
    assert len(fake.plans) == 1  # the first layer planned the batch, the others reused it
    plan = cache.plan([0, 1], [1, 1])
    assert ("cuda", "decode", HQ) in plan.launches  # the next batch is planned by plan() itself
    assert fake.plans[-1][4] == plan.max_kv_len == 8
    for layer in range(3):
        backend.forward(call_of(cache, "decode"), q, k, k, kv_cache=cache, layer_id=layer, is_causal=True)
    assert len(fake.plans) == 2
    cache.plan([0, 1], [3, 2])  # a prefill batch: nothing for the decode preparer
    assert len(fake.plans) == 2


def test_a_failing_preparer_is_dropped_and_plan_still_succeeds(fake):
    cache, plan = decode_cache([6])

    def broken(cache, plan):
        raise RuntimeError("plugin became unusable")

    cache.add_preparer("broken", broken)
    plan = cache.plan([0], [1])
    assert "broken" not in plan.launches
    assert "broken" not in cache.plan([0], [1]).launches


def test_a_decode_step_appends_in_the_decode_launch_where_the_module_can(monkeypatch):
    module = fake_module(monkeypatch, FakeAppendingModule())
    cache, plan = decode_cache([6, 3])
    before = cache.k_pages.clone()
    backend = CudaBackend()
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 1, HKV, D, generator=g).bfloat16()
    v = torch.randn(2, 1, HKV, D, generator=g).bfloat16()
    for layer, q in enumerate((torch.randn(2, 1, HQ, D).bfloat16(), torch.randn(1, 2, HQ, D).bfloat16())):
        out = backend.forward(call_of(cache, "decode"), q, k.reshape(q.shape[:2] + k.shape[2:]),
                              v.reshape(q.shape[:2] + v.shape[2:]), kv_cache=cache, layer_id=layer, is_causal=True)
        assert out.shape == q.shape
        args = module.launches[-1]
        assert args[1][0] == cache.k_cache(layer).data_ptr() and args[2][0] == cache.v_cache(layer).data_ptr()
        assert args[0][1] == (2, 1, HQ, D)  # a packed [1, B, ...] query is viewed per request
        k_new, v_new, slots = args[-3:]
        assert k_new[0] == k.data_ptr() and v_new[0] == v.data_ptr()
        assert slots == (plan.write_index.data_ptr(), (2,), (1,), 6)
    assert torch.equal(cache.k_pages, before)  # no index_copy_: the launch wrote (here: nothing)
    assert plan.write_index.tolist() == [cache.page_table(0)[1] * PAGE + 2, cache.page_table(1)[0] * PAGE + 3]
    launch = plan.launches[("cuda", "decode", HQ)]
    assert launch.appends and launch.slots is plan.write_index


def test_a_module_without_the_fused_append_gets_the_torch_writes(fake):
    cache, plan = decode_cache([6, 3])
    k = torch.randn(2, 1, HKV, D, generator=torch.Generator().manual_seed(2)).bfloat16()
    CudaBackend().forward(call_of(cache, "decode"), torch.randn(2, 1, HQ, D).bfloat16(), k, -k, kv_cache=cache,
                          layer_id=1, is_causal=True)
    assert not plan.launches[("cuda", "decode", HQ)].appends
    assert len(fake.launches[-1]) == 13  # no k_new, v_new, slots
    rows = cache.k_cache(1).reshape(-1, HKV, D)[plan.write_index]
    torch.testing.assert_close(rows, k[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(cache.v_cache(1).reshape(-1, HKV, D)[plan.write_index], -k[:, 0], rtol=0, atol=0)


def test_plan_rejects_slots_that_are_not_one_int64_row_per_request(fake):
    cache, plan = decode_cache([6, 3])
    with pytest.raises(ValueError, match=r"slots must be int64 \[2\]"):
        attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, q_heads=HQ, kv_heads=HKV,
                                         head_dim=D, max_kv_len=plan.max_kv_len, page_size=PAGE,
                                         num_pages=cache.num_pages, slots=plan.write_index.int())


def test_a_decode_step_appends_inside_the_decode_kernel_through_the_page_table(monkeypatch):
    module = fake_module(monkeypatch, FakeLastAppendingModule())
    cache, plan = decode_cache([6, 3])
    before = cache.k_pages.clone()
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 1, HKV, D, generator=g).bfloat16()
    v = torch.randn(2, 1, HKV, D, generator=g).bfloat16()
    for layer, q in enumerate((torch.randn(2, 1, HQ, D).bfloat16(), torch.randn(1, 2, HQ, D).bfloat16())):
        CudaBackend().forward(call_of(cache, "decode"), q, k.reshape(q.shape[:2] + k.shape[2:]),
                              v.reshape(q.shape[:2] + v.shape[2:]), kv_cache=cache, layer_id=layer, is_causal=True)
        args = module.launches[-1]
        assert args[4][0] == plan.kv_indptr.data_ptr() and args[6][0] == plan.kv_lens.data_ptr()
        k_new, v_new, slots, append_last = args[-4:]
        assert k_new[0] == k.data_ptr() and v_new[0] == v.data_ptr()
        assert slots is None and append_last is True  # rows from the page table the launch reads
    assert torch.equal(cache.k_pages, before)  # no index_copy_: the launch wrote (here: nothing)
    launch = plan.launches[("cuda", "decode", HQ)]
    assert launch.appends and launch.append_last and launch.slots is None  # a graph replay reads no stale slots


def test_append_last_is_asked_for_only_when_every_request_appends_its_last_position(monkeypatch):
    """The backend vouches for append_last only for a decode step (one new token per request,
    its last position); a module without append_last keeps the slots path for a decode step."""
    from astrai.extension.backend.attention import cuda

    asked = []
    monkeypatch.setattr(cuda, "plan_paged_decode", lambda *a, **kw: asked.append(kw))
    cache, step = decode_cache([6, 3])
    cuda._plan_launch(cache, step, HQ, True)
    mixed = cache.plan([0, 1], [2, 1])  # request 0 adds two tokens: not only its last position
    cuda._plan_launch(cache, mixed, HQ, True)
    assert [kw["append_last"] for kw in asked] == [True, False]
    monkeypatch.undo()

    fake_module(monkeypatch, FakeAppendingModule())  # built before append_last
    step = cache.plan([0, 1], [1, 1])
    launch = cuda._plan_launch(cache, step, HQ, True)
    assert not launch.append_last and launch.slots is step.write_index
    assert launch._append_args == ((step.write_index.data_ptr(), (2,), (1,), 6),)


def test_plan_calls_a_slots_callable_only_when_the_launch_needs_slots(monkeypatch):
    cache, plan = decode_cache([6, 3])
    calls = []

    def slots():
        calls.append(1)
        return plan.write_index

    kwargs = dict(q_heads=HQ, kv_heads=HKV, head_dim=D, max_kv_len=plan.max_kv_len, page_size=PAGE,
                  num_pages=cache.num_pages, slots=slots)
    fake_module(monkeypatch, FakeLastAppendingModule())
    launch = attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, append_last=True,
                                              **kwargs)
    assert launch.append_last and launch._append_args == (None, True) and calls == []
    launch = attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, **kwargs)
    assert not launch.append_last and launch.slots is plan.write_index and calls == [1]
    fake_module(monkeypatch, FakeDecodeModule())  # no fused append at all: slots are not needed
    launch = attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, append_last=True,
                                              **kwargs)
    assert not launch.appends and calls == [1]


def test_a_launch_with_append_last_passes_the_page_table_mode_only_with_k_new(monkeypatch):
    module = fake_module(monkeypatch, FakeLastAppendingModule())
    cache, plan = decode_cache([5])
    launch = attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, q_heads=HQ,
                                              kv_heads=HKV, head_dim=D, max_kv_len=plan.max_kv_len,
                                              page_size=PAGE, num_pages=cache.num_pages, append_last=True)
    k = torch.randn(1, 1, HKV, D).bfloat16()
    launch(torch.randn(1, 1, HQ, D).bfloat16(), cache.k_cache(0), cache.v_cache(0), k, -k)
    assert module.launches[-1][-2:] == (None, True)
    launch(torch.randn(1, 1, HQ, D).bfloat16(), cache.k_cache(0), cache.v_cache(0))
    assert module.launches[-1][-2:] == (None, False)  # no k_new: ws_count, pdl, nothing appended


# -- the per-kind-of-call runner (what the policy runs for a remembered eager decode call) --


def without_out_pointer(args):
    """A launch's arguments with the output's data pointer left out (each call allocates its own)."""
    return args[:3] + (args[3][1:],) + args[4:]


def runner_and_general_path(module, cache, q, k, v, layer, appended=False):
    """The launches of the decode runner and of ``forward`` (the general path) for one call."""
    backend = CudaBackend()
    call = call_of(cache, "decode")
    run = backend.eager_runner(call, q, k, v, cache)
    assert run is not None
    out = run(q, k, v, cache, layer, appended)
    by_runner = module.launches[-1]
    general = backend.forward(call, q, k, v, kv_cache=cache, layer_id=layer, is_causal=True, appended=appended)
    assert out.shape == general.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    return by_runner, module.launches[-1]


@pytest.mark.parametrize("appends", [True, False], ids=["fused-append", "torch-append"])
def test_the_decode_runner_passes_what_the_general_path_passes(monkeypatch, fake, appends):
    module = fake_module(monkeypatch, FakeAppendingModule()) if appends else fake
    cache, plan = decode_cache([6, 3])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, HQ, D, generator=g).bfloat16()
    k, v = (torch.randn(2, 1, HKV, D, generator=g).bfloat16() for _ in range(2))
    for layer in range(3):
        for appended in (False, True):
            by_runner, general = runner_and_general_path(module, cache, q, k, v, layer, appended)
            assert without_out_pointer(by_runner) == without_out_pointer(general)
            assert by_runner[0][0] == q.data_ptr() and by_runner[1][0] == cache.k_cache(layer).data_ptr()
            assert len(by_runner) == (16 if appends and not appended else 13)
    if not appends:  # the runner wrote the keys/values like the general path (same values twice)
        rows = cache.k_cache(2).reshape(-1, HKV, D)[plan.write_index]
        torch.testing.assert_close(rows, k[:, 0], rtol=0, atol=0)


def test_the_decode_runner_copies_rows_the_kernels_cannot_stream(fake):
    cache, plan = decode_cache([6, 3])
    g = torch.Generator().manual_seed(4)
    k = torch.randn(2, 1, HKV, D, generator=g).bfloat16()
    flat = torch.randn(2 * HQ * D + 8, generator=g).bfloat16()
    aligned = flat[:2 * HQ * D].view(2, 1, HQ, D)
    run = CudaBackend().eager_runner(call_of(cache, "decode"), aligned, k, k, cache)
    shifted = flat[1:1 + 2 * HQ * D].view(2, 1, HQ, D)  # same layout, rows 2 bytes off 16-byte alignment
    run(shifted, k, k, cache, 0, False)
    args = fake.launches[-1]
    assert args[0][0] != shifted.data_ptr() and args[0][0] % 16 == 0  # a contiguous copy was launched
    assert args[0][1:] == ((2, 1, HQ, D), (HQ * D, HQ * D, D, 1), 2)
    run(aligned, k, k, cache, 0, False)
    assert fake.launches[-1][0][0] == aligned.data_ptr()


def test_the_decode_runner_keeps_a_strided_query_uncopied(fake):
    cache, plan = decode_cache([6, 3])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, HQ, 1, D, generator=g).bfloat16().transpose(1, 2)  # [B, 1, Hq, D], heads strided
    k = torch.randn(2, 1, HKV, D, generator=g).bfloat16()
    by_runner, general = runner_and_general_path(fake, cache, q, k, k, 1)
    assert without_out_pointer(by_runner) == without_out_pointer(general)
    assert by_runner[0] == (q.data_ptr(), (2, 1, HQ, D), q.stride(), 2)
    assert by_runner[3][1:] == ((2, 1, HQ, D), (HQ * D, HQ * D, D, 1), 2)  # the output is contiguous


def test_packed_queries_take_the_general_path(fake):
    cache, plan = decode_cache([6, 3])
    q = torch.randn(1, 2, HQ, D).bfloat16()
    k = torch.randn(1, 2, HKV, D).bfloat16()
    assert CudaBackend().eager_runner(call_of(cache, "decode"), q, k, k, cache) is None
