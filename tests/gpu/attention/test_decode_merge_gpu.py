"""The split decode's two merges of its partials: the combine kernel (what the ops use)
and the optional in-kernel merge (``ws_count`` arrival counters; the last block of each
unit merges), with and without programmatic dependent launch of the split grid.

The compiled decode modules are called directly over a wide range of split counts
(2..64, more splits than tiles, empty splits, one and two load rounds of the combine),
every head dim, both dtypes, GQA 3/4/32 (two head groups), contiguous and paged K/V;
outputs are NaN-poisoned, every element is checked against the float64 reference within
the dtype's rounding, on inputs seeded by the case's parameters whose edge keys carry
weight (``attention_inputs``), and the counters must be back at 0 after every launch
(repeated launches, CUDA-graph replays).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from attention_cases import (abi, assert_close, dense_inputs, generator, module, paged_inputs, poisoned_like,
                                 random_mask, reference, seed_of)
    from attention_inputs import randn

    from astrai.extension.abi import stream_handle

BF16, FP16 = torch.bfloat16, torch.float16


def _units(batch, hq, hkv):
    return batch * hkv * -(-(hq // hkv) // 16)


def _workspace(splits, batch, hq, d, units):
    ws_o = torch.full((splits * batch * hq * d,), float("nan"), device="cuda")
    ws_lse = torch.full((splits * batch * hq,), float("nan"), device="cuda")
    count = torch.zeros(units + 5, dtype=torch.int32, device="cuda")  # spare tail must stay 0 too
    return ws_o, ws_lse, count


def fused_decode(q, k, v, splits, count=None, mask=None, merged=True, pdl=False):
    """Contiguous decode with ``splits`` splits, merged in the kernel (or, merged=False, by
    the combine kernel); returns (out, counters)."""
    mod = module("attn_decode")
    b, _, hq, d = q.shape
    ws_o, ws_lse, fresh = _workspace(splits, b, hq, d, _units(b, hq, k.shape[2]))
    count = fresh if count is None else count
    out = poisoned_like(q)
    mod.attn_decode(abi(q), abi(k), abi(v), abi(out), abi(mask), splits, abi(ws_o), abi(ws_lse),
                    stream_handle(q.device), abi(count if merged else None), pdl)
    return out, count


def fused_paged_decode(q, cache, splits, count=None, merged=True, pdl=False):
    mod = module("attn_paged_decode")
    b, _, hq, d = q.shape
    ws_o, ws_lse, fresh = _workspace(splits, b, hq, d, _units(b, hq, cache.k_cache.shape[2]))
    count = fresh if count is None else count
    out = poisoned_like(q)
    mod.attn_paged_decode(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),
                          abi(cache.kv_indices), abi(cache.kv_lens), splits, abi(ws_o), abi(ws_lse),
                          stream_handle(q.device), abi(count if merged else None), pdl)
    return out, count


def _zero(count, what):
    torch.cuda.synchronize()
    assert int(count.abs().sum()) == 0, f"{what}: counters not reset: {count.tolist()}"


# (B, S, Hq, Hkv, D, dtype, splits)
CONTIG = [
    (1, 4096, 32, 8, 128, BF16, 32),
    (1, 4096, 32, 8, 128, BF16, 64),
    (1, 100, 32, 8, 128, BF16, 64),  # 2 tiles, 62 empty splits
    (1, 32768, 32, 8, 128, FP16, 7),
    (64, 777, 32, 8, 128, BF16, 3),
    (64, 4096, 32, 8, 128, BF16, 2),
    (3, 1000, 16, 16, 64, FP16, 17),
    (2, 3001, 64, 2, 128, BF16, 9),  # G = 32: two head groups per kv head
    (4, 300, 24, 8, 256, BF16, 5),  # G = 3, D = 256
    (2, 2049, 32, 2, 256, FP16, 64),  # nh = 16 at D = 256: the merge runs in several chunks
]


@pytest.mark.parametrize("B,S,Hq,Hkv,D,dtype,splits", CONTIG)
def test_fused_decode_contiguous(B, S, Hq, Hkv, D, dtype, splits):
    q, k, v = dense_inputs(B, 1, S, Hq, Hkv, D, dtype, seed=seed_of("fused", B, S, Hq, Hkv, D, dtype, splits))
    out, count = fused_decode(q, k, v, splits)
    assert_close(out, reference(q, k, v), dtype, f"fused decode B={B} S={S} splits={splits}")
    _zero(count, "contiguous")


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("splits", [2, 31, 33, 64])
def test_combine_kernel_split_counts(splits, pdl):
    """The combine kernel (one or two rounds of 32 splits), with and without PDL."""
    for D, dtype in ((128, BF16), (256, FP16), (64, BF16)):
        seed = seed_of("combine", splits, pdl, D, dtype)
        q, k, v = dense_inputs(2, 1, 4500, 32, 8, D, dtype, seed=seed)
        out, _ = fused_decode(q, k, v, splits, merged=False, pdl=pdl)
        assert_close(out, reference(q, k, v), dtype, f"combine D={D} splits={splits} pdl={pdl}")
        q, cache = paged_inputs([4500, 3], 16, 32, 8, D, dtype, seed=seed + 1)
        out, count = fused_paged_decode(q, cache, splits, pdl=pdl)
        for b in range(2):
            kb, vb = cache.gather(b)
            assert_close(out[b:b + 1], reference(q[b:b + 1], kb[None], vb[None]), dtype,
                         f"merged paged D={D} splits={splits} pdl={pdl}")
        _zero(count, "pdl sweep")


def test_fused_decode_with_mask():
    seed = seed_of("fused masked")
    q, k, v = dense_inputs(5, 1, 900, 32, 8, 128, BF16, seed=seed)
    m = random_mask(generator(seed + 1), (5, 900), keep=0.3)
    m[2, 1:] = False  # one request keeps a single key: most of its splits see none
    out, count = fused_decode(q, k, v, 11, mask=m)
    assert_close(out, reference(q, k, v, m), BF16, "fused decode masked")
    _zero(count, "masked")


# (kv_lens, page, Hq, Hkv, D, dtype, splits)
PAGED = [
    ([4096], 16, 32, 8, 128, BF16, 32),
    ([4096], 1, 32, 8, 128, BF16, 48),
    ([1, 17, 64, 65, 1000, 4097], 16, 32, 8, 128, BF16, 13),
    ([1, 50, 301], 3, 32, 8, 128, FP16, 64),
    ([129, 31], 1, 32, 4, 256, BF16, 6),
    ([300, 5, 2000], 16, 16, 16, 64, FP16, 24),
    ([200] * 64, 16, 32, 8, 128, BF16, 2),
    ([17, 4097, 33], 16, 32, 8, 128, BF16, 40),  # one token on the last page
]


@pytest.mark.parametrize("lens,page,Hq,Hkv,D,dtype,splits", PAGED)
def test_fused_paged_decode(lens, page, Hq, Hkv, D, dtype, splits):
    q, cache = paged_inputs(lens, page, Hq, Hkv, D, dtype, seed=seed_of("fused paged", lens, page, Hq, Hkv, D, dtype,
                                                                        splits))
    out, count = fused_paged_decode(q, cache, splits)
    for b in range(len(lens)):
        k, v = cache.gather(b)
        assert_close(out[b:b + 1], reference(q[b:b + 1], k[None], v[None]), dtype,
                     f"fused paged decode b={b} len={lens[b]} page={page} splits={splits}")
    _zero(count, "paged")


def test_counters_reset_across_repeated_launches():
    """One counter buffer, many launches back to back with fresh data and changing split
    counts: a counter left non-zero would make a later launch merge too early."""
    count = torch.zeros(64, dtype=torch.int32, device="cuda")
    for i, splits in enumerate([32, 32, 64, 5, 2, 32, 17, 64]):
        B = 1 if i % 2 == 0 else 8
        q, k, v = dense_inputs(B, 1, 1500, 32, 8, 128, BF16, seed=seed_of("repeated", i, splits))
        out, _ = fused_decode(q, k, v, splits, count=count)
        assert_close(out, reference(q, k, v), BF16, f"launch {i} splits={splits}")
        _zero(count, f"launch {i}")


def test_fused_decode_under_cuda_graph_replays():
    """Three fused launches sharing one counter buffer in a graph; replayed with new data and
    new device-side lengths; the counters are 0 after every replay."""
    Hq, Hkv, D = 32, 8, 128
    q, cache = paged_inputs([4096], 16, Hq, Hkv, D, BF16, seed=seed_of("graph replays paged"))
    q2, k, v = dense_inputs(2, 1, 3000, Hq, Hkv, D, BF16, seed=seed_of("graph replays dense"))
    gen = generator(seed_of("graph replays refills"))
    count = torch.zeros(32, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_paged_decode(q, cache, 32, count)
        fused_decode(q2, k, v, 20, count)
    torch.cuda.current_stream().wait_stream(s)
    _zero(count, "warm-up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_a, _ = fused_paged_decode(q, cache, 32, count)
        out_b, _ = fused_decode(q2, k, v, 20, count)
        out_c, _ = fused_paged_decode(q, cache, 64, count)
    for rep, n in enumerate([4096, 3000, 77]):
        for t in (q, q2, k, cache.v_cache):
            t.copy_(randn(gen, t.shape))
        cache.kv_lens.fill_(n)
        cache.kv_lens_host = [n]
        graph.replay()
        torch.cuda.synchronize()
        kb, vb = cache.gather(0)
        ref = reference(q, kb[None], vb[None])
        assert_close(out_a, ref, BF16, f"graph paged replay {rep}")
        assert_close(out_c, ref, BF16, f"graph paged (64 splits) replay {rep}")
        assert_close(out_b, reference(q2, k, v), BF16, f"graph contiguous replay {rep}")
        _zero(count, f"replay {rep}")


def test_counter_validation():
    mod = module("attn_decode")
    q, k, _ = dense_inputs(1, 1, 500, 32, 8, 128, BF16, seed=seed_of("counter validation"))
    ws_o, ws_lse, _ = _workspace(4, 1, 32, 128, 8)
    out = poisoned_like(q)
    for count, word in [(torch.zeros(7, dtype=torch.int32, device="cuda"), "at least 8"),
                        (torch.zeros(8, dtype=torch.float32, device="cuda"), "int32")]:
        with pytest.raises(ValueError, match=word):
            mod.attn_decode(abi(q), abi(k), abi(k), abi(out), None, 4, abi(ws_o), abi(ws_lse),
                            stream_handle(q.device), abi(count))
