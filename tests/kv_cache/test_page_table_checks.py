"""Corrupted page tables given to the paged ops directly: shapes are checked on the host on
every call; with ASTRAI_DEBUG=1 the values are checked too (on the tensors' device) and a
bad table raises PageTableError naming the op and the request, before any kernel runs.
On the CPU the checks run on CPU tensors; tests/gpu/kv_cache/test_page_table_checks_gpu.py runs
them on the GPU."""

from __future__ import annotations

import pytest
import torch

from astrai.extension import ops
from astrai.extension.ops.page_table import PageTableError, check_decode_table, check_prefill_table, check_q_tiles

I32 = torch.int32
PAGES, PAGE, HKV, D = 12, 4, 2, 64


def table(device="cpu"):
    """Three requests of 5, 1 and 9 tokens over shuffled pages (valid)."""
    g = torch.Generator().manual_seed(3)
    pages = torch.randperm(PAGES, generator=g)[:6].to(I32)
    return dict(kv_indptr=torch.tensor([0, 2, 3, 6], dtype=I32, device=device),
                kv_indices=pages.to(device), kv_lens=torch.tensor([5, 1, 9], dtype=I32, device=device))


def decode_args(device="cpu", **override):
    t = table(device) | override
    q = torch.randn(3, 1, 8, D, device=device).bfloat16()
    cache = torch.randn(PAGES, PAGE, HKV, D, device=device).bfloat16()
    return q, cache, cache.clone(), t["kv_indptr"], t["kv_indices"], t["kv_lens"]


def corrupt(name, at, value, device="cpu"):
    t = table(device)
    t[name] = t[name].clone()
    t[name][at] = value
    return t


CORRUPTIONS = {  # (tensor, index, value) -> (request named, message)
    "page id past the cache": (("kv_indices", 4, PAGES), 2, "page id 12, outside the cache's 12 pages"),
    "negative page id": (("kv_indices", 0, -1), 0, "page id -1"),
    "indptr not monotone": (("kv_indptr", 2, 1), 1, "kv_indptr decreases"),
    "indptr past the indices": (("kv_indptr", 3, 7), 2, "points past the end of kv_indices"),
    "length beyond its pages": (("kv_lens", 1, 5), 1, "kv_lens\\[1\\] needs more pages"),
    "negative start": (("kv_indptr", 0, -2), 0, "kv_indptr\\[0\\] is negative"),
}


