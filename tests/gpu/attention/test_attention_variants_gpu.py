"""Every attention kernel with every variant feature (window, soft-cap, sinks, ALiBi, scale) against
the float64 reference: dense and paged decode (one split, several, the fused append with the
in-kernel merge), dense and paged prefill (ragged, chunked: a prefix already cached), pages
1 / 16 / 64 shuffled, GQA groups 1-32, d 64 / 128 / 256, bf16 and fp16. Outputs NaN-poisoned;
free cache slots NaN. Then the public path: ``attention()`` runs them on the CUDA backend."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from attention_cases import (assert_close, dense_inputs, direct_decode, direct_paged_decode,
                                 direct_paged_decode_appending, direct_paged_prefill, direct_prefill, generator,
                                 paged_inputs, random_mask, reference, seed_of, take_new_tokens, variant_arg)

BF16, FP16 = torch.bfloat16, torch.float16


def sinks(hq, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(hq, generator=g, device="cuda") * 2 + 1


def slopes(hq, seed):
    """ALiBi's slopes (the paper's) each times a factor in [0.5, 1.5): a head given another head's
    slope shows."""
    from astrai.extension.backend.attention.variant import alibi_slopes
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return alibi_slopes(hq, "cuda") * (0.5 + torch.rand(hq, generator=g, device="cuda"))


# name -> keywords of attention() (sinks and slopes drawn per case: True)
VARIANTS = {
    "window0": dict(window_left=0),
    "window37": dict(window_left=37),
    "window_past_context": dict(window_left=1 << 20),
    "softcap5": dict(logits_soft_cap=5.0),
    "softcap50": dict(logits_soft_cap=50.0),
    "sinks": dict(sinks=True),
    "scale": dict(scale=0.3),
    "all": dict(window_left=61, logits_soft_cap=20.0, sinks=True, scale=0.1),
    "alibi": dict(alibi_slopes=True),
    "alibi_softcap": dict(alibi_slopes=True, logits_soft_cap=5.0, scale=0.2),
    "alibi_all": dict(alibi_slopes=True, window_left=61, logits_soft_cap=20.0, sinks=True, scale=0.1),
}


def keywords(name, hq, seed):
    kw = dict(VARIANTS[name])
    if kw.get("sinks"):
        kw["sinks"] = sinks(hq, seed)
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = slopes(hq, seed)
    return kw


# (B, S, Hq, Hkv, D, dtype, mask)
DECODE = [
    (1, 4096, 32, 8, 128, BF16, None),  # several splits
    (7, 63, 32, 4, 128, BF16, "2d"),
    (3, 65, 16, 16, 256, FP16, None),
    (2, 5001, 64, 2, 128, FP16, None),  # G = 32
    (16, 1000, 32, 8, 64, BF16, None),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,S,Hq,Hkv,D,dtype,mask", DECODE)
def test_decode_variants(B, S, Hq, Hkv, D, dtype, mask, variant):
    seed = seed_of("decode variant", B, S, Hq, Hkv, D, dtype, mask, variant)
    q, k, v = dense_inputs(B, 1, S, Hq, Hkv, D, dtype, "BLHD", seed=seed)
    m = None if mask is None else random_mask(generator(seed + 7), (B, S))
    kw = keywords(variant, Hq, seed)
    out, splits = direct_decode(q, k, v, m, variant_arg(**kw))
    assert_close(out, reference(q, k, v, m, **kw), dtype, f"decode {variant} B={B} S={S} splits={splits}")


# (lens, page, Hq, Hkv, D, dtype)
PAGED_DECODE = [
    ([1, 50, 301], 1, 32, 8, 128, BF16),
    ([33, 129, 1025, 7], 16, 32, 8, 128, FP16),
    ([257, 63, 64], 64, 16, 4, 64, BF16),
    ([32768], 16, 32, 8, 128, BF16),
    ([200] * 8, 16, 8, 8, 256, BF16),  # multi-head
    ([700, 90], 16, 32, 1, 128, FP16),  # G = 32
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lens,page,Hq,Hkv,D,dtype", PAGED_DECODE)
def test_paged_decode_variants(lens, page, Hq, Hkv, D, dtype, variant):
    seed = seed_of("paged decode variant", lens, page, Hq, Hkv, D, dtype, variant)
    q, cache = paged_inputs(lens, page, Hq, Hkv, D, dtype, seed=seed)
    kw = keywords(variant, Hq, seed)
    out, splits = direct_paged_decode(q, cache, variant_arg(**kw))
    for b in range(len(lens)):
        k, v = cache.gather(b)
        assert_close(out[b:b + 1], reference(q[b:b + 1], k[None], v[None], **kw), dtype,
                     f"paged decode {variant} b={b} len={lens[b]} page={page} splits={splits}")


@pytest.mark.parametrize("variant", ["window37", "sinks", "all", "alibi_all"])
@pytest.mark.parametrize("splits,in_kernel_merge", [(1, False), (4, False), (4, True)])
def test_paged_decode_appending_variants(splits, in_kernel_merge, variant):
    """The fused append with the variants, the splits merged by the combine kernel or in the
    decode kernel (where the sinks join the split weights)."""
    lens, page, Hq, Hkv, D, dtype = [300, 1025, 64], 16, 32, 8, 128, BF16
    seed = seed_of("append variant", splits, in_kernel_merge, variant)
    q, cache = paged_inputs(lens, page, Hq, Hkv, D, dtype, seed=seed)
    k_new, v_new, k_full, v_full = take_new_tokens(cache)
    kw = keywords(variant, Hq, seed)
    out, _ = direct_paged_decode_appending(q, cache, k_new, v_new, splits, in_kernel_merge, variant_arg(**kw))
    cache.k_cache.copy_(k_full)
    cache.v_cache.copy_(v_full)
    for b in range(len(lens)):
        k, v = cache.gather(b)
        assert_close(out[b:b + 1], reference(q[b:b + 1], k[None], v[None], **kw), dtype,
                     f"appending decode {variant} b={b} splits={splits} merge={in_kernel_merge}")


# (B, Lq, Lkv, Hq, Hkv, D, dtype, causal, mask)
PREFILL = [
    (1, 200, 200, 8, 8, 128, BF16, True, None),
    (2, 100, 300, 32, 8, 64, FP16, True, None),
    (2, 65, 129, 16, 16, 256, BF16, False, "2d"),
    (1, 1000, 1000, 32, 8, 128, BF16, True, None),
    (2, 333, 2049, 16, 2, 64, BF16, False, None),
    (1, 129, 300, 40, 8, 128, FP16, True, "3d"),  # G = 5
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,Lq,Lkv,Hq,Hkv,D,dtype,causal,mask", PREFILL)
def test_prefill_variants(B, Lq, Lkv, Hq, Hkv, D, dtype, causal, mask, variant):
    seed = seed_of("prefill variant", B, Lq, Lkv, Hq, Hkv, D, dtype, causal, mask, variant)
    q, k, v = dense_inputs(B, Lq, Lkv, Hq, Hkv, D, dtype, "BLHD", seed=seed)
    m = None if mask is None else random_mask(generator(seed + 7), (B, Lkv) if mask == "2d" else (B, Lq, Lkv))
    kw = keywords(variant, Hq, seed)
    out = direct_prefill(q, k, v, m, causal, variant_arg(**kw))
    assert_close(out, reference(q, k, v, m, causal, **kw), dtype, f"prefill {variant} B={B} Lq={Lq} Lkv={Lkv}")


# (q_lens, prefix, page, Hq, Hkv, D, dtype, causal)
PAGED_PREFILL = [
    ([70, 10, 130], [5, 100, 63], 16, 32, 8, 64, FP16, True),
    ([1, 1, 1000], [3000, 0, 0], 1, 32, 4, 128, BF16, True),
    ([65, 200], [0, 300], 64, 16, 16, 256, BF16, False),
    ([700, 129], [0, 300], 16, 32, 1, 128, BF16, True),  # G = 32
    ([300, 64], [500, 0], 16, 8, 8, 128, BF16, True),  # multi-head, a chunk after a cached prefix
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("q_lens,prefix,page,Hq,Hkv,D,dtype,causal", PAGED_PREFILL)
def test_paged_prefill_variants(q_lens, prefix, page, Hq, Hkv, D, dtype, causal, variant):
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    seed = seed_of("paged prefill variant", q_lens, prefix, page, Hq, Hkv, D, dtype, causal, variant)
    q, cache = paged_inputs(kv_lens, page, Hq, Hkv, D, dtype, q_lens=q_lens, seed=seed)
    kw = keywords(variant, Hq, seed)
    out = direct_paged_prefill(q, cache, q_lens, causal, variant_arg(**kw))
    start = 0
    for b, n in enumerate(q_lens):
        k, v = cache.gather(b)
        ref = reference(q[start:start + n][None], k[None], v[None], causal=causal, **kw)
        assert_close(out[start:start + n][None], ref, dtype, f"paged prefill {variant} b={b} q={n} kv={kv_lens[b]}")
        start += n


def test_bad_variants_raise_before_launch():
    q, k, v = dense_inputs(1, 1, 64, 8, 8, 128, BF16, "BLHD", seed=1)
    for bad, name in (((-1.0, 0.0, -1, None), "scale"), ((0.0, float("nan"), -1, None), "logits_soft_cap"),
                      ((0.0, 0.0, -2, None), "window_left"),
                      ((0.0, 0.0, -1, torch.zeros(3, device="cuda")), "sinks"),
                      ((0.0, 0.0, -1, torch.zeros(8, device="cuda", dtype=torch.float16)), "sinks")):
        if isinstance(bad[3], torch.Tensor):
            from attention_cases import abi
            bad = (*bad[:3], abi(bad[3]))
        with pytest.raises(ValueError, match=name):
            direct_decode(q, k, v, None, bad)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_attention_runs_the_variants_on_the_cuda_backend(mode):
    """The public path: a cache, a ragged prefill or a decode step with every feature, on the
    CUDA backend (explain says so), equal to the torch path on the same cache."""
    from astrai.extension import ATTN_BACKEND, attention, attn_backend, explain
    from astrai.extension.kv_cache import PagedKVCache

    hq, hkv, d = 32, 8, 128
    cache = PagedKVCache(1, 64, 16, hkv, d, dtype=BF16, device="cuda")
    for s in ("a", "b"):
        cache.add_sequence(s)
    gen = torch.Generator(device="cuda").manual_seed(3)
    kw = dict(window_left=40, logits_soft_cap=30.0, sinks=sinks(hq, 4), scale=0.1)
    q_lens = [90, 33] if mode == "prefill" else [1, 1]
    if mode == "decode":  # a cached prefix first, through the torch path
        cache.plan(["a", "b"], [120, 70])
        pre = [torch.randn(1, 190, h, d, device="cuda", generator=gen).to(BF16) for h in (hq, hkv, hkv)]
        with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
            attention(*pre, kv_cache=cache, layer_id=0, **kw)
    cache.plan(["a", "b"], q_lens)
    n = sum(q_lens)
    q, k, v = (torch.randn(1, n, h, d, device="cuda", generator=gen).to(BF16) for h in (hq, hkv, hkv))
    if mode == "decode":
        q, k, v = (t.reshape(2, 1, *t.shape[2:]) for t in (q, k, v))
    with attn_backend(ATTN_BACKEND.CUDA):
        got = attention(q, k, v, kv_cache=cache, layer_id=0, **kw)
    assert any(d.chosen == "cuda" and "sinks" in str(d.key) for d in explain("attention"))
    with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
        want = attention(q, k, v, kv_cache=cache, layer_id=0, **kw)  # rewrites the same slots
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", ["dense", "prefill", "decode"])
def test_alibi_runs_on_the_cuda_backend(mode):
    """ALiBi through the public path: dense, a chunk over a cached prefix and a decode step, on
    the CUDA backend (explain says so), equal to the float64 reference."""
    from astrai.extension import attention, explain
    from astrai.extension.backend.attention.variant import alibi_slopes
    from astrai.extension.kv_cache import PagedKVCache

    hq, hkv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    kw = dict(alibi_slopes=alibi_slopes(hq, "cuda"), window_left=300)
    if mode == "dense":
        q, k, v = (torch.randn(2, n, h, d, device="cuda", generator=gen).to(BF16)
                   for n, h in ((97, hq), (610, hkv), (610, hkv)))
        got = attention(q, k, v, is_causal=True, **kw)
        want, magnitude = reference(q, k, v, None, True, **kw)
    else:
        cache = PagedKVCache(1, 96, 16, hkv, d, dtype=BF16, device="cuda")
        cache.add_sequence("a")
        seq = [torch.randn(1, 700, h, d, device="cuda", generator=gen).to(BF16) for h in (hq, hkv, hkv)]
        done = 699 if mode == "decode" else 500
        cache.plan(["a"], [done])
        attention(*(t[:, :done] for t in seq), kv_cache=cache, layer_id=0, **kw)
        cache.plan(["a"], [700 - done])
        got = attention(*(t[:, done:700] for t in seq), kv_cache=cache, layer_id=0, **kw)
        want, magnitude = reference(seq[0][:, done:700], seq[1], seq[2], None, True, **kw)
    assert_close(got, (want, magnitude), BF16, f"alibi {mode}")
    decisions = [d for d in explain("attention") if "alibi_slopes" in str(d.key)]
    assert decisions and all(d.chosen == "cuda" for d in decisions), [str(d) for d in decisions]
