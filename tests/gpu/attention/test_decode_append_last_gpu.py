"""``attn_paged_decode(..., k_new, v_new, append_last=True)``: a decode step in one launch, the
kernel writing each request's new key/value to the cache row its last position maps to.

Every case starts from a paged cache whose new-token rows (each request's last position)
are NaN, the new keys/values held apart in ``k_new`` / ``v_new``: a kernel that read such a
row from the cache instead of from ``k_new`` would put NaN in the output, and one that
didn't write it (or wrote it elsewhere) leaves the cache different from the full one, which
is compared byte for byte after the call. The output is checked against the float64
reference of the full cache (the new keys are edge keys that carry visible softmax weight),
into a NaN-poisoned ``out``, with one split and with four (combine kernel, in-kernel merge).
Also: the other ``k_new`` layouts and the kv_append fallback (rows that aren't 16-byte
aligned), a request of length 0 (appends nothing), CUDA-graph replays after the page table
moved on (each replay writes its own step's rows), and bad arguments (nothing written).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from attention_cases import (abi, assert_close, direct_paged_decode_appending, last_rows, module, paged_inputs,
                                 poisoned_like, reference, seed_of, take_new_tokens)

    from astrai.extension.abi import stream_handle

SPLITS = 4  # > 1: several splits, the last ones holding no tile for the short requests
LENS = {  # the new token at: a lone token, the end of a tile, the start of one, anywhere
    1: [300],
    3: [1, 64, 257],
    17: [33, 1, 65, 128, 7, 300, 96, 2, 191, 64, 17, 256, 45, 129, 250, 31, 400],
}
HEADS = [(4, 4), (16, 2), (64, 2)]  # GQA groups 1, 8 and 32 (two blocks of query heads per kv head)


def assert_same(got, want, what):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def check_step(q, cache, out, full_k, full_v, dtype, what):
    assert_same(cache.k_cache, full_k, f"{what}: k_cache")
    assert_same(cache.v_cache, full_v, f"{what}: v_cache")
    for b in range(q.shape[0]):
        k, v = cache.gather(b)
        assert_close(out[b:b + 1], reference(q[b:b + 1], k[None], v[None]), dtype,
                     f"{what}: b={b} len={cache.kv_lens_host[b]}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("batch", sorted(LENS))
def test_append_last_equals_the_full_cache(batch, page, d, hq, hkv, dtype):
    lens = LENS[batch]
    q, cache = paged_inputs(lens, page, hq, hkv, d, dtype, seed=seed_of("append_last", lens, page, hq, hkv, d, dtype))
    k_new, v_new, full_k, full_v = take_new_tokens(cache)
    poisoned = cache.k_cache.clone(), cache.v_cache.clone()
    for splits, merge in ((1, False), (SPLITS, False), (SPLITS, True)):
        cache.k_cache.copy_(poisoned[0])
        cache.v_cache.copy_(poisoned[1])
        out, ws_count = direct_paged_decode_appending(q, cache, k_new, v_new, splits, merge)
        torch.cuda.synchronize()
        check_step(q, cache, out, full_k, full_v, dtype, f"splits={splits} in_kernel_merge={merge}")
        if ws_count is not None:
            assert not ws_count.any(), "the in-kernel merge leaves its counters at 0"


@pytest.mark.parametrize("layout", ["[1, B, H, D]", "[B, H, D]", "qkv slice", "unaligned"])
@pytest.mark.parametrize("splits", [1, SPLITS])
def test_append_last_layouts_and_the_kv_append_fallback(layout, splits):
    """k_new in each accepted layout; 'qkv slice' is a view into a fused projection output
    (strided rows, 16-byte aligned: the in-kernel append), 'unaligned' a view whose rows
    aren't (kv_append writes them first, rows from the page table)."""
    dtype, hq, hkv, d, page = torch.bfloat16, 8, 2, 128, 16
    lens = [40, 1, 77]
    q, cache = paged_inputs(lens, page, hq, hkv, d, dtype, seed=seed_of("append_last layouts", layout))
    k_new, v_new, full_k, full_v = take_new_tokens(cache)  # [B, 1, Hkv, D]
    if layout == "[1, B, H, D]":
        k_new, v_new = k_new.transpose(0, 1).contiguous(), v_new.transpose(0, 1).contiguous()
    elif layout == "[B, H, D]":
        k_new, v_new = k_new[:, 0].contiguous(), v_new[:, 0].contiguous()
    elif layout == "qkv slice":
        qkv = torch.randn(len(lens), 1, hq + 2 * hkv, d, device="cuda").to(dtype)
        qkv[:, :, hq:hq + hkv] = k_new
        qkv[:, :, hq + hkv:] = v_new
        k_new, v_new = qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    else:
        wide = torch.randn(2, len(lens), 1, hkv, d + 1, device="cuda").to(dtype)
        wide[0, ..., 1:] = k_new
        wide[1, ..., 1:] = v_new
        k_new, v_new = wide[0, ..., 1:], wide[1, ..., 1:]
        assert (k_new.data_ptr() % 16) != 0
    out, _ = direct_paged_decode_appending(q, cache, k_new, v_new, splits)
    torch.cuda.synchronize()
    check_step(q, cache, out, full_k, full_v, dtype, layout)


