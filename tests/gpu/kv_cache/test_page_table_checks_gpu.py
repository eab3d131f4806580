"""Corrupted page tables on the GPU: with ASTRAI_DEBUG=1 the paged ops check the table's
values on the device and raise PageTableError naming the op and the request before any
kernel runs (the cache's pages are left untouched); a valid table still computes the
float64 reference. Without the flag the ops never read the table on the host."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.extension import attention, ops
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.ops.page_table import PageTableError

pytestmark = pytest.mark.gpu

I32, BF16 = torch.int32, torch.bfloat16
PAGES, PAGE, HQ, HKV, D = 64, 16, 8, 2, 128


def paged_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [37, 1, 80]  # tail pages of 5, 1 and 0 tokens
    n_pages = [-(-n // PAGE) for n in lens]
    indptr = [0]
    for n in n_pages:
        indptr.append(indptr[-1] + n)
    pages = torch.randperm(PAGES, generator=g)[: indptr[-1]]
    k_cache = torch.randn(PAGES, PAGE, HKV, D, generator=g).to(BF16).cuda()
    v_cache = torch.randn(PAGES, PAGE, HKV, D, generator=g).to(BF16).cuda()
    q = torch.randn(3, 1, HQ, D, generator=g).to(BF16).cuda()
    table = dict(kv_indptr=torch.tensor(indptr, dtype=I32).cuda(), kv_indices=pages.to(I32).cuda(),
                 kv_lens=torch.tensor(lens, dtype=I32).cuda())
    return q, k_cache, v_cache, table, lens


def reference(q, k_cache, v_cache, table, lens):
    out = torch.empty(q.shape, dtype=torch.float64)
    indptr, pages = table["kv_indptr"].tolist(), table["kv_indices"].long().cpu()
    for b, n in enumerate(lens):
        ids = pages[indptr[b]: indptr[b] + -(-n // PAGE)]
        k = k_cache.cpu()[ids].reshape(-1, HKV, D)[:n].double().repeat_interleave(HQ // HKV, 1)
        v = v_cache.cpu()[ids].reshape(-1, HKV, D)[:n].double().repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("hd,khd->hk", q[b, 0].cpu().double(), k) / math.sqrt(D)
        out[b, 0] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v)
    return out


@pytest.mark.parametrize("corruption, req, match", [
    (("kv_indices", 5, PAGES + 100), 2, "page id 164"),  # entries 4..8 are request 2's
    (("kv_indices", 0, -7), 0, "page id -7"),
    (("kv_indptr", 2, 1), 1, "kv_indptr decreases"),
    (("kv_lens", 1, 17), 1, "needs more pages"),
])
def test_debug_mode_rejects_a_corrupted_decode_table(monkeypatch, corruption, req, match):
    monkeypatch.setenv("ASTRAI_DEBUG", "1")
    q, k_cache, v_cache, table, lens = paged_inputs()
    out = ops.attn_paged_decode(q, k_cache, v_cache, **table)  # valid: runs and is right
    torch.testing.assert_close(out.double().cpu(), reference(q, k_cache, v_cache, table, lens),
                               atol=2e-2, rtol=2e-2)
    name, at, value = corruption
    table[name] = table[name].clone()
    table[name][at] = value
    before = k_cache.clone()
    with pytest.raises(PageTableError, match=f"attn_paged_decode: request {req}: .*{match}"):
        ops.attn_paged_decode(q, k_cache, v_cache, **table)
    assert torch.equal(k_cache, before)


def test_debug_mode_rejects_a_corrupted_prefill_table(monkeypatch):
    monkeypatch.setenv("ASTRAI_DEBUG", "1")
    cache = PagedKVCache(1, PAGES, PAGE, HKV, D, dtype=BF16, device="cuda")
    for s in range(2):
        cache.add_sequence(s)
    plan = cache.plan([0, 1], [70, 9])
    q = torch.randn(79, HQ, D, device="cuda").to(BF16)
    k_pages = cache.k_cache(0)
    args = [plan.qo_indptr, plan.kv_indptr, plan.kv_indices.clone(), plan.kv_lens,
            *plan.q_tiles(ops.attention.q_tile_rows("cuda"))]
    ops.attn_paged_prefill(q, k_pages, cache.v_cache(0), *args)
    args[2][plan.kv_indptr[1]] = PAGES  # request 1's first page
    with pytest.raises(PageTableError, match="attn_paged_prefill: request 1: kv_indices holds page id 64"):
        ops.attn_paged_prefill(q, k_pages, cache.v_cache(0), *args)


def test_debug_mode_checks_the_planned_batch_once(monkeypatch):
    """attention() with a cache in debug mode: the plan's own table passes and the result
    matches the float64 reference over the token history."""
    monkeypatch.setenv("ASTRAI_DEBUG", "1")
    torch.manual_seed(1)
    cache = PagedKVCache(1, PAGES, PAGE, HKV, D, dtype=BF16, device="cuda")
    cache.add_sequence(0)
    cache.plan([0], [33])
    hist_k = torch.randn(33, HKV, D, device="cuda").to(BF16)
    cache.append(0, hist_k, hist_k)
    cache.plan([0], [1])
    q = torch.randn(1, 1, HQ, D, device="cuda").to(BF16)
    k = torch.randn(1, 1, HKV, D, device="cuda").to(BF16)
    out = attention(q, k, k, kv_cache=cache, layer_id=0)
    keys = torch.cat([hist_k, k[0]]).double().repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("hd,khd->hk", q[0, 0].double(), keys) / math.sqrt(D)
    want = torch.einsum("hk,khd->hd", torch.softmax(s, -1), keys)
    torch.testing.assert_close(out[0, 0].double(), want, atol=2e-2, rtol=2e-2)
