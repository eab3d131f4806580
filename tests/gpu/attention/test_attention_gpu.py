"""The astrai-attention kernels on the GPU against the float64 reference.

Every module is called directly (ABI 1) with a NaN-poisoned output, so an unwritten
element fails; the public ops, the CUDA backend and CUDA-graph capture are checked on
top. Each case draws its inputs from a generator seeded by its parameters, with weighted
edge keys (``attention_inputs``: a dropped first or last key shows), and every element is
checked against the float64 reference within the dtype's rounding (``checks``). Paged
caches use shuffled page tables; the slots no request owns are NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from attention_cases import (assert_close, dense_inputs, direct_decode, direct_paged_decode,
                                 direct_paged_prefill, direct_prefill, generator, paged_inputs, random_mask,
                                 reference, seed_of)
    from attention_inputs import directions, key_weight, lean_queries, randn

BF16, FP16 = torch.bfloat16, torch.float16


def _mask(kind, seed, b, lq, lkv):
    if kind is None:
        return None
    return random_mask(generator(seed + 7), (b, lkv) if kind == "2d" else (b, lq, lkv))


# (B, S, Hq, Hkv, D, dtype, mask, layout)
DECODE = [
    (1, 1, 32, 8, 128, BF16, None, "BLHD"),
    (1, 4096, 32, 8, 128, BF16, None, "BLHD"),
    (1, 32768, 32, 8, 128, BF16, None, "BLHD"),
    (1, 32767, 8, 8, 64, FP16, None, "BHLD"),
    (1, 32769, 32, 8, 128, BF16, None, "BLHD"),  # one key past a power of two
    (7, 63, 32, 4, 128, BF16, "2d", "BLHD"),
    (3, 65, 16, 16, 256, FP16, "3d", "BHLD"),
    (64, 129, 32, 8, 128, BF16, None, "BLHD"),
    (16, 1000, 32, 8, 64, BF16, "2d", "BHLD"),
    (2, 5001, 64, 2, 128, FP16, None, "BLHD"),  # G = 32: two head groups
    (4, 300, 24, 8, 256, BF16, None, "BLHD"),  # G = 3
    (3, 4097, 32, 8, 128, FP16, None, "BLHD"),
]


@pytest.mark.parametrize("B,S,Hq,Hkv,D,dtype,mask,layout", DECODE)
def test_decode(B, S, Hq, Hkv, D, dtype, mask, layout):
    seed = seed_of("decode", B, S, Hq, Hkv, D, dtype, mask, layout)
    q, k, v = dense_inputs(B, 1, S, Hq, Hkv, D, dtype, layout, seed=seed)
    m = _mask(mask, seed, B, 1, S)
    out, splits = direct_decode(q, k, v, m)
    assert_close(out, reference(q, k, v, m), dtype, f"decode B={B} S={S} splits={splits}")


# (B, Lq, Lkv, Hq, Hkv, D, dtype, causal, mask, layout)
PREFILL = [
    (1, 70, 70, 8, 8, 128, BF16, True, None, "BLHD"),
    (2, 130, 130, 32, 8, 128, BF16, True, None, "BHLD"),
    (2, 100, 300, 32, 8, 64, FP16, True, None, "BLHD"),  # bottom-right causal, q < kv
    (1, 200, 90, 8, 2, 128, BF16, True, None, "BLHD"),  # q > kv: early rows see nothing -> 0
    (2, 65, 129, 16, 16, 256, BF16, False, "2d", "BLHD"),
    (2, 77, 191, 32, 4, 128, FP16, False, "3d", "BHLD"),
    (1, 257, 257, 24, 8, 64, BF16, True, None, "BLHD"),  # G = 3
    (1, 64, 1000, 32, 8, 128, BF16, True, "3d", "BLHD"),
    (3, 1, 513, 32, 8, 128, BF16, True, None, "BLHD"),
    (1, 1000, 1000, 32, 8, 256, FP16, True, None, "BLHD"),
    (2, 333, 2049, 16, 2, 64, BF16, False, None, "BHLD"),  # G = 8
    (1, 63, 4097, 32, 8, 128, BF16, True, None, "BLHD"),  # one key past the last full tile
    (2, 129, 129, 16, 4, 64, FP16, False, None, "BLHD"),
    # one head per K/V head, and group 5: the Hopper kernel's one-head blocks of 128 rows where
    # the plugin is built with ASTRAI_PREFILL_WS_MHA (mma.sync otherwise)
    (2, 333, 333, 16, 16, 128, BF16, True, None, "BLHD"),
    (1, 129, 300, 8, 8, 64, FP16, False, None, "BHLD"),
    (1, 1000, 1000, 4, 4, 256, BF16, True, "2d", "BLHD"),
    (1, 200, 200, 40, 8, 128, BF16, True, None, "BLHD"),
]


@pytest.mark.parametrize("B,Lq,Lkv,Hq,Hkv,D,dtype,causal,mask,layout", PREFILL)
def test_prefill(B, Lq, Lkv, Hq, Hkv, D, dtype, causal, mask, layout):
    seed = seed_of("prefill", B, Lq, Lkv, Hq, Hkv, D, dtype, causal, mask, layout)
    q, k, v = dense_inputs(B, Lq, Lkv, Hq, Hkv, D, dtype, layout, seed=seed)
    m = _mask(mask, seed, B, Lq, Lkv)
    out = direct_prefill(q, k, v, m, causal)
    assert_close(out, reference(q, k, v, m, causal), dtype, f"prefill {B}x{Lq}/{Lkv} causal={causal}")


# (kv_lens, page, Hq, Hkv, D, dtype)
PAGED_DECODE = [
    ([1, 17, 64, 65, 1000, 4097], 1, 32, 8, 128, BF16),
    ([1, 17, 64, 65, 1000, 4097], 16, 32, 8, 128, BF16),  # 17, 65, 4097: one token on the last page
    ([300, 5, 2000], 16, 16, 16, 64, FP16),
    ([129, 31], 1, 32, 4, 256, BF16),
    ([200] * 64, 16, 32, 8, 128, BF16),
    ([32768], 16, 32, 8, 128, BF16),
    ([32769], 16, 32, 8, 128, BF16),  # kv = 2048 pages + 1
    ([1, 50, 301], 3, 32, 8, 128, FP16),  # page size not a power of two
    ([33, 129, 1025, 7], 32, 32, 8, 128, FP16),  # kv = k * page + 1, odd lengths
    ([257, 63, 64], 64, 16, 4, 64, BF16),
]


@pytest.mark.parametrize("lens,page,Hq,Hkv,D,dtype", PAGED_DECODE)
def test_paged_decode(lens, page, Hq, Hkv, D, dtype):
    q, cache = paged_inputs(lens, page, Hq, Hkv, D, dtype, seed=seed_of("paged decode", lens, page, Hq, Hkv, D, dtype))
    out, splits = direct_paged_decode(q, cache)
    for b in range(len(lens)):
        k, v = cache.gather(b)
        ref = reference(q[b:b + 1], k[None], v[None])
        assert_close(out[b:b + 1], ref, dtype, f"paged decode b={b} len={lens[b]} page={page} splits={splits}")
        # paged == contiguous: the same request through the contiguous module
        contig, _ = direct_decode(q[b:b + 1], k[None].contiguous(), v[None].contiguous())
        torch.testing.assert_close(out[b:b + 1].float(), contig.float(), atol=2e-2, rtol=2e-2)


# (q_lens, prefix, page, Hq, Hkv, D, dtype, causal)
PAGED_PREFILL = [
    ([70, 10, 130], [0, 0, 0], 1, 32, 8, 128, BF16, True),
    ([70, 10, 130], [5, 100, 63], 16, 32, 8, 64, FP16, True),
    ([1, 1, 1000], [0, 7, 24], 16, 32, 8, 128, BF16, True),
    ([1, 1, 1000], [3000, 0, 0], 1, 32, 4, 128, BF16, True),
    ([65, 200], [0, 300], 16, 16, 16, 256, BF16, False),
    ([33, 129], [10, 0], 1, 24, 8, 128, BF16, True),
    ([70, 10, 130], [5, 0, 9], 3, 32, 8, 128, BF16, True),
    ([1, 17, 33], [16, 0, 32], 16, 32, 8, 128, BF16, True),  # kv 17, 17, 65: one token on the last page
    ([63, 1, 129], [2, 64, 0], 64, 16, 4, 64, FP16, False),
]


# Tables half in page order: tiles over consecutive pages (one box per panel on Hopper) and
# over scattered ones, last tiles whose box reaches into other requests' pages.
PAGED_PREFILL_RUNS = [
    ([70, 10, 1300], [0, 33, 64], 16, 32, 8, 128, BF16, True),
    ([1000, 513], [24, 0], 8, 32, 8, 64, FP16, True),
    ([700, 129], [0, 300], 16, 16, 8, 256, BF16, False),
    ([300, 900], [5, 0], 64, 32, 8, 128, BF16, False),
    ([70, 10, 1300], [0, 33, 64], 16, 8, 8, 128, BF16, True),  # multi-head: odd tile counts
    ([129, 300], [0, 17], 16, 40, 8, 64, FP16, False),  # group 5
]


@pytest.mark.parametrize("q_lens,prefix,page,Hq,Hkv,D,dtype,causal,order",
                         [(*case, "shuffled") for case in PAGED_PREFILL] +
                         [(*case, order) for case in PAGED_PREFILL_RUNS for order in ("half", "in_order")])
def test_paged_prefill(q_lens, prefix, page, Hq, Hkv, D, dtype, causal, order):
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    seed = seed_of("paged prefill", q_lens, prefix, page, Hq, Hkv, D, dtype, causal, order)
    q, cache = paged_inputs(kv_lens, page, Hq, Hkv, D, dtype, q_lens=q_lens, seed=seed, order=order)
    out = direct_paged_prefill(q, cache, q_lens, causal)
    start = 0
    for b, n in enumerate(q_lens):
        k, v = cache.gather(b)
        qb = q[start:start + n][None]
        ref = reference(qb, k[None], v[None], causal=causal)
        assert_close(out[start:start + n][None], ref, dtype, f"paged prefill b={b} q={n} kv={kv_lens[b]}")
        contig = direct_prefill(qb, k[None].contiguous(), v[None].contiguous(), None, causal)
        torch.testing.assert_close(out[start:start + n][None].float(), contig.float(), atol=2e-2, rtol=2e-2)
        start += n


def test_public_ops_match_direct_calls():
    from astrai.extension.ops import attention as ops

    q, k, v = dense_inputs(2, 1, 700, 32, 8, 128, BF16, seed=seed_of("ops decode"))
    assert_close(ops.attn_decode(q, k, v), reference(q, k, v), BF16, "ops.attn_decode")
    qp, _, _ = dense_inputs(2, 90, 700, 32, 8, 128, BF16, "BHLD", seed=seed_of("ops prefill"))
    assert_close(ops.attn_prefill(qp, k, v, is_causal=True), reference(qp, k, v, causal=True), BF16,
                 "ops.attn_prefill")
    q, cache = paged_inputs([700, 3], 16, 32, 8, 128, BF16, seed=seed_of("ops paged"))
    out = ops.attn_paged_decode(q, cache.k_cache, cache.v_cache, cache.kv_indptr, cache.kv_indices, cache.kv_lens)
    for b in range(2):
        kb, vb = cache.gather(b)
        assert_close(out[b:b + 1], reference(q[b:b + 1], kb[None], vb[None]), BF16, "ops.attn_paged_decode")


_BAD_INPUT = """
import torch
from astrai.extension.ops import attention as ops
bf = torch.bfloat16
def r(*s): return torch.randn(*s, device="cuda").to(bf)
for call, word in [
    (lambda: ops.attn_decode(r(1, 1, 4, 96), r(1, 8, 4, 96), r(1, 8, 4, 96)), "head_dim"),
    (lambda: ops.attn_prefill(r(1, 8, 6, 64), r(1, 8, 4, 64), r(1, 8, 4, 64)), "kv_heads"),
]:
    try:
        call()
    except ValueError as exc:
        assert word in str(exc), exc
        print("ValueError:", exc)
    else:
        raise SystemExit("no error raised")
