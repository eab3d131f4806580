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
    for cache in (graphed, eager):
        for s, n in zip(ids, [15, 40, 3, 77]):
            cache.add_sequence(s)
            plan = cache.plan([s], [n])
            k = torch.randn(1, n, HKV, D, dtype=BF16, device="cuda", generator=g)
            cache.append(0, k, k.flip(-1), plan)
    q_in = torch.randn(1, size, HQ, D, dtype=BF16, device="cuda")
    k_in = torch.randn(1, size, HKV, D, dtype=BF16, device="cuda")
    v_in = torch.randn(1, size, HKV, D, dtype=BF16, device="cuda")
    static = graphed.static_decode_plan(size, max_pages, "pad")
    capture_ids = [("capture", b) for b in range(size)]
    for s in capture_ids:
        graphed.add_sequence(s)
        graphed.plan([s], [max_pages * PAGE - 2])  # a reservation (no layer writes): zeros
    run = lambda: attention(q_in, k_in, v_in, kv_cache=graphed, layer_id=0, rope=(cos, sin))  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphed.prepare(graphed.plan(capture_ids, [1] * size, into=static))
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graphed.prepare(graphed.plan(capture_ids, [1] * size, into=static))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
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
