"""The paged KV append of astrai-attention (``kv_append``, and the same write fused into
``attn_paged_decode`` through ``k_new`` / ``v_new`` / ``slots``) against ``index_copy_`` on
fresh seeded data: NaN-poisoned caches (a row the kernel should write and didn't stays NaN, a
row it should leave and wrote differs), shuffled distinct slots, page sizes 1 / 3 / 16, fp16 and
bf16, 16-byte and element-wise copies ([B, L, H, D] inputs, strided views); every byte compared.
Through ``attention()`` a decode step leaves the same cache as the torch backend's writes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from attention_cases import Paged, abi, module, poisoned_like, seed_of

    from astrai.extension.abi import stream_handle

DTYPES = (torch.float16, torch.bfloat16)


def caches(pages, page, hkv, d, dtype):
    shape = (pages, page, hkv, d)
    return (torch.full(shape, float("nan"), dtype=dtype, device="cuda"),
            torch.full(shape, float("nan"), dtype=dtype, device="cuda"))


def new_tokens(shape, dtype, gen, strided=False):
    """Fresh keys/values of ``shape``; ``strided``: views of wider tensors (element-wise copies)."""
    if strided:
        wide = torch.randn(*shape[:-1], shape[-1] + 3, generator=gen, device="cuda").to(dtype)
        return wide[..., 1:shape[-1] + 1]
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


def reference(k_cache, v_cache, k_new, v_new, slots):
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    rows = k_ref.shape[0] * k_ref.shape[1]
    flat = lambda t: t.reshape(-1, *t.shape[-2:])  # noqa: E731
    k_ref.view(rows, *k_ref.shape[2:]).index_copy_(0, slots, flat(k_new))
    v_ref.view(rows, *v_ref.shape[2:]).index_copy_(0, slots, flat(v_new))
    return k_ref, v_ref


def assert_same(got, want, what):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("layout", ["tokens", "batch", "strided"])
@pytest.mark.parametrize("d", [64, 128])
def test_kv_append_matches_index_copy(dtype, page, layout, d):
    gen = torch.Generator(device="cuda").manual_seed(seed_of("kv_append", dtype, page, layout, d))
    hkv, pages = 4, 11
    k_cache, v_cache = caches(pages, page, hkv, d, dtype)
    tokens = 6
    shape = (tokens, hkv, d) if layout == "tokens" else (3, 2, hkv, d)
    k_new = new_tokens(shape, dtype, gen, strided=layout == "strided")
    v_new = new_tokens(shape, dtype, gen, strided=layout == "strided")
    slots = torch.randperm(pages * page, generator=gen, device="cuda")[:tokens]
    k_ref, v_ref = reference(k_cache, v_cache, k_new, v_new, slots)
    module("attn_paged_decode").kv_append(abi(k_new), abi(v_new), abi(k_cache), abi(v_cache), abi(slots),
                                          stream_handle(k_cache.device))
    torch.cuda.synchronize()
    assert_same(k_cache, k_ref, "k_cache")
    assert_same(v_cache, v_ref, "v_cache")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 3, 16])
def test_decode_with_the_fused_append_equals_append_then_decode(dtype, page):
    batch, hq, hkv, d = 3, 8, 2, 128
    cache = Paged([37, 5, 64], page, hkv, d, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed_of("fused append", dtype, page))
    q = torch.randn(batch, 1, hq, d, generator=gen, device="cuda").to(dtype)
    k_new = torch.randn(batch, 1, hkv, d, generator=gen, device="cuda").to(dtype)
    v_new = torch.randn(batch, 1, hkv, d, generator=gen, device="cuda").to(dtype)
    # each request's last token (kv_lens counts it) goes to the slot its page table gives it
    pos = cache.kv_lens.long() - 1
    pages = cache.kv_indices.long()[cache.kv_indptr.long()[:-1] + torch.div(pos, page, rounding_mode="floor")]
    slots = pages * page + pos % page
    k_ref, v_ref = reference(cache.k_cache, cache.v_cache, k_new, v_new, slots)
    mod = module("attn_paged_decode")

    def decode(k_cache, v_cache, **append):
        out = poisoned_like(q)
        mod.attn_paged_decode(abi(q), abi(k_cache), abi(v_cache), abi(out), abi(cache.kv_indptr),
                              abi(cache.kv_indices), abi(cache.kv_lens), 1, None, None, stream_handle(q.device),
                              **{name: abi(t) for name, t in append.items()})
        return out

    want = decode(k_ref, v_ref)
    got = decode(cache.k_cache, cache.v_cache, k_new=k_new, v_new=v_new, slots=slots)
    torch.cuda.synchronize()
    assert_same(cache.k_cache, k_ref, "k_cache")
    assert_same(cache.v_cache, v_ref, "v_cache")
    assert_same(got, want, "out")


def test_bad_append_arguments_raise_before_any_write():
    k_cache, v_cache = caches(4, 16, 2, 64, torch.bfloat16)
    k_new = torch.randn(2, 2, 64, device="cuda").bfloat16()
    mod = module("attn_paged_decode")
    stream = stream_handle(k_cache.device)
    with pytest.raises(ValueError, match="slots: expected dtype int64"):
        mod.kv_append(abi(k_new), abi(k_new), abi(k_cache), abi(v_cache),
                      abi(torch.zeros(2, dtype=torch.int32, device="cuda")), stream)
    with pytest.raises(ValueError, match=r"slots: expected one slot per new token \[2\]"):
        mod.kv_append(abi(k_new), abi(k_new), abi(k_cache), abi(v_cache),
                      abi(torch.zeros(3, dtype=torch.int64, device="cuda")), stream)
    with pytest.raises(ValueError, match="k_cache: expected bfloat16 \\[num_pages, page_size, 2, 64\\]"):
        mod.kv_append(abi(k_new), abi(k_new), abi(k_cache.half()), abi(v_cache),
                      abi(torch.zeros(2, dtype=torch.int64, device="cuda")), stream)
    torch.cuda.synchronize()
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_step_writes_the_cache_like_the_torch_backend(dtype):
    from astrai.extension import ATTN_BACKEND, PagedKVCache, attention, attn_backend

    gen = torch.Generator(device="cuda").manual_seed(7)
    lens = [29, 3, 48]
    out, pages = {}, {}
    for backend in (ATTN_BACKEND.CUDA, ATTN_BACKEND.TORCH_NATIVE):
        cache = PagedKVCache(2, 24, 16, 2, 128, dtype=dtype, device="cuda", page_order=list(range(24))[::-1])
        fill = torch.Generator(device="cuda").manual_seed(5)  # the same filler in both caches
        cache.k_pages.copy_(torch.randn(cache.k_pages.shape, generator=fill, device="cuda"))
        cache.v_pages.copy_(torch.randn(cache.v_pages.shape, generator=fill, device="cuda"))
        for s in range(3):
            cache.add_sequence(s)
        cache.plan(range(3), lens)
        g = torch.Generator(device="cuda").manual_seed(11)
        for layer in range(2):
            k = torch.randn(1, sum(lens), 2, 128, generator=g, device="cuda").to(dtype)
            cache.append(layer, k, -k)
        cache.plan(range(3), [1, 1, 1])
        gen.manual_seed(7)
        q = torch.randn(3, 1, 8, 128, generator=gen, device="cuda").to(dtype)
        k = torch.randn(3, 1, 2, 128, generator=gen, device="cuda").to(dtype)
        with attn_backend(backend):
            out[backend] = [attention(q, k, 2 * k, kv_cache=cache, layer_id=layer) for layer in (1, 0)]
        pages[backend] = (cache.k_pages.clone(), cache.v_pages.clone())
    for got, want in zip(pages[ATTN_BACKEND.CUDA], pages[ATTN_BACKEND.TORCH_NATIVE]):
        assert_same(got, want, "cache pages")
    for got, want in zip(out[ATTN_BACKEND.CUDA], out[ATTN_BACKEND.TORCH_NATIVE]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
