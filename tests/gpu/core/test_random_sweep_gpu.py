"""Randomized sweep of every kernel on the GPU against the float64 references.

Each case draws its shapes, dtype, layout and values from a seeded generator (the seed
is in the test id, so a failure reproduces with ``-k``). Attention and GEMM results are
checked element-wise within the rounding of their storage format (``checks``). The plugin kernels are called
through their ops wrappers (no fallback) and through the public entry points, whose
decisions must name the kernel. Strided inputs are views into NaN-poisoned storage.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from checks import assert_attention_close, assert_gemm_close
from fp8_reference import FP8, encode, gemm_reference
from reference import attention_ref64, rotary_ref, tolerance

from astrai.extension import ATTN_BACKEND, PagedKVCache, apply_rotary_emb, attention, attn_backend, explain
from astrai.extension.ops import attention as attn_ops
from astrai.extension.ops import fp8 as fp8_ops
from astrai.extension.ops import rotary as rotary_ops

pytestmark = pytest.mark.gpu

DEV = "cuda"
SEEDS = range(12)


def randn(gen: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(DEV, dtype)


def poisoned_view(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` as a contiguous tensor, a permuted (BHLD) view or a row-padded view; the
    storage gaps hold NaN."""
    if layout == "contiguous":
        return values.contiguous()
    if layout == "permuted":
        return values.transpose(1, 2).contiguous().transpose(1, 2)
    shape = tuple(values.shape)
    store = torch.full(shape[:-1] + (shape[-1] + 8,), math.nan, dtype=values.dtype, device=values.device)
    store[..., : shape[-1]] = values
    return store[..., : shape[-1]]


