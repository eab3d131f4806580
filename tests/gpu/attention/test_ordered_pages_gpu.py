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
