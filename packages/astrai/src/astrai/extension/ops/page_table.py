"""Checks of a paged op's page table: a corrupted table raises instead of letting a kernel
read or write outside the cache.

- Always, on the host (no device access): the index tensors are tensors of dtype int32,
  1-D, of the lengths the batch implies (``kv_indptr [B+1]``, ``kv_lens [B]``,
  ``qo_indptr [B+1]``, ``q_tile_to_index`` as long as ``q_tile_to_batch``).
- With ``ASTRAI_DEBUG=1``, also their values, on the device (torch ops, then one host read:
  the check synchronises): ``kv_indptr`` starts at >= 0, never decreases and ends within
  ``kv_indices``; ``0 <= kv_lens[b] <= (kv_indptr[b+1] - kv_indptr[b]) * page_size``; every
  page id a request reads is in ``[0, num_pages)``; for prefill, ``qo_indptr`` runs from 0
  to ``total_q`` without decreasing, and every Q tile names a request and a tile inside its
  query rows.

A failure is a :class:`PageTableError` naming the op, the request and the broken fact.
"""

from __future__ import annotations

import torch

from ..environ import env_reader

__all__ = [
    "PageTableError",
    "check_decode_table",
    "check_prefill_table",
    "check_q_tiles",
    "debug_checks_enabled",
]

DEBUG_ENV = "ASTRAI_DEBUG"


class PageTableError(ValueError):
    """A paged op's page table would make the kernel read outside the cache or the query."""


_debug_env = env_reader(DEBUG_ENV)


def debug_checks_enabled() -> bool:
    """True when ``ASTRAI_DEBUG`` is set to anything but ``""`` or ``"0"``."""
    return _debug_env() not in (None, "", "0")


def _host_check(op: str, name: str, t: object, length: int | None, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        raise ValueError(f"{op}: {name} must have shape {what}, got {tuple(t.shape)}")


def _first(bad: torch.Tensor) -> int | None:
    """Index of the first True of a 1-D bool tensor, or None (one host read)."""
    hits = bad.nonzero()
    return int(hits[0, 0]) if hits.numel() else None


def _check_page_ids(op: str, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                    page_size: int, num_pages: int) -> None:
    """Values of a page table whose shapes passed: raise naming the first bad request."""
    starts, ends = kv_indptr[:-1].long(), kv_indptr[1:].long()
    lens = kv_lens.long()
    nnz = kv_indices.shape[0]
    facts = (
        (starts < 0, lambda b: f"kv_indptr[{b}] is negative"),
        (ends < starts, lambda b: f"kv_indptr decreases from entry {b} to {b + 1} (it must be monotone)"),
        (ends > nnz, lambda b: f"kv_indptr[{b + 1}] points past the end of kv_indices ({nnz} entries)"),
        (lens < 0, lambda b: "kv_lens is negative"),
        ((lens > (ends - starts) * page_size),
         lambda b: f"kv_lens[{b}] needs more pages than kv_indptr gives it (page_size {page_size})"),
    )
    for bad, say in facts:
        b = _first(bad)
        if b is not None:
            raise PageTableError(f"{op}: request {b}: {say(b)}")
    used = torch.div(lens + page_size - 1, page_size, rounding_mode="floor")
    total = int(used.sum())
    if total == 0:
        return
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), used, output_size=total)
    offset = torch.arange(total, device=lens.device) - (torch.cumsum(used, 0) - used)[seq]
    pages = kv_indices[starts[seq] + offset].long()
    at = _first((pages < 0) | (pages >= num_pages))
    if at is not None:
        b = int(seq[at])
        raise PageTableError(
            f"{op}: request {b}: kv_indices holds page id {int(pages[at])}, outside the cache's {num_pages} pages"
        )


def check_decode_table(op: str, batch: int, kv_indptr: object, kv_indices: object, kv_lens: object, *,
                       page_size: int, num_pages: int, debug: bool | None = None) -> None:
    """Check the page table of a paged decode over ``batch`` requests (see the module docstring)."""
    _host_check(op, "kv_indptr", kv_indptr, batch + 1, f"[batch + 1] = [{batch + 1}]")
    _host_check(op, "kv_indices", kv_indices, None, "[nnz_pages]")
    _host_check(op, "kv_lens", kv_lens, batch, f"[batch] = [{batch}]")
    if debug_checks_enabled() if debug is None else debug:
        _check_page_ids(op, kv_indptr, kv_indices, kv_lens, page_size, num_pages)


def check_prefill_table(op: str, total_q: int, qo_indptr: object, kv_indptr: object, kv_indices: object,
                        kv_lens: object, q_tile_to_batch: object, q_tile_to_index: object, *, page_size: int,
                        num_pages: int, debug: bool | None = None) -> None:
    """Check the page table and the Q schedule's shapes of a ragged paged prefill (the tiles'
    values need the kernels' tile size: :func:`check_q_tiles`)."""
    _host_check(op, "qo_indptr", qo_indptr, None, "[batch + 1]")
    batch = qo_indptr.shape[0] - 1
    if batch < 1:
        raise ValueError(f"{op}: qo_indptr must have shape [batch + 1] with batch >= 1, got {tuple(qo_indptr.shape)}")
    _host_check(op, "q_tile_to_batch", q_tile_to_batch, None, "[num_tiles]")
    tiles = q_tile_to_batch.shape[0]
    _host_check(op, "q_tile_to_index", q_tile_to_index, tiles, f"[num_tiles] = [{tiles}] like q_tile_to_batch")
    check_decode_table(op, batch, kv_indptr, kv_indices, kv_lens, page_size=page_size, num_pages=num_pages,
                       debug=debug)
    if not (debug_checks_enabled() if debug is None else debug):
        return
    qo = qo_indptr.long()
    if int(qo[0]) != 0 or int(qo[-1]) != total_q:
        raise PageTableError(f"{op}: qo_indptr must run from 0 to total_q = {total_q}, "
                             f"got {int(qo[0])} .. {int(qo[-1])}")
    b = _first(qo[1:] < qo[:-1])
    if b is not None:
        raise PageTableError(f"{op}: request {b}: qo_indptr decreases from entry {b} to {b + 1}")


def check_q_tiles(op: str, qo_indptr: torch.Tensor, q_tile_to_batch: torch.Tensor, q_tile_to_index: torch.Tensor,
                  *, tile_rows: int) -> None:
    """Values of a Q schedule whose shapes passed (debug mode): every tile names a request of
    the batch and a tile inside its query rows."""
    if not q_tile_to_batch.shape[0]:
        return
    batch = qo_indptr.shape[0] - 1
    qo, tb, ti = qo_indptr.long(), q_tile_to_batch.long(), q_tile_to_index.long()
    t = _first((tb < 0) | (tb >= batch))
    if t is not None:
        raise PageTableError(f"{op}: q tile {t} names request {int(tb[t])}, outside the batch of {batch}")
    q_lens = (qo[1:] - qo[:-1])[tb]
    t = _first((ti < 0) | (ti * tile_rows >= q_lens))
    if t is not None:
        raise PageTableError(f"{op}: request {int(tb[t])}: q tile {t} has index {int(ti[t])}, past the "
                             f"request's {int(q_lens[t])} query rows ({tile_rows} rows per tile)")