@pytest.mark.parametrize("seed", SEEDS)
def test_rotary_kernel_random(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    b, seq, h = rng.randint(1, 4), rng.randint(1, 300), rng.randint(1, 16)
    d = rng.choice([32, 64, 80, 128, 256])
    x = poisoned_view(randn(gen, b, seq, h, d, dtype=torch.bfloat16), rng.choice(["contiguous", "permuted", "padded"]))
    angles = torch.rand(seq, d // 2, generator=gen, dtype=torch.float64) * 1000
    cos, sin = angles.cos().float().to(DEV), angles.sin().float().to(DEV)
    ref = rotary_ref(x, cos, sin)
    out = rotary_ops.rotary_emb(x, cos, sin)
    torch.testing.assert_close(out.double().cpu(), ref, **tolerance(torch.bfloat16))
    with torch.no_grad():
        out = apply_rotary_emb(x, (cos, sin))
    torch.testing.assert_close(out.double().cpu(), ref, **tolerance(torch.bfloat16))
    assert explain("rotary_emb")[-1].chosen == "cuda"


@pytest.mark.parametrize("seed", SEEDS)
def test_dense_attention_kernels_random(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    b, hkv, group, d = rng.randint(1, 4), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([64, 128, 256])
    lkv = rng.randint(1, 700)
    layout = rng.choice(["contiguous", "permuted", "padded"])
    k = poisoned_view(randn(gen, b, lkv, hkv, d, dtype=dtype), layout)
    v = poisoned_view(randn(gen, b, lkv, hkv, d, dtype=dtype), layout)
    mask = (torch.rand(b, lkv, generator=gen) < 0.8).to(DEV) if rng.random() < 0.5 else None
    q = poisoned_view(randn(gen, b, 1, hkv * group, d, dtype=dtype), layout)
    out = attn_ops.attn_decode(q, k, v, mask)
    assert_attention_close(out, attention_ref64(q, k, v, mask), dtype, f"decode seed {seed}")
    lq = rng.randint(1, min(lkv, 300))
    causal = rng.random() < 0.5
    q = poisoned_view(randn(gen, b, lq, hkv * group, d, dtype=dtype), layout)
    mask3 = (torch.rand(b, lq, lkv, generator=gen) < 0.8).to(DEV) if rng.random() < 0.3 else mask
    out = attn_ops.attn_prefill(q, k, v, mask3, is_causal=causal)
    assert_attention_close(out, attention_ref64(q, k, v, mask3, causal), dtype, f"prefill seed {seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_paged_attention_through_the_public_api_random(seed):
    # Ragged prefill over a shuffled page table, then decode steps: every layer, the CUDA
    # backend (strict), against the reference over each request's own tokens.
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    hkv, group, d = rng.choice([1, 2, 8]), rng.choice([1, 4, 8]), rng.choice([64, 128, 256])
    page_size = rng.choice([1, 8, 16, 64])
    seqs = list(range(rng.randint(1, 5)))
    steps = [[rng.randint(1, 200) for _ in seqs], [1] * len(seqs), [rng.randint(1, 70) for _ in seqs], [1] * len(seqs)]
    tokens = [sum(step[i] for step in steps) for i in range(len(seqs))]
    pages = sum(-(-n // page_size) for n in tokens) + 4
    cache = PagedKVCache(2, pages, page_size, hkv, d, dtype=dtype, device=DEV)
    cache.k_pages.fill_(math.nan)  # unwritten slots must never be read
    cache.v_pages.fill_(math.nan)
    for s in seqs:
        cache.add_sequence(s)
    history = {(layer, s): ([], []) for layer in range(2) for s in seqs}
    with torch.no_grad(), attn_backend(ATTN_BACKEND.CUDA):
        for q_lens in steps:
            cache.plan(seqs, q_lens)
            total = sum(q_lens)
            for layer in range(2):
                q = randn(gen, 1, total, hkv * group, d, dtype=dtype)
                k, v = randn(gen, 1, total, hkv, d, dtype=dtype), randn(gen, 1, total, hkv, d, dtype=dtype)
                out = attention(q, k, v, kv_cache=cache, layer_id=layer)
                start = 0
                for s, n in zip(seqs, q_lens):
                    ks, vs = history[(layer, s)]
                    ks.append(k[0, start:start + n])
                    vs.append(v[0, start:start + n])
                    ref = attention_ref64(q[:, start:start + n], torch.cat(ks)[None], torch.cat(vs)[None],
                                          is_causal=True)
                    assert_attention_close(out[:, start:start + n], ref, dtype, f"seed {seed} layer {layer} seq {s}")
                    start += n


def _decode(t: torch.Tensor, fmt: str) -> np.ndarray:
    return t.contiguous().view(FP8[fmt]).to(torch.float64).cpu().numpy()


@pytest.mark.parametrize("seed", SEEDS)
def test_fp8_quantize_kernel_random(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    m, k = rng.randint(1, 1100), rng.randint(1, 1100)
    dtype, fmt, layout = rng.choice([torch.bfloat16, torch.float16, torch.float32]), rng.choice(["e4m3", "e5m2"]), rng.randint(0, 2)
    x = randn(gen, m, k, dtype=dtype) * rng.choice([1e-3, 1.0, 100.0])
    x.view(-1)[rng.randrange(x.numel())] = rng.choice([math.nan, math.inf, 1e30])  # one special value
    multiplier = torch.tensor(2.0 ** rng.uniform(-8, 8), device=DEV)
    q, q_t, amax = fp8_ops.fp8_quantize(x, multiplier, fmt, layout)
    scaled = (x.float().cpu().numpy() * np.float32(multiplier.item())).astype(np.float64)
    expected = torch.from_numpy(encode(scaled, fmt)).view(FP8[fmt]).to(torch.float64).numpy()
    for got in ([q] if layout == 0 else [q_t.t()] if layout == 1 else [q, q_t.t()]):
        np.testing.assert_array_equal(_decode(got, fmt), expected)
    ref_amax = np.abs(x.double().cpu().numpy()).max()
    np.testing.assert_array_equal(amax.cpu().numpy(), np.float32(ref_amax))


@pytest.mark.parametrize("seed", SEEDS)
def test_fp8_gemm_kernel_random(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    m, k, n = rng.randint(1, 1500), rng.choice([16, 32, 48, 1024, rng.randint(1, 2000) // 16 * 16 + 16]), rng.randint(1, 1500)
    fa, fb = rng.choice([("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")])
    a = (randn(gen, m, k) * 2).to(FP8[fa])
    w = (randn(gen, n, k) * 2).to(FP8[fb])
    b = w.t() if rng.random() < 0.7 else w.t().contiguous()
    bias = randn(gen, n, dtype=torch.bfloat16) if rng.random() < 0.5 else None
    scale = torch.tensor(rng.uniform(1e-3, 1.0), device=DEV)
    out = fp8_ops.mm_fp8(a, b, scale, bias)
    ref = gemm_reference(a.cpu(), b.cpu(), float(scale), None if bias is None else bias.cpu())
    assert_gemm_close(out, ref, f"seed {seed}: {m}x{n}x{k} {fa}/{fb}")