@pytest.mark.parametrize("splits", [1, SPLITS])
def test_a_request_of_length_zero_appends_nothing(splits):
    dtype, hq, hkv, d, page = torch.float16, 8, 2, 64, 16
    q, cache = paged_inputs([20, 5], page, hq, hkv, d, dtype, seed=seed_of("append_last empty"))
    empty_row = last_rows(cache)[0]
    k_new, v_new, full_k, full_v = take_new_tokens(cache)
    cache.kv_lens[0] = 0  # request 0 now holds nothing: its k_new has no row to go to
    for full in (full_k, full_v):
        full.view(-1, hkv, d)[empty_row] = float("nan")  # its poisoned row stays so
    out, _ = direct_paged_decode_appending(q, cache, k_new, v_new, splits)
    torch.cuda.synchronize()
    assert_same(cache.k_cache, full_k, "k_cache")
    assert_same(cache.v_cache, full_v, "v_cache")
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no key: zeros
    k, v = cache.gather(1)
    assert_close(out[1:], reference(q[1:], k[None], v[None]), dtype, "b=1")


def test_graph_replays_write_the_current_steps_rows():
    """A captured fused decode replayed after kv_lens grew (the next step): each replay
    writes the rows of its own step's last positions, read from the table it then holds."""
    dtype, hq, hkv, d, page = torch.bfloat16, 8, 2, 128, 16
    final = [48, 17, 100]  # step 2's lengths; step 1 is one token shorter
    q2, cache = paged_inputs(final, page, hq, hkv, d, dtype, seed=seed_of("append_last graph"))
    full_k, full_v = cache.k_cache.clone(), cache.v_cache.clone()
    step2_k, step2_v, _, _ = take_new_tokens(cache)  # rows of position final - 1, now NaN
    cache.kv_lens -= 1
    cache.kv_lens_host = [n - 1 for n in final]
    step1_k, step1_v, _, _ = take_new_tokens(cache)  # rows of position final - 2, now NaN
    q1 = torch.randn(q2.shape, device="cuda").to(dtype)
    q, k_new, v_new = q1.clone(), step1_k.clone(), step1_v.clone()
    out = poisoned_like(q)
    mod = module("attn_paged_decode")

    def call():
        mod.attn_paged_decode(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),
                              abi(cache.kv_indices), abi(cache.kv_lens), 1, None, None, stream_handle(q.device),
                              None, False, abi(k_new), abi(v_new), None, True)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()  # step 1
    torch.cuda.synchronize()
    step1_rows = last_rows(cache)
    for got, full in ((cache.k_cache, full_k), (cache.v_cache, full_v)):
        assert_same(got.view(-1, hkv, d)[step1_rows], full.view(-1, hkv, d)[step1_rows], "step 1's rows")
    for b in range(len(final)):
        k, v = cache.gather(b)
        assert_close(out[b:b + 1], reference(q[b:b + 1], k[None], v[None]), dtype, f"step 1 b={b}")

    cache.kv_lens += 1  # step 2: the same table, one more token each
    cache.kv_lens_host = list(final)
    q.copy_(q2)
    k_new.copy_(step2_k)
    v_new.copy_(step2_v)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_step(q, cache, out, full_k, full_v, dtype, "step 2")


def test_bad_append_last_arguments_raise_before_any_write():
    dtype, hq, hkv, d, page = torch.bfloat16, 8, 2, 64, 16
    q, cache = paged_inputs([20, 5], page, hq, hkv, d, dtype, seed=seed_of("append_last bad"))
    k_new, v_new, _, _ = take_new_tokens(cache)
    before = cache.k_cache.clone(), cache.v_cache.clone()
    mod = module("attn_paged_decode")
    out = poisoned_like(q)

    def call(k, v, slots=None):
        mod.attn_paged_decode(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),
                              abi(cache.kv_indices), abi(cache.kv_lens), 1, None, None, stream_handle(q.device),
                              None, False, abi(k), abi(v), abi(slots), True)

    with pytest.raises(ValueError, match="slots: append_last derives"):
        call(k_new, v_new, last_rows(cache))
    with pytest.raises(ValueError, match=r"k_new: append_last takes one new token per request"):
        call(k_new.expand(2, 3, hkv, d), v_new.expand(2, 3, hkv, d))
    with pytest.raises(ValueError, match="k_new: dtype float16 differs from k_cache's bfloat16"):
        call(k_new.half(), v_new.half())
    with pytest.raises(ValueError, match=r"v_new: expected bfloat16"):
        call(k_new, v_new[:1])
    torch.cuda.synchronize()
    assert_same(cache.k_cache, before[0], "k_cache")
    assert_same(cache.v_cache, before[1], "v_cache")
    assert out.isnan().all()
