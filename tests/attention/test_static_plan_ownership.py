"""What a CUDA graph over a static decode step writes outlives the step's plan, on the CPU
with a fake compiled module: the split-K workspaces of a static step's launch belong to
the ``StaticDecodePlan`` (which the graph's owner keeps), not to the ``BatchPlan`` that a
capture drops, and ``check_graph_safe`` names a launch that holds memory of its own."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_attention_launch import D, HKV, HQ, PAGE, fake_module
from fakes import FakeDecodeModule

from astrai.extension.backend.attention.cuda import CudaBackend
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.ops import attention_plan


@pytest.fixture
def fake(monkeypatch):
    return fake_module(monkeypatch, FakeDecodeModule(splits=3))


def cache_with_static(size=2, max_pages=8):
    cache = PagedKVCache(1, 64, PAGE, HKV, D, dtype=torch.bfloat16)
    cache.add_sequence("pad")
    cache.plan(["pad"], [1])
    return cache, cache.static_decode_plan(size, max_pages, "pad")


def capture_step(cache, static, size=2, max_pages=8):
    """A capture as the engine makes one: throw-away requests of the longest reservation,
    one decode step planned into the static buffers and prepared; the requests are then
    released and the step's plan dropped. Returns weak references to the plan and to the
    tensors holding the launch's workspaces, and the pointers the launch wrote."""
    ids = [("capture", b) for b in range(size)]
    for s in ids:
        cache.add_sequence(s)
    cache.plan(ids, [max_pages * PAGE - 2] * size)
    plan = cache.plan(ids, [1] * size, into=static)
    launch = CudaBackend._launch(cache, plan, HQ, True)
    assert launch.num_splits == 3
    static.check_graph_safe(plan)
    holders = [weakref.ref(t if t._base is None else t._base) for t in (launch.ws_o, launch.ws_lse)]
    pointers = (launch.ws_o.data_ptr(), launch.ws_lse.data_ptr())
    plan_ref = weakref.ref(plan)
    for s in ids:
        cache.release(s)
    cache.plan(["pad"], [1])  # the next step replaces the cache's active plan
    del plan, launch
    gc.collect()
    return plan_ref, holders, pointers


def test_a_captured_steps_workspaces_outlive_its_plan(fake):
    cache, static = cache_with_static()
    plan_ref, holders, pointers = capture_step(cache, static)
    assert plan_ref() is None  # nothing keeps the capture's plan...
    assert all(h() is not None for h in holders)  # ...yet what a replay writes is still owned
    cache.add_sequence("a")
    cache.plan(["a"], [5 * PAGE])
    step = cache.plan(["a"], [1], into=static)
    later = CudaBackend._launch(cache, step, HQ, True)
    assert later.ws_o.untyped_storage().data_ptr() == pointers[0]  # the same kept buffers, not new ones
    cache.plan(["pad"], [1])  # the cache's active plan is no longer the static step
    del static, step, later
    gc.collect()
    assert all(h() is None for h in holders)  # freed with the static plan, not leaked


def test_larger_workspaces_keep_the_smaller_ones_a_graph_may_still_write(fake):
    cache, static = cache_with_static()
    small = static.split_workspaces(2, 1, HQ, D, torch.device("cpu"))
    big = static.split_workspaces(4, 2, HQ, D, torch.device("cpu"))
    assert big[0].numel() == 4 * 2 * HQ * D and big[1].numel() == 4 * 2 * HQ
    assert small[0].untyped_storage().data_ptr() != big[0].untyped_storage().data_ptr()
    kept = {t.untyped_storage().data_ptr() for pair in static._workspaces for t in pair}
    assert {t.untyped_storage().data_ptr() for t in (*small, *big)} <= kept
    assert static.split_workspaces(1, 2, HQ, D, torch.device("cpu")) == (None, None)


def test_a_launch_with_workspaces_of_its_own_is_refused_before_a_capture(fake):
    cache, static = cache_with_static()
    cache.add_sequence("a")
    cache.plan(["a"], [7 * PAGE])
    plan = cache.plan(["a"], [1], into=static)
    own = attention_plan.plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, q_heads=HQ, kv_heads=HKV,
                                           head_dim=D, max_kv_len=plan.max_kv_len, page_size=PAGE,
                                           num_pages=cache.num_pages)  # the default: the launch allocates
    plan.launches["mine"] = own
    with pytest.raises(RuntimeError, match=r"launch 'mine' of a static decode step holds its own ws_o \(\d+ bytes\)"):
        static.check_graph_safe(plan)
    with pytest.raises(ValueError, match="not a step of this static plan"):
        static.check_graph_safe(cache.plan(["a"], [1]))