print("bad input ok")
"""


def test_bad_input_raises_value_error():
    """Validation errors cross the binding as ValueError (in a child process: a crash in the
    error path must fail this test, not the session)."""
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _BAD_INPUT], capture_output=True, text=True,
                         env=dict(os.environ), timeout=120)
    assert res.returncode == 0 and "bad input ok" in res.stdout, res.stdout + res.stderr


def test_decode_under_cuda_graph():
    """Capture paged and contiguous decode, refill the static inputs in place, replay."""
    from astrai.extension.ops import attention as ops

    B, Hq, Hkv, D = 4, 32, 8, 128
    q, cache = paged_inputs([1000, 1, 4096, 77], 16, Hq, Hkv, D, BF16, seed=seed_of("graph paged"))
    _, k, v = dense_inputs(B, 1, 2048, Hq, Hkv, D, BF16, seed=seed_of("graph dense"))
    gen = generator(seed_of("graph refills"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (registry, module import) outside the capture
        ops.attn_paged_decode(q, cache.k_cache, cache.v_cache, cache.kv_indptr, cache.kv_indices, cache.kv_lens)
        ops.attn_decode(q, k, v)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_out = ops.attn_paged_decode(q, cache.k_cache, cache.v_cache, cache.kv_indptr, cache.kv_indices,
                                          cache.kv_lens)
        dense_out = ops.attn_decode(q, k, v)
    for _ in range(2):
        for t in (q, cache.k_cache, k):
            t.copy_(randn(gen, t.shape))
        cache.kv_lens.copy_(torch.tensor([5, 1, 4000, 77], dtype=torch.int32))  # lengths change on device
        cache.kv_lens_host = [5, 1, 4000, 77]
        graph.replay()
        torch.cuda.synchronize()
        assert_close(dense_out, reference(q, k, v), BF16, "graph attn_decode")
        for b in range(B):
            kb, vb = cache.gather(b)
            assert_close(paged_out[b:b + 1], reference(q[b:b + 1], kb[None], vb[None]), BF16, "graph paged decode")


def test_cuda_backend_through_attention():
    """attention() with a PagedKVCache on the CUDA backend (strict: no fallback): prefill,
    decode, mixed batch, decode, each step against the float64 reference over every
    sequence's whole token history (the torch backend is no reference here: it shares
    plan and append with the CUDA one). Each step's newest key of a sequence is weighted."""
    from astrai.extension import ATTN_BACKEND, attention, attn_backend
    from astrai.extension.kv_cache import PagedKVCache

    Hq, Hkv, D = 16, 4, 128
    gen = generator(seed_of("backend", Hq, Hkv, D))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(seed_of("backend pages"))).tolist()
    cache = PagedKVCache(num_layers=1, num_pages=64, page_size=16, kv_heads=Hkv, head_dim=D, dtype=BF16,
                         device="cuda", page_order=order)
    cache.k_pages.fill_(math.nan)  # slots no sequence owns must never be read
    cache.v_pages.fill_(math.nan)
    seqs = list("abc")
    for s in seqs:
        cache.add_sequence(s)
    c = directions(gen, len(seqs), Hkv, D)
    history = {s: ([], []) for s in seqs}
    steps = [[70, 10, 130], [1, 1, 1], [3, 1, 20], [1, 1, 1]]  # prefill, decode, mixed, decode
    with torch.no_grad(), attn_backend(ATTN_BACKEND.CUDA):
        for q_lens in steps:
            total = sum(q_lens)
            q, k, v = randn(gen, (1, total, Hq, D)), randn(gen, (1, total, Hkv, D)), randn(gen, (1, total, Hkv, D))
            start = 0
            for i, (s, n) in enumerate(zip(seqs, q_lens)):
                lean_queries(q[:, start:start + n], c[i:i + 1])
                kv_len = sum(len(t) for t in history[s][0]) + n
                k[0, start + n - 1] += key_weight(kv_len, D) * c[i]
                start += n
            q, k, v = q.to(BF16), k.to(BF16), v.to(BF16)
            cache.plan(seqs, q_lens)
            out = attention(q, k, v, kv_cache=cache, layer_id=0)
            start = 0
            for s, n in zip(seqs, q_lens):
                ks, vs = history[s]
                ks.append(k[0, start:start + n])
                vs.append(v[0, start:start + n])
                ref = reference(q[:, start:start + n], torch.cat(ks)[None], torch.cat(vs)[None], causal=True)
                assert_close(out[:, start:start + n], ref, BF16, f"backend q_lens={q_lens} seq {s}")
                start += n
