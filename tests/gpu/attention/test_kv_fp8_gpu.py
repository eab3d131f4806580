"""The paged decode and prefill over FP8 pages (float8_e4m3fn / float8_e5m2; scales per tensor and per kv
head) against the float64 reference over the dequantized pages (stored * scale), with splits,
the variants and the quantizing append of a decode step; the quantizing append against the torch
path's bytes; and ``attention()`` over ``PagedKVCache(kv_dtype=...)`` on the CUDA backend. Free
cache slots are NaN (quantized: NaN bytes), outputs NaN-poisoned."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from attention_cases import (abi, assert_close, module, paged_inputs, poisoned_like, ragged_plan, reference,
                                 seed_of, take_new_tokens, variant_arg)

    from astrai.extension.abi import stream_handle
    from astrai.extension.backend.attention.variant import alibi_slopes
    from astrai.extension.kv_quant import calibrated_scale, dequantize, quantize

BF16, FP16 = torch.bfloat16, torch.float16
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_copy(cache, kv_dtype, per_head: bool, seed: int):
    """The cache's pages quantized (in place of its 16-bit pages): scales from each tensor's
    amax times a factor in [1, 1.5), so values are not all at the format's top; returns the
    16-bit pages kept aside and (k_scale, v_scale)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    granularity = "head" if per_head else "tensor"
    pages16 = cache.k_cache, cache.v_cache
    scales = []
    for t in pages16:
        s = calibrated_scale(t, granularity, kv_dtype)
        scales.append(s * (1 + 0.5 * torch.rand(s.shape, generator=g, device="cuda")))
    cache.k_cache = quantize(pages16[0], scales[0], kv_dtype)
    cache.v_cache = quantize(pages16[1], scales[1], kv_dtype)
    return pages16, tuple(scales)


def dequantized(cache, b, scales):
    """Request b's K/V as float32 ``stored * scale`` (the values the kernel must attend over),
    gathered as bytes."""
    n = cache.kv_lens_host[b]
    pages = cache.kv_indices[cache.kv_indptr[b]: cache.kv_indptr[b + 1]].long()
    rows = lambda t: t.view(torch.uint8)[pages].flatten(0, 1)[:n].view(t.dtype)  # noqa: E731
    return (dequantize(rows(cache.k_cache), scales[0], torch.float32),
            dequantize(rows(cache.v_cache), scales[1], torch.float32))


def direct_fp8_decode(q, cache, scales, variant=None, splits=None, k_new=None, v_new=None):
    mod = module("attn_paged_decode")
    batch, hq, d = q.shape[0], q.shape[2], q.shape[3]
    if splits is None:
        hint = -(-cache.kv_indices.numel() * cache.page // batch)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = mod.decode_plan(batch, cache.k_cache.shape[2], hq // cache.k_cache.shape[2], d, hint, sms, kv_bytes=1)
    ws_o = torch.empty(max(splits, 1) * batch * hq * d, dtype=torch.float32, device="cuda")
    ws_lse = torch.empty(max(splits, 1) * batch * hq, dtype=torch.float32, device="cuda")
    out = poisoned_like(q)
    append = () if k_new is None else (abi(k_new), abi(v_new), None, True)
    mod.attn_paged_decode(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),
                          abi(cache.kv_indices), abi(cache.kv_lens), splits, abi(ws_o), abi(ws_lse),
                          stream_handle(q.device), None, False, *append, variant=variant,
                          kv_scales=(abi(scales[0]), abi(scales[1])))
    return out, splits


def check_against_reference(out, q, cache, scales, dtype, what, **kw):
    for b in range(q.shape[0]):
        k, v = dequantized(cache, b, scales)
        assert_close(out[b:b + 1], reference(q[b:b + 1], k[None], v[None], **kw), dtype, f"{what} b={b}")


def test_module_states_the_page_dtypes():
    assert tuple(module("attn_paged_decode").KV_DTYPES) == ("float8_e4m3fn", "float8_e5m2")


# (lens, page, Hq, Hkv, D, dtype)
CASES = [
    ([1, 50, 301], 1, 32, 8, 128, BF16),
    ([33, 129, 1025, 7], 16, 32, 8, 128, FP16),
    ([257, 63, 64], 64, 16, 4, 64, BF16),
    ([32768], 16, 32, 8, 128, BF16),  # many splits
    ([200] * 8, 16, 8, 8, 256, BF16),  # multi-head
    ([700, 90], 16, 32, 1, 128, FP16),  # G = 32
    ([100, 4000], 16, 16, 2, 256, FP16),
    ([5000], 16, 8, 8, 64, FP16),
]


