"""Decode steps planned into fixed buffers on the GPU (pinned staging, the int32 scatter and
gather on the device), and a CUDA graph captured over them: every replay, with fewer
requests than the graph's rows and requests crossing page boundaries, gives the eager
decode's output and writes the same cache rows."""

from __future__ import annotations

import random

import pytest
import torch
from reference import tolerance
from rotary_reference import rope_tables
from static_plans import random_static_steps

from astrai.extension import PagedKVCache, attention

pytestmark = pytest.mark.gpu

BF16, HQ, HKV, D, PAGE, PAGES = torch.bfloat16, 8, 2, 128, 16, 256


def twin_caches():
    order = random.Random(3).sample(range(PAGES), PAGES)
    caches = [PagedKVCache(1, PAGES, PAGE, HKV, D, dtype=BF16, device="cuda", page_order=order) for _ in range(2)]
    for cache in caches:
        cache.k_pages.zero_()
        cache.v_pages.zero_()
        cache.add_sequence("pad")
        cache.plan(["pad"], [1])
    return caches


def capture(cache, static, ids, run):
    """``run`` captured over a decode step of ``ids`` planned into ``static`` and prepared
    outside the graph, after a warm-up step on a side stream: ``(graph, output, the step's plan)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cache.prepare(cache.plan(ids, [1] * len(ids), into=static))
        run()
    torch.cuda.current_stream().wait_stream(stream)
    plan = cache.plan(ids, [1] * len(ids), into=static)
    cache.prepare(plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out, plan


def test_static_steps_on_the_gpu_equal_ordinary_plans():
    cache = twin_caches()[0]
    static = cache.static_decode_plan(8, 40, "pad")
    ids = list(range(10))
    for s in ids:
        cache.add_sequence(s)
        cache.plan([s], [5 + 13 * s])
    random_static_steps(cache, static, ids, steps=30, seed=0)


def test_a_graph_over_a_static_plan_decodes_like_eager():
    graphed, eager = twin_caches()
    size, max_pages = 4, 12
    cos, sin = (t.cuda() for t in rope_tables(max_pages * PAGE, D))
    ids = ["a", "b", "c", "d"]
    g = torch.Generator(device="cuda").manual_seed(1)
    for s, n in zip(ids, [15, 40, 3, 77]):
        k = torch.randn(1, n, HKV, D, dtype=BF16, device="cuda", generator=g)  # the same prompt keys in both caches
        for cache in (graphed, eager):
            cache.add_sequence(s)
            cache.append(0, k, k.flip(-1), cache.plan([s], [n]))
    q_in = torch.randn(1, size, HQ, D, dtype=BF16, device="cuda")
    k_in = torch.randn(1, size, HKV, D, dtype=BF16, device="cuda")
    v_in = torch.randn(1, size, HKV, D, dtype=BF16, device="cuda")
    static = graphed.static_decode_plan(size, max_pages, "pad")
    capture_ids = [("capture", b) for b in range(size)]
    for s in capture_ids:
        graphed.add_sequence(s)
        graphed.plan([s], [max_pages * PAGE - 2])  # a reservation (no layer writes): zeros
    run = lambda: attention(q_in, k_in, v_in, kv_cache=graphed, layer_id=0, rope=(cos, sin))  # noqa: E731
    graph, out, _ = capture(graphed, static, capture_ids, run)
    for s in capture_ids:
        graphed.release(s)
    for step, batch in enumerate([ids, ids, ids[:3], ids[1:3], ids, ids[2:]] * 3):  # pad rows, page crossings
        n = len(batch)
        q = torch.randn(1, n, HQ, D, dtype=BF16, device="cuda", generator=g)
        k = torch.randn(1, n, HKV, D, dtype=BF16, device="cuda", generator=g)
        v = torch.randn(1, n, HKV, D, dtype=BF16, device="cuda", generator=g)
        with graphed.step(batch, [1] * n, into=static) as plan:
            q_in[:, :n].copy_(q)
            k_in[:, :n].copy_(k)
            v_in[:, :n].copy_(v)
            graph.replay()
            graphed.mark_written(None, plan)
        with eager.step(batch, [1] * n) as eager_plan:
            want = attention(q, k, v, kv_cache=eager, layer_id=0, rope=(cos, sin))
        torch.testing.assert_close(out[:, :n].float(), want.float(), **tolerance(BF16), msg=f"step {step}")
        for got, cached in zip(graphed.gather_flat(0, plan), eager.gather_flat(0, eager_plan)):
            assert torch.equal(got, cached)  # every request's keys and values, this step's rotated key included


SENTINEL = 1.5e38


def _sentinels(numels: list[int], copies: int = 4) -> list[torch.Tensor]:
    """Float32 tensors of each size in ``numels`` (the caching allocator hands a freed block
    of the same size back first), filled with a value no kernel writes."""
    return [torch.full((n,), SENTINEL, device="cuda") for n in numels for _ in range(copies)]


def test_a_replay_writes_no_memory_handed_out_after_its_capture():
    """A graph over a static step with more than one split: once the capture's plan and
    requests are gone, tensors allocated in their place (of the workspaces' very sizes) keep
    their values through a replay. The split-K partials belong to the static plan."""
    cache = twin_caches()[0]
    size, max_pages = 4, 12
    static = cache.static_decode_plan(size, max_pages, "pad")
    capture_ids = [("capture", b) for b in range(size)]
    for s in capture_ids:
        cache.add_sequence(s)
        cache.plan([s], [max_pages * PAGE - 2])
    q, k = (torch.randn(1, size, h, D, dtype=BF16, device="cuda") for h in (HQ, HKV))
    run = lambda: attention(q, k, k, kv_cache=cache, layer_id=0)  # noqa: E731
    graph, _, plan = capture(cache, static, capture_ids, run)
    launch = plan.launches[("cuda", "decode", HQ)]
    assert launch.num_splits > 1, "the capture must split the keys for this test to mean anything"
    numels = [launch.ws_o.numel(), launch.ws_lse.numel()]
    for s in capture_ids:
        cache.release(s)
    cache.plan(["pad"], [1])  # a new active plan: nothing holds the capture's plan now
    del plan, launch
    torch.cuda.synchronize()
    sentinels = _sentinels(numels)
    graph.replay()
    torch.cuda.synchronize()
    overwritten = sum(not bool((t == SENTINEL).all()) for t in sentinels)
    assert overwritten == 0, f"{overwritten} of {len(sentinels)} tensors allocated after the capture were overwritten"
