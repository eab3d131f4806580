"""attention(kv_cache=) on the CUDA kernels through the plan/run split and the device page
table: a schedule of ragged prefills, decode steps that cross page boundaries, a request
leaving and another joining (a mixed batch), over shuffled pages and two layers. Every
layer's output matches the float64 reference over each request's token history, and the
C++ split planner runs once per decode batch, not once per layer."""

from __future__ import annotations

import random

import pytest
import torch
from reference import attention_ref

from astrai.extension import ATTN_BACKEND, attn_backend, attention
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.ops import attention_plan

pytestmark = pytest.mark.gpu

BF16, LAYERS, HQ, HKV, D, PAGE, PAGES = torch.bfloat16, 2, 8, 2, 128, 16, 256


class CountingModule:
    def __init__(self, module):
        self._module, self.plans = module, 0

    def decode_plan(self, *args):
        self.plans += 1
        return self._module.decode_plan(*args)

    def __getattr__(self, name):
        return getattr(self._module, name)


@pytest.fixture
def counting(monkeypatch):
    seen = {}
    require = attention_plan._plugin.require

    def wrapped(op, device=None):
        if op not in seen:
            seen[op] = CountingModule(require(op, device))
        return seen[op]

    monkeypatch.setattr(attention_plan._plugin, "require", wrapped)
    return seen


def run_step(cache, history, seqs, q_lens, gen, layout=lambda t: t):
    """One batch over every layer, each layer's output against the reference; ``layout``
    re-lays a decode step's query out (same values)."""
    plan = cache.plan(seqs, q_lens)
    total = sum(q_lens)
    for layer in range(LAYERS):
        q = torch.randn(1, total, HQ, D, generator=gen).to(BF16).cuda()
        k = torch.randn(1, total, HKV, D, generator=gen).to(BF16).cuda()
        v = torch.randn(1, total, HKV, D, generator=gen).to(BF16).cuda()
        if plan.is_decode:  # the decode layout [B, 1, H, D]
            q, k, v = (t.reshape(len(seqs), 1, *t.shape[2:]) for t in (q, k, v))
            q = layout(q)
        with attn_backend(ATTN_BACKEND.CUDA):
            out = attention(q, k, v, kv_cache=cache, layer_id=layer).reshape(total, HQ, D)
        qp, kp, vp = (t.reshape(total, *t.shape[-2:]) for t in (q, k, v))
        start = 0
        for s, n in zip(seqs, q_lens):
            hk, hv = history.setdefault((layer, s), ([], []))
            hk.append(kp[start:start + n].cpu())
            hv.append(vp[start:start + n].cpu())
            want = attention_ref(qp[start:start + n][None], torch.cat(hk)[None], torch.cat(hv)[None], is_causal=True)[0]
            got = out[start:start + n].double().cpu()
            # per element, against float64 over the request's whole history
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            start += n
    return plan


def test_schedule_through_plans_and_the_device_table(counting):
    gen = torch.Generator().manual_seed(7)
    order = list(range(PAGES))
    random.Random(3).shuffle(order)
    cache = PagedKVCache(LAYERS, PAGES, PAGE, HKV, D, dtype=BF16, device="cuda", page_order=order)
    cache.k_pages.normal_(0, 100)  # garbage in unwritten slots: attending to it would show
    cache.v_pages.normal_(0, 100)
    history: dict = {}
    for s in (0, 1, 2):
        cache.add_sequence(s)
    run_step(cache, history, [0, 1, 2], [37, 5, 80], gen)  # ragged prefill
    decode_batches = 0
    for _ in range(20):  # 37 -> 57 tokens: crosses page boundaries at 48
        run_step(cache, history, [0, 1, 2], [1, 1, 1], gen)
        decode_batches += 1
    cache.release(1)
    cache.add_sequence(3)
    run_step(cache, history, [0, 2, 3], [1, 1, 20], gen)  # a mixed batch: ragged prefill kernel
    for _ in range(14):
        run_step(cache, history, [2, 0, 3], [1, 1, 1], gen)  # a new order of the same requests
        decode_batches += 1
    assert counting["attn_paged_decode"].plans == decode_batches  # once per batch, not per layer


def test_a_planned_decode_layer_replays_from_a_cuda_graph():
    """The planned launch (workspaces owned by the plan) records into a CUDA graph: replays
    on new queries equal eager calls on the same inputs."""
    gen = torch.Generator().manual_seed(11)
    cache = PagedKVCache(1, PAGES, PAGE, HKV, D, dtype=BF16, device="cuda")
    cache.k_pages.normal_()
    cache.v_pages.normal_()
    for s in range(3):
        cache.add_sequence(s)
    cache.plan([0, 1, 2], [900, 40, 3000 // PAGE])
    cache.plan([0, 1, 2], [1, 1, 1])
    q = torch.randn(3, 1, HQ, D, generator=gen).to(BF16).cuda()
    k = torch.randn(3, 1, HKV, D, generator=gen).to(BF16).cuda()
    call = lambda: attention(q, k, k, kv_cache=cache, layer_id=0)  # noqa: E731
    with attn_backend(ATTN_BACKEND.CUDA):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()  # plans the batch's launch outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for _ in range(3):
            q.copy_(torch.randn(q.shape, generator=gen).to(BF16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, call())


def _strided(t):
    """``t``'s values in a view whose rows are 2 * D apart (not contiguous, rows still aligned)."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def _misaligned(t):
    """``t``'s values, contiguous, at an address 2 bytes off 16-byte alignment (the kernels need a copy)."""
    flat = torch.full((t.numel() + 8,), float("nan"), dtype=t.dtype, device=t.device)
    view = flat[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


@pytest.mark.parametrize("layout", [_strided, _misaligned], ids=["strided", "misaligned"])
def test_decode_steps_with_a_query_in_another_layout(layout):
    """The policy's decode runner converts a kind of call's layouts once and reads the pointers
    per call: a strided query is launched as it is, a misaligned one is copied first; every
    layer of every step matches the reference."""
    gen = torch.Generator().manual_seed(13)
    cache = PagedKVCache(LAYERS, PAGES, PAGE, HKV, D, dtype=BF16, device="cuda")
    cache.k_pages.normal_(0, 100)
    cache.v_pages.normal_(0, 100)
    history: dict = {}
    for s in (0, 1, 2):
        cache.add_sequence(s)
    run_step(cache, history, [0, 1, 2], [30, 7, 50], gen)
    for _ in range(6):  # 30 -> 36 tokens: crosses the page boundary at 32
        run_step(cache, history, [0, 1, 2], [1, 1, 1], gen, layout)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_decode_steps_on_a_device_that_is_not_current():
    gen = torch.Generator().manual_seed(17)
    cache = PagedKVCache(LAYERS, PAGES, PAGE, HKV, D, dtype=BF16, device="cuda:1")
    for s in (0, 1):
        cache.add_sequence(s)
    with torch.cuda.device(0):
        plan = cache.plan([0, 1], [20, 9])
        for _ in range(3):
            plan = cache.plan([0, 1], [1, 1])
            for layer in range(LAYERS):
                q = torch.randn(2, 1, HQ, D, generator=gen).to(BF16).to("cuda:1")
                k = torch.randn(2, 1, HKV, D, generator=gen).to(BF16).to("cuda:1")
                with attn_backend(ATTN_BACKEND.CUDA):
                    out = attention(q, k, k, kv_cache=cache, layer_id=layer)
                with attn_backend(ATTN_BACKEND.TORCH_NATIVE):  # the same step again, on the torch path
                    want = attention(q, k, k, kv_cache=cache, layer_id=layer)
                torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert plan.is_decode
