"""Every custom op under torch.compile(fullgraph=True) and CUDA-graph capture, and the
decode path without a host synchronisation.

Each op is compiled with ``fullgraph=True`` (a graph break is an error) and compared with
its eager result on fresh inputs; each is captured into a ``torch.cuda.CUDAGraph``,
replayed on new data copied into the static inputs, and compared with eager again. The
decode step of ``attention(..., kv_cache=...)`` (append + paged decode, every layer) and
``apply_rotary_emb`` run under ``torch.cuda.set_sync_debug_mode("error")``: a hidden
``.item()`` / ``.cpu()`` / host-device copy raises.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from astrai.extension import ATTN_BACKEND, PagedKVCache, apply_rotary_emb, attention, attn_backend
from astrai.extension.ops import attention as attn_ops
from astrai.extension.ops import fp8 as fp8_ops
from astrai.extension.ops import rotary as rotary_ops
from reference import rotary_tables

pytestmark = [
    pytest.mark.gpu,
    # torch 2.11's compile stack calls a deprecated torch.jit API internally
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

DEV = "cuda"
BF16 = torch.bfloat16


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(dtype)


def paged_cache(q_lens, page_size=16, hkv=2, d=128, layers=1, history=37):
    """A cache with ``history`` tokens per request already written, planned for ``q_lens``."""
    cache = PagedKVCache(layers, 64, page_size, hkv, d, dtype=BF16, device=DEV)
    cache.k_pages.normal_()
    cache.v_pages.normal_()
    seqs = list(range(len(q_lens)))
    for s in seqs:
        cache.add_sequence(s)
    cache.plan(seqs, [history] * len(seqs))
    for layer in range(layers):
        cache.append(layer, rand(1, history * len(seqs), hkv, d), rand(1, history * len(seqs), hkv, d))
    plan = cache.plan(seqs, q_lens)
    return cache, plan


def fp8_pair(m=64, k=128, n=96):
    a = (rand(m, k, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
    w = (rand(n, k, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
    return a, w.t()  # b = w.t(): the common [K, N] view of a row-major [N, K] weight


# name -> (function of the inputs, factory of fresh inputs)
def _cases():
    cos, sin = (t.to(DEV) for t in rotary_tables(33, 128, offset=4000))
    dec_cache, dec_plan = paged_cache([1, 1, 1])
    pre_cache, pre_plan = paged_cache([70, 5, 1])
    pre_tiles = pre_plan.q_tiles(attn_ops.q_tile_rows(DEV))  # the plan's, built eagerly as plan() does
    scale = torch.tensor(0.5, device=DEV)
    return {
        "rotary_emb": (lambda x: rotary_ops.rotary_emb(x, cos, sin), lambda: (rand(2, 33, 8, 128),)),
        "attn_decode": (lambda q, k, v: attn_ops.attn_decode(q, k, v),
                        lambda: (rand(3, 1, 16, 128), rand(3, 300, 4, 128), rand(3, 300, 4, 128))),
        "attn_prefill": (lambda q, k, v: attn_ops.attn_prefill(q, k, v, is_causal=True),
                         lambda: (rand(2, 77, 16, 128), rand(2, 77, 4, 128), rand(2, 77, 4, 128))),
        "attn_paged_decode": (
            lambda q: attn_ops.attn_paged_decode(q, dec_cache.k_cache(0), dec_cache.v_cache(0), dec_plan.kv_indptr,
                                            dec_plan.kv_indices, dec_plan.kv_lens),
            lambda: (rand(3, 1, 8, 128),)),
        "attn_paged_prefill": (
            lambda q: attn_ops.attn_paged_prefill(q, pre_cache.k_cache(0), pre_cache.v_cache(0), pre_plan.qo_indptr,
                                             pre_plan.kv_indptr, pre_plan.kv_indices, pre_plan.kv_lens,
                                             *pre_tiles, True),
            lambda: (rand(76, 8, 128),)),
        "fp8_quantize": (lambda x: fp8_ops.fp8_quantize(x, scale, "e4m3", 2), lambda: (rand(96, 160),)),
        "fp8_gemm": (lambda a, b: fp8_ops.mm_fp8(a, b, scale), fp8_pair),
    }


OPS = ["rotary_emb", "attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill",
       "fp8_quantize", "fp8_gemm"]


@pytest.fixture(scope="module")
def cases():
    torch.manual_seed(0)
    return _cases()


def assert_same(got, want):
    if isinstance(want, (tuple, list)):
        for g, w in zip(got, want):
            assert_same(g, w)
        return
    if want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), (got - want).abs().max() if got.is_floating_point() else "differs"


@pytest.mark.parametrize("name", OPS)
def test_op_under_torch_compile_fullgraph(cases, name):
    fn, make = cases[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for _ in range(2):  # a second call with new data reuses the graph
        args = make()
        assert_same(compiled(*args), fn(*args))


@pytest.mark.parametrize("name", ["rotary_emb", "fp8_gemm"])
def test_op_under_inductor(cases, name):
    fn, make = cases[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a), fullgraph=True)
    args = make()
    assert_same(compiled(*args), fn(*args))


@pytest.mark.parametrize("name", OPS)
def test_op_under_cuda_graph_capture(cases, name):
    fn, make = cases[name]
    static = make()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (first-use imports, workspaces) outside the capture
            fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for _ in range(2):
        fresh = make()
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, fn(*fresh))


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # "a prototype feature" notice on every call
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_decode_step_never_synchronizes_the_host():
    layers, hq, hkv, d = 4, 16, 4, 128
    cache, plan = paged_cache([1, 1, 1, 1], hkv=hkv, d=d, layers=layers)
    cos, sin = (t.to(DEV) for t in rotary_tables(1, d, offset=37))
    qs = [rand(4, 1, hq, d) for _ in range(layers)]
    ks = [rand(4, 1, hkv, d) for _ in range(layers)]
    vs = [rand(4, 1, hkv, d) for _ in range(layers)]
    # First use (plugin import, decisions) may synchronise; it is not the decode path.
    with torch.no_grad(), attn_backend(ATTN_BACKEND.CUDA):
        apply_rotary_emb(qs[0].clone(), (cos, sin))
        probe, _ = paged_cache([1, 1, 1, 1], hkv=hkv, d=d, layers=1)
        attention(qs[0].clone(), ks[0].clone(), vs[0].clone(), kv_cache=probe, layer_id=0, fwd="decode")
        with no_host_sync():
            outs = []
            for layer in range(layers):
                q = apply_rotary_emb(qs[layer], (cos, sin))
                k = apply_rotary_emb(ks[layer], (cos, sin))
                outs.append(attention(q, k, vs[layer], kv_cache=cache, layer_id=layer, fwd="decode"))
    torch.cuda.synchronize()
    assert all(o.shape == (4, 1, hq, d) and o.isfinite().all() for o in outs)


@pytest.mark.parametrize("entry", ["apply_rotary_emb", "attention"])
def test_public_entry_points_under_torch_compile_fullgraph(entry):
    torch._dynamo.reset()
    if entry == "apply_rotary_emb":
        cos, sin = (t.to(DEV) for t in rotary_tables(9, 64))
        fn, args = (lambda x: apply_rotary_emb(x, (cos, sin))), (rand(2, 9, 4, 64),)
    else:
        fn, args = (lambda q, k, v: attention(q, k, v, is_causal=True)), (rand(2, 9, 8, 64), rand(2, 9, 2, 64),
                                                                          rand(2, 9, 2, 64))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(*args), fn(*args))