@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lens,page,Hq,Hkv,D,dtype", CASES)
def test_paged_decode_over_fp8_pages(lens, page, Hq, Hkv, D, dtype, fmt, per_head):
    seed = seed_of("fp8 decode", lens, page, Hq, Hkv, D, dtype, fmt, per_head)
    q, cache = paged_inputs(lens, page, Hq, Hkv, D, dtype, seed=seed)
    _, scales = fp8_copy(cache, FORMATS[fmt], per_head, seed)
    out, splits = direct_fp8_decode(q, cache, scales)
    check_against_reference(out, q, cache, scales, dtype, f"fp8 {fmt} decode page={page} splits={splits}")


def direct_fp8_prefill(q, cache, scales, q_lens, causal=True, variant=None):
    mod = module("attn_paged_prefill")
    out = poisoned_like(q)
    qo, tb, ti = ragged_plan(q_lens, q.device)
    mod.attn_paged_prefill(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(qo), abi(cache.kv_indptr),
                           abi(cache.kv_indices), abi(cache.kv_lens), abi(tb), abi(ti), causal,
                           stream_handle(q.device), variant=variant, kv_scales=(abi(scales[0]), abi(scales[1])))
    return out


# (q_lens, prefix, page, Hq, Hkv, D, dtype, causal): chunked (a prefix already cached), ragged,
# every head dim, multi-head and group 5, pages of 1 / 16 / 64 shuffled
PREFILL_CASES = [
    ([70, 10, 130], [0, 33, 64], 16, 32, 8, 128, BF16, True),
    ([1, 1, 1000], [3000, 0, 7], 1, 32, 4, 128, FP16, True),
    ([65, 200], [0, 300], 16, 16, 16, 256, BF16, False),
    ([129, 300], [0, 17], 64, 40, 8, 64, FP16, False),
    ([300, 513], [24, 0], 16, 8, 8, 64, BF16, True),
]


@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_lens,prefix,page,Hq,Hkv,D,dtype,causal", PREFILL_CASES)
def test_paged_prefill_over_fp8_pages(q_lens, prefix, page, Hq, Hkv, D, dtype, causal, fmt, per_head):
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    seed = seed_of("fp8 prefill", q_lens, prefix, page, Hq, Hkv, D, dtype, causal, fmt, per_head)
    q, cache = paged_inputs(kv_lens, page, Hq, Hkv, D, dtype, q_lens=q_lens, seed=seed)
    _, scales = fp8_copy(cache, FORMATS[fmt], per_head, seed)
    out = direct_fp8_prefill(q, cache, scales, q_lens, causal)
    start = 0
    for b, n in enumerate(q_lens):
        k, v = dequantized(cache, b, scales)
        ref = reference(q[start:start + n][None], k[None], v[None], causal=causal)
        assert_close(out[start:start + n][None], ref, dtype, f"fp8 {fmt} prefill b={b} q={n} kv={kv_lens[b]}")
        start += n


