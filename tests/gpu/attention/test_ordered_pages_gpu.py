"""A prefill over FP8 or scattered pages on the CUDA backend, run over the step's pages gathered
in order first (backend/attention/ordered_pages.py) and over the pages in place, against the
torch path over the same cache: chunks after histories whose pages interleave, ragged, GQA 32/8
d128, with and without variants."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


@pytest.mark.parametrize("variant", ["plain", "softcap-sinks-scale"])
@pytest.mark.parametrize("kv", ["e4m3-tensor", "e4m3-head", "bf16"])
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "in-place"])
def test_prefill_over_gathered_pages_equals_the_torch_path(gather, kv, variant, monkeypatch):
    from astrai.extension import ATTN_BACKEND, attention, attn_backend
    from astrai.extension.backend.attention import ordered_pages
    from astrai.extension.kv_cache import PagedKVCache

    monkeypatch.setattr(ordered_pages, "FP8_MIN_ROWS", 1 if gather else None)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_ROWS", 1 if gather else None)
    monkeypatch.setattr(ordered_pages, "SCATTERED_MIN_BREAKS", 0.0)
    hq, hkv, d = 32, 8, 128
    kv_dtype = None if kv == "bf16" else torch.float8_e4m3fn
    cache = PagedKVCache(2, 128, 16, hkv, d, dtype=BF16, device="cuda", kv_dtype=kv_dtype,
                         kv_scale_granularity=kv.split("-")[-1] if kv_dtype else "tensor")
    gen = torch.Generator(device="cuda").manual_seed(11)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(BF16)  # noqa: E731
    sinks = torch.randn(hq, device="cuda", generator=gen)
    kw = {} if variant == "plain" else dict(logits_soft_cap=30.0, sinks=sinks, scale=0.1)
    for s in ("a", "b", "c"):
        cache.add_sequence(s)
    for seqs, lens in ((["b"], [40]), (["a"], [75]), (["b", "c"], [33, 200]), (["a", "b", "c"], [130, 1, 300])):
        plan = cache.plan(seqs, lens)  # the last step: a chunk over each request's interleaved pages
        total = sum(lens)
        for layer in range(2):
            q, k, v = rand(1, total, hq, d), rand(1, total, hkv, d), rand(1, total, hkv, d)
            got = attention(q, k, v, kv_cache=cache, layer_id=layer, is_causal=True, **kw)
            with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
                want = attention(q, k, v, kv_cache=cache, layer_id=layer, is_causal=True, **kw)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (("cuda", "prefill-gathered") in plan.launches) == gather


@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
@pytest.mark.parametrize(("pages_dtype", "out_dtype"), [
    (torch.float8_e4m3fn, BF16), (torch.float8_e4m3fn, torch.float16), (torch.float8_e5m2, BF16),
    (torch.float8_e5m2, torch.float16), (BF16, BF16), (torch.float16, torch.float16)])
def test_the_gather_kernel_gives_the_torch_paths_values(pages_dtype, out_dtype, per_head):
    """The plugin's gather_pages against kv_quant.dequantize (FP8 pages) or a copy (16-bit), bit for
    bit, NaN where the value or the source page is bad; pages of a layer view of a larger cache."""
    from astrai.extension.backend.attention.ordered_pages import gather_pages
    from astrai.extension.kv_quant import dequantize
    from attention_cases import module

    assert hasattr(module("attn_paged_prefill"), "gather_pages")
    gen = torch.Generator(device="cuda").manual_seed(3)
    layers = torch.randn(2, 40, 16, 8, 128, device="cuda", generator=gen) * 300
    layers[1, 7, 3, 2, :4] = float("nan")
    layers[1, 9, 0, 0, :8] = 2.0 ** -17  # fp8 subnormals, times a tiny scale: float32 subnormals
    fp8 = pages_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k_pages = layers[1].clamp(-448, 448).to(pages_dtype) if fp8 else layers[1].to(pages_dtype)
    v_pages = (-layers[1]).clamp(-448, 448).to(pages_dtype) if fp8 else (-layers[1]).to(pages_dtype)
    shape = (8,) if per_head else (1,)
    scales = (torch.rand(shape, device="cuda", generator=gen) + 1e-3, torch.full(shape, 1e-38, device="cuda"))
    source = torch.tensor([39, 7, 0, 9, 9, 22, 40, -1], device="cuda")  # the last two: outside the cache
    k_out = torch.full((8, 16, 8, 128), 5.0, dtype=out_dtype, device="cuda")
    v_out = torch.full_like(k_out, 5.0)
    gather_pages(k_pages, v_pages, source, k_out, v_out, scales if fp8 else None)
    good = source[:6]
    for out, pages, scale in ((k_out, k_pages, scales[0]), (v_out, v_pages, scales[1])):
        want = dequantize(pages[good], scale, out_dtype) if fp8 else pages[good]
        got = out[:6]
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
        assert torch.isnan(out[6:]).all()
