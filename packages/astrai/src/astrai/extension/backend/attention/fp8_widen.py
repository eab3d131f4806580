"""A long prefill over FP8 pages on the 16-bit kernels: the step's pages dequantized first.

The paged prefill reads FP8 pages on its mma.sync kernel (about 0.35x cuDNN bf16 at long
prompts); the Hopper kernel reads 16-bit pages only. Where a step's attention is long enough to
be bound by its tensor cores, the CUDA backend gathers the step's pages (each request's
``ceil(kv_len / page_size)`` pages, requests in order) into a scratch of the cache's compute
dtype, dequantized as the torch path's gathers do (:func:`~astrai.extension.kv_quant.dequantize`:
``stored * scale`` in float32, one rounding), and runs the 16-bit kernel over it with a page
table of consecutive pages (one TMA box per panel). The attention then reads the same values as
the torch path: the 16-bit ones a compute-dtype cache would hold.

The gather costs about 9 bytes of traffic per K / V value (one byte read and one written by the
byte gather, one read and two written by the widening, four by the scaling in place) and a few
launches a layer, against an attention whose work grows with query rows times keys: it runs
where the step's keys are each read by at least :data:`WIDEN_MIN_ROWS` query rows on average
(``sum(q_len * kv_len) / sum(kv_len)``). Not with a window (the window's pages would be
gathered for nothing) or a cache that releases pages left of one.

Built, waiting for a GPU: the threshold is an estimate (H200: mma.sync ~210 TFLOP/s over FP8
pages, the Hopper kernel ~450 over in-order pages, the gather at ~3.5 TB/s); the next GPU run
sets it from ``bench/bench_kv_fp8.py --prefill --widen-rows``.
"""

from __future__ import annotations

import torch

from ...batch_plan import BatchPlan
from ...kv_cache import PagedKVCache
from ...ops import attention as attn_ops
from ...ops.attention_plan import plan_paged_prefill

__all__ = ["WIDEN_MIN_ROWS", "WidenedPrefill", "dequantize_pages", "widen_pays", "widened_table"]

# Query rows per key (on average over the step) from which the gather pays; None: never.
WIDEN_MIN_ROWS: int | None = 512


def widen_pays(kv_cache: PagedKVCache, plan: BatchPlan, window_left: int) -> bool:
    """Whether a prefill over ``kv_cache``'s FP8 pages runs on dequantized 16-bit pages."""
    if WIDEN_MIN_ROWS is None or window_left >= 0 or kv_cache.window is not None:
        return False
    keys = plan.total_kv
    work = sum(q * kv for q, kv in zip(plan.q_lens_host, plan.kv_lens_host))
    return keys > 0 and work >= WIDEN_MIN_ROWS * keys


def widened_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                  kv_lens_host: tuple[int, ...], page_size: int) -> tuple[torch.Tensor, ...]:
    """``(source, kv_indptr, kv_indices)`` of the pages in use (each request's first
    ``ceil(kv_len / page_size)``) laid out consecutively, requests in order: the cache page of
    each scratch page (int64), and the scratch's page table (int32; ``kv_indices`` counts up)."""
    device = kv_lens.device
    pages = (kv_lens.long() + page_size - 1) // page_size
    total = sum(-(-n // page_size) for n in kv_lens_host)
    seq = torch.repeat_interleave(torch.arange(len(kv_lens_host), device=device), pages, output_size=total)
    first = torch.cumsum(pages, 0) - pages  # each request's first page in the scratch
    column = torch.arange(total, device=device) - first[seq]
    source = kv_indices.long()[kv_indptr.long()[seq] + column]
    indptr = torch.nn.functional.pad(torch.cumsum(pages, 0), (1, 0)).to(torch.int32)
    return source, indptr, torch.arange(total, dtype=torch.int32, device=device)


def dequantize_pages(pages: torch.Tensor, source: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                     scratch: torch.Tensor) -> torch.Tensor:
    """``out[i] = pages[source[i]] * scale`` (FP8 pages, float32 ``[1]`` / ``[kv_heads]`` scale,
    ``out`` 16-bit), as ``kv_quant.dequantize``; ``scratch``: uint8 of ``out``'s shape."""
    torch.index_select(pages.view(torch.uint8), 0, source, out=scratch)
    out.copy_(scratch.view(pages.dtype))  # FP8 values are exact in both 16-bit formats
    return torch.mul(out, scale.view(-1, 1), out=out)  # in float32 (the scale's dtype), rounded once


class WidenedPrefill:
    """One batch's prefill over its pages dequantized into consecutive 16-bit pages: the
    launch over them and the scratch they are written into (one layer's worth, reused by every
    layer of the batch, in stream order)."""

    def __init__(self, kv_cache: PagedKVCache, plan: BatchPlan) -> None:
        page = kv_cache.page_size
        device = plan.kv_lens.device
        self.source, kv_indptr, kv_indices = widened_table(plan.kv_indptr, plan.kv_indices, plan.kv_lens,
                                                           plan.kv_lens_host, page)
        tiles = plan.q_tiles(attn_ops.q_tile_rows(device))
        self.launch = plan_paged_prefill(plan.qo_indptr, kv_indptr, kv_indices, plan.kv_lens, *tiles,
                                         total_q=plan.total_q, page_size=page, num_pages=max(len(kv_indices), 1))
        shape = (len(kv_indices), *kv_cache.k_cache(0).shape[1:])
        self._bytes = torch.empty(shape, dtype=torch.uint8, device=device)
        self.k = torch.empty(shape, dtype=kv_cache.dtype, device=device)
        self.v = torch.empty_like(self.k)

    def pages(self, kv_cache: PagedKVCache, layer_id: int, scales: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pages of the batch, dequantized into the scratch."""
        dequantize_pages(kv_cache.k_cache(layer_id), self.source, scales[0], self.k, self._bytes)
        dequantize_pages(kv_cache.v_cache(layer_id), self.source, scales[1], self.v, self._bytes)
        return self.k, self.v

    @classmethod
    def of(cls, kv_cache: PagedKVCache, plan: BatchPlan) -> WidenedPrefill:
        """The batch's instance, built by the first layer that needs it."""
        key = ("cuda", "prefill-widened")
        found = plan.launches.get(key)
        if found is None:
            found = plan.launches[key] = cls(kv_cache, plan)
        return found