@pytest.mark.parametrize("variant", ["window37", "all", "alibi", "alibi_all"])
def test_paged_prefill_over_fp8_pages_with_variants(variant):
    q_lens, prefix, page, Hq, Hkv, D, dtype = [70, 300], [200, 0], 16, 32, 8, 128, BF16
    seed = seed_of("fp8 prefill variant", variant)
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    q, cache = paged_inputs(kv_lens, page, Hq, Hkv, D, dtype, q_lens=q_lens, seed=seed)
    _, scales = fp8_copy(cache, torch.float8_e4m3fn, True, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    sinks = torch.randn(Hq, generator=g, device="cuda") * 2 + 1
    slopes = alibi_slopes(Hq, "cuda")
    kw = {"window37": dict(window_left=37),
          "all": dict(window_left=61, logits_soft_cap=20.0, sinks=sinks, scale=0.1),
          "alibi": dict(alibi_slopes=slopes),
          "alibi_all": dict(window_left=61, logits_soft_cap=20.0, sinks=sinks, scale=0.1, alibi_slopes=slopes)}[variant]
    out = direct_fp8_prefill(q, cache, scales, q_lens, True, variant_arg(**kw))
    start = 0
    for b, n in enumerate(q_lens):
        k, v = dequantized(cache, b, scales)
        ref = reference(q[start:start + n][None], k[None], v[None], causal=True, **kw)
        assert_close(out[start:start + n][None], ref, dtype, f"fp8 prefill {variant} b={b}")
        start += n


@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (32, 1, 64), (8, 2, 256)])
def test_bfloat16_queries_of_any_magnitude(Hq, Hkv, D):
    """The scores run on float16 with each bfloat16 query row scaled by a power of two: rows from
    1e-12 to 1e6 (outside float16's range, inside bfloat16's) keep their results, and a row with
    one large element beside small ones still sees them."""
    seed = seed_of("fp8 q magnitudes", Hq, Hkv, D)
    q, cache = paged_inputs([70, 513], 16, Hq, Hkv, D, BF16, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    exponents = torch.randint(-12, 7, (1, 1, Hq, 1), generator=g, device="cuda").float()
    q = (q.float() * 10.0 ** exponents).to(BF16)
    q[:, :, 0, 0] = 3e4  # row 0: one element near the scaled row's top, the rest ~1
    _, scales = fp8_copy(cache, torch.float8_e4m3fn, True, seed)
    # ALiBi's bias enters each row in the units of its scaled scores (alibi: the row's factor divided out)
    for kw in ({}, {"scale": 1e-6}, {"alibi_slopes": alibi_slopes(Hq, "cuda")}):
        out, _ = direct_fp8_decode(q, cache, scales, variant_arg(**kw), splits=1)
        check_against_reference(out, q, cache, scales, BF16, f"bf16 q magnitudes {sorted(kw)}", **kw)


@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("variant", ["window37", "softcap30", "sinks", "all", "alibi", "alibi_all"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_decode_over_fp8_pages_with_variants(fmt, variant, splits):
    lens, page, Hq, Hkv, D, dtype = [300, 1025, 64], 16, 32, 8, 128, BF16
    seed = seed_of("fp8 variant", fmt, variant, splits)
    q, cache = paged_inputs(lens, page, Hq, Hkv, D, dtype, seed=seed)
    _, scales = fp8_copy(cache, FORMATS[fmt], True, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    sinks = torch.randn(Hq, generator=g, device="cuda") * 2 + 1
    slopes = alibi_slopes(Hq, "cuda")
    kw = {"window37": dict(window_left=37), "softcap30": dict(logits_soft_cap=30.0), "sinks": dict(sinks=sinks),
          "all": dict(window_left=61, logits_soft_cap=20.0, sinks=sinks, scale=0.1),
          "alibi": dict(alibi_slopes=slopes),
          "alibi_all": dict(window_left=61, logits_soft_cap=20.0, sinks=sinks, scale=0.1, alibi_slopes=slopes)}[variant]
    out, _ = direct_fp8_decode(q, cache, scales, variant_arg(**kw), splits=splits)
    check_against_reference(out, q, cache, scales, dtype, f"fp8 {fmt} {variant} splits={splits}", **kw)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_decode_step_quantizes_its_token_first(dtype, fmt):
    """append_last over FP8 pages: the step's token is quantized into its row (NaN before) and
    attended over, as the torch path's append then attention would."""
    lens, page, Hq, Hkv, D = [300, 17, 1025, 64], 16, 32, 8, 128
    seed = seed_of("fp8 append", dtype, fmt)
    q, cache = paged_inputs(lens, page, Hq, Hkv, D, dtype, seed=seed)
    k_new, v_new, k_full, v_full = take_new_tokens(cache)  # the rows are NaN now
    _, scales = fp8_copy(cache, FORMATS[fmt], False, seed)
    out, _ = direct_fp8_decode(q, cache, scales, splits=3, k_new=k_new, v_new=v_new)
    written = cache.k_cache.clone(), cache.v_cache.clone()
    cache.k_cache, cache.v_cache = quantize(k_full, scales[0], FORMATS[fmt]), quantize(v_full, scales[1], FORMATS[fmt])
    assert torch.equal(written[0].view(torch.uint8), cache.k_cache.view(torch.uint8))
    assert torch.equal(written[1].view(torch.uint8), cache.v_cache.view(torch.uint8))
    check_against_reference(out, q, cache, scales, dtype, f"fp8 {fmt} appending decode")


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_kv_append_writes_the_torch_paths_bytes(dtype, fmt, per_head, aligned):
    """Values over the format's whole range (saturating, subnormal, underflowing, zeros, NaN)."""
    kv_dtype = FORMATS[fmt]
    T, Hkv, D, pages, page = 300, 4, 128, 40, 16
    g = torch.Generator(device="cuda").manual_seed(seed_of("fp8 kv_append", dtype, fmt, per_head, aligned))
    width = D if aligned else D + 3  # rows that are not 16-byte aligned take the one-value path
    def values():
        base = torch.randn(T, Hkv, width, generator=g, device="cuda")
        exponent = torch.randint(-24, 12, (T, Hkv, width), generator=g, device="cuda").float()
        x = (base * torch.exp2(exponent)).to(dtype)
        x.view(-1)[::97] = 0.0
        x.view(-1)[5::389] = float("nan")
        return x[..., :D]
    k_new, v_new = values(), values()
    shape = (Hkv,) if per_head else (1,)
    k_scale = torch.rand(shape, generator=g, device="cuda") * 0.01 + 1e-3
    v_scale = torch.rand(shape, generator=g, device="cuda") * 0.01 + 1e-3
    k_cache = torch.zeros(pages, page, Hkv, D, dtype=kv_dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(1))[:T].cuda()
    module("attn_paged_decode").kv_append(abi(k_new), abi(v_new), abi(k_cache), abi(v_cache), abi(slots),
                                          stream_handle(k_new.device), kv_scales=(abi(k_scale), abi(v_scale)))
    for got, x, s in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
        want = quantize(x, s, kv_dtype).view(torch.uint8)
        rows = got.view(-1, Hkv, D).view(torch.uint8)[slots]
        nan = torch.isnan(x)
        assert torch.equal(rows[~nan], want[~nan]), f"{fmt} {dtype}: bytes differ from the torch path's"
        assert torch.isnan(got.view(torch.uint8).view(-1, Hkv, D)[slots].view(kv_dtype).float()[nan]).all()


def test_bad_scales_are_refused_before_any_launch():
    q, cache = paged_inputs([40], 16, 8, 2, 64, BF16, seed=3)
    _, scales = fp8_copy(cache, torch.float8_e4m3fn, False, 3)
    mod = module("attn_paged_decode")
    args = lambda out: (abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),  # noqa: E731
                        abi(cache.kv_indices), abi(cache.kv_lens), 1, None, None, stream_handle(q.device))
    out = poisoned_like(q)
    with pytest.raises(ValueError, match="kv_scales"):
        mod.attn_paged_decode(*args(out))
    with pytest.raises(ValueError, match="k_scale"):
        mod.attn_paged_decode(*args(out), kv_scales=(abi(scales[0].half()), abi(scales[1])))
    with pytest.raises(ValueError, match="v_scale"):
        mod.attn_paged_decode(*args(out), kv_scales=(abi(scales[0]), abi(torch.ones(3, device="cuda"))))
    assert torch.isnan(out).all()


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_attention_decodes_fp8_caches_on_the_cuda_backend(kv_dtype, granularity):
    """The public path: a prefill (the CUDA prefill over FP8 pages) then two
    decode steps on the CUDA backend (explain says so; the first appends through the kernel's
    quantizing append), equal to the torch path over the same pages."""
    from astrai.extension import ATTN_BACKEND, attention, attn_backend, explain
    from astrai.extension.kv_cache import PagedKVCache

    hq, hkv, d = 32, 8, 128
    cache = PagedKVCache(2, 64, 16, hkv, d, dtype=BF16, device="cuda", kv_dtype=kv_dtype,
                         kv_scale_granularity=granularity)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(BF16)  # noqa: E731
    for s in ("a", "b"):
        cache.add_sequence(s)
    cache.plan(["a", "b"], [120, 70])
    for layer in range(2):
        attention(rand(1, 190, hq, d), rand(1, 190, hkv, d), rand(1, 190, hkv, d), kv_cache=cache, layer_id=layer,
                  is_causal=True)
    for _ in range(2):
        cache.plan(["a", "b"], [1, 1])
        for layer in range(2):
            q, k, v = rand(2, 1, hq, d), rand(2, 1, hkv, d), rand(2, 1, hkv, d)
            got = attention(q, k, v, kv_cache=cache, layer_id=layer)
            assert any(x.chosen == "cuda" for x in explain("attention") if "decode" in str(x.key))
            with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
                want = attention(q, k, v, kv_cache=cache, layer_id=layer)  # rewrites the same bytes
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