@pytest.mark.parametrize("case", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_decode_table_value_checks_name_the_op_and_request(case):
    (name, at, value), request, message = CORRUPTIONS[case]
    t = corrupt(name, at, value)
    with pytest.raises(PageTableError, match=f"attn_paged_decode: request {request}: .*{message}"):
        check_decode_table("attn_paged_decode", 3, t["kv_indptr"], t["kv_indices"], t["kv_lens"],
                           page_size=PAGE, num_pages=PAGES, debug=True)
    # without debug the values are not read (no device access on the fast path)
    check_decode_table("attn_paged_decode", 3, t["kv_indptr"], t["kv_indices"], t["kv_lens"],
                       page_size=PAGE, num_pages=PAGES, debug=False)


def test_a_valid_table_passes_and_unused_capacity_is_not_read():
    t = table()
    check_decode_table("op", 3, t["kv_indptr"], t["kv_indices"], t["kv_lens"], page_size=PAGE,
                       num_pages=PAGES, debug=True)
    # spans with spare capacity holding garbage (the cache's own layout) are fine
    spare = dict(kv_indptr=torch.tensor([0, 4, 8, 12], dtype=I32),
                 kv_indices=torch.tensor([1, 2, 99, -5, 3, 77, 77, 77, 4, 5, 6, 88], dtype=I32),
                 kv_lens=torch.tensor([5, 1, 9], dtype=I32))
    check_decode_table("op", 3, **spare, page_size=PAGE, num_pages=PAGES, debug=True)


@pytest.mark.parametrize("debug", ["1", None])
def test_direct_decode_op_checks_before_needing_a_gpu(monkeypatch, debug):
    if debug:
        monkeypatch.setenv("ASTRAI_DEBUG", debug)
    else:
        monkeypatch.delenv("ASTRAI_DEBUG", raising=False)
    t = corrupt("kv_indices", 5, 1000)
    q, kc, vc, *_ = decode_args()
    if debug:
        with pytest.raises(PageTableError, match="attn_paged_decode: request 2: kv_indices holds page id 1000"):
            ops.attn_paged_decode(q, kc, vc, t["kv_indptr"], t["kv_indices"], t["kv_lens"])
    else:  # the values are the kernel's to trust; the CPU tensors are what fails here
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            ops.attn_paged_decode(q, kc, vc, t["kv_indptr"], t["kv_indices"], t["kv_lens"])


@pytest.mark.parametrize(
    "override, error, match",
    [
        (dict(kv_indptr=torch.tensor([0, 2, 3], dtype=I32)), ValueError, r"kv_indptr must have shape \[batch \+ 1\] = \[4\]"),
        (dict(kv_lens=torch.tensor([5, 1], dtype=I32)), ValueError, r"kv_lens must have shape \[batch\] = \[3\]"),
        (dict(kv_indices=torch.zeros(6, dtype=torch.int64)), TypeError, "kv_indices must be int32"),
        (dict(kv_lens=[5, 1, 9]), TypeError, "kv_lens must be a torch.Tensor"),
    ],
)
def test_direct_decode_op_checks_table_shapes_on_every_call(monkeypatch, override, error, match):
    monkeypatch.delenv("ASTRAI_DEBUG", raising=False)
    with pytest.raises(error, match=f"attn_paged_decode: {match}"):
        ops.attn_paged_decode(*decode_args(**override))


def prefill_table():
    t = table()
    # requests of 5, 1 and 9 new tokens (all their tokens): 64-row tiles, one per request
    return t | dict(qo_indptr=torch.tensor([0, 5, 6, 15], dtype=I32),
                    q_tile_to_batch=torch.tensor([0, 1, 2], dtype=I32),
                    q_tile_to_index=torch.tensor([0, 0, 0], dtype=I32))


def run_prefill_check(t, total_q=15):
    check_prefill_table("attn_paged_prefill", total_q, t["qo_indptr"], t["kv_indptr"], t["kv_indices"],
                        t["kv_lens"], t["q_tile_to_batch"], t["q_tile_to_index"], page_size=PAGE,
                        num_pages=PAGES, debug=True)
    check_q_tiles("attn_paged_prefill", t["qo_indptr"], t["q_tile_to_batch"], t["q_tile_to_index"], tile_rows=64)


@pytest.mark.parametrize(
    "name, at, value, match",
    [
        ("qo_indptr", 2, 4, "request 1: qo_indptr decreases"),
        ("qo_indptr", 3, 16, "qo_indptr must run from 0 to total_q = 15"),
        ("q_tile_to_batch", 1, 3, "q tile 1 names request 3, outside the batch of 3"),
        ("q_tile_to_index", 2, 1, "request 2: q tile 2 has index 1, past the request's 9 query rows"),
        ("kv_indices", 2, PAGES + 3, "request 1: kv_indices holds page id 15"),
        ("kv_indptr", 1, 4, "request 1: kv_indptr decreases"),
    ],
)
def test_prefill_table_value_checks(name, at, value, match):
    run_prefill_check(prefill_table())
    t = prefill_table()
    t[name] = t[name].clone()
    t[name][at] = value
    with pytest.raises(PageTableError, match=f"attn_paged_prefill: {match}"):
        run_prefill_check(t)


def test_direct_prefill_op_checks_in_debug_mode(monkeypatch):
    monkeypatch.setenv("ASTRAI_DEBUG", "1")
    t = prefill_table()
    t["kv_indptr"] = torch.tensor([0, 2, 1, 6], dtype=I32)
    cache = torch.randn(PAGES, PAGE, HKV, D).bfloat16()
    q = torch.randn(15, 8, D).bfloat16()
    with pytest.raises(PageTableError, match="attn_paged_prefill: request 1: kv_indptr decreases"):
        ops.attn_paged_prefill(q, cache, cache, t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["kv_lens"],
                               t["q_tile_to_batch"], t["q_tile_to_index"])
