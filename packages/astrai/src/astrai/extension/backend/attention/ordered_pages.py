"""A long prefill over FP8 or scattered pages, run over its pages gathered in order first.

The Hopper prefill reads 16-bit pages only, and reads a K/V tile as one TMA box per panel only
where the tile's pages have consecutive ids (else a box per page). Over FP8 pages the paged
prefill runs the mma.sync kernel instead (about 0.35x cuDNN bf16 at long prompts); over pages
handed out in no order (a cache after some churn) the Hopper kernel runs at 0.75-0.8x of its
in-order speed. Where a step's attention is long enough for the difference to pay for a copy,
the CUDA backend gathers the step's pages (each request's ``ceil(kv_len / page_size)`` pages,
requests in order) into a scratch of the cache's compute dtype and runs the 16-bit kernel over
it with a page table that counts up. FP8 pages are dequantized on the way as the torch path's
gathers do (:func:`~astrai.extension.kv_quant.dequantize`: ``stored * scale`` in float32, one
rounding), so the attention reads the torch path's values.

The gather (the plugin's ``gather_pages`` kernel, K and V in one launch; torch ops with a module
built before it) moves 3 bytes per K / V value over FP8 pages and 4 over 16-bit ones (about 9
over FP8 pages through torch ops: a byte gather, the widening, the scaling in place), against an
attention whose work grows with query rows times keys: it runs where the step's keys are each
read by at least :data:`FP8_MIN_ROWS` / :data:`SCATTERED_MIN_ROWS` query rows on average
(``sum(q_len * kv_len) / sum(kv_len)``), and
over 16-bit pages only where at least :data:`SCATTERED_MIN_BREAKS` of the steps from one page to
the next are not to the next id. Only on sm_90, where the Hopper prefill reads the gathered pages
(elsewhere the mma.sync kernel reads every page alike); never with a window (its pages would be
gathered for nothing) or a cache that releases pages left of one.

Built, waiting for a GPU: the thresholds are estimates (H200, d128 GQA 32/8: mma.sync ~210 TFLOP/s
over FP8 pages, the Hopper kernel ~600 over in-order pages and ~480 over shuffled ones, the gather
at ~3.5 TB/s: even at about 90 rows a key over FP8 pages, 700 over scattered 16-bit ones, before
the launches' fixed costs); the next GPU run sets them from ``bench/bench_kv_fp8.py --prefill``
(rows ``e4m3 g``) and ``bench/bench_prefill.py`` (rows ``astrai paged p16 shuf gathered``).
"""

from __future__ import annotations

import torch

from ...abi import launch, tensor_arg
from ...batch_plan import BatchPlan
from ...device import probe_device
from ...kv_cache import PagedKVCache
from ...op_names import ATTN_PAGED_PREFILL
from ...ops import _plugin
from ...ops import attention as attn_ops
from ...ops.attention_args import kv_scales_arg
from ...ops.attention_plan import plan_paged_prefill

__all__ = ["FP8_MIN_ROWS", "SCATTERED_MIN_BREAKS", "SCATTERED_MIN_ROWS", "GatheredPrefill", "explain",
           "gather_pages", "gather_pays", "gathered_table", "scattered"]

# Query rows per key (on average over the step) from which the gather pays; None: never.
FP8_MIN_ROWS: int | None = 256  # FP8 pages: the Hopper kernel instead of the mma.sync one
SCATTERED_MIN_ROWS: int | None = 2048  # 16-bit pages: one box per panel instead of one per page
SCATTERED_MIN_BREAKS = 1 / 16  # share of page-to-page steps that are not to the next id


def gather_pays(kv_cache: PagedKVCache, plan: BatchPlan, window_left: int) -> bool:
    """Whether a prefill over ``kv_cache``'s pages runs on the step's pages gathered in order
    (decided once per plan: every layer of the step asks)."""
    if window_left >= 0 or kv_cache.window is not None:
        return False
    return plan.memo(("cuda", "prefill-gather-pays"), lambda: _pays(kv_cache, plan))


def _pays(kv_cache: PagedKVCache, plan: BatchPlan) -> bool:
    fp8 = kv_cache.kv_dtype != kv_cache.dtype
    rows = FP8_MIN_ROWS if fp8 else SCATTERED_MIN_ROWS
    if rows is None or not _hopper_reads(kv_cache, fp8):
        return False
    keys = plan.total_kv
    work = sum(q * kv for q, kv in zip(plan.q_lens_host, plan.kv_lens_host))
    if keys == 0 or work < rows * keys:
        return False
    return fp8 or scattered(kv_cache, plan) >= SCATTERED_MIN_BREAKS


def _hopper_reads(kv_cache: PagedKVCache, fp8: bool) -> bool:
    """Whether the gathered pages would be read by the Hopper prefill (sm_90 only; elsewhere the
    mma.sync kernel reads FP8 and scattered pages as fast as 16-bit and in-order ones), a box
    per panel for 16-bit pages (page sizes of 8 rows that divide 128 or that 128 divides)."""
    if probe_device(kv_cache.device).sm != 90:
        return False
    page = kv_cache.page_size
    return fp8 or (page % 8 == 0 and (128 % page == 0 or page % 128 == 0))


def explain(fp8: bool, kv_dtype: torch.dtype) -> str:
    """What a paged prefill over pages of ``kv_dtype`` reads, for ``explain()``."""
    kv = str(kv_dtype).removeprefix("torch.")
    rows = FP8_MIN_ROWS if fp8 else SCATTERED_MIN_ROWS
    if rows is None:
        return f"attn_paged_prefill reads the {kv} pages in place"
    if fp8:
        return (f"attn_paged_prefill over {kv} pages: a step whose keys are each read by >= {rows} query rows "
                "runs on them dequantized to 16 bits first (ordered_pages), a shorter one reads them in place")
    return (f"attn_paged_prefill: a step whose keys are each read by >= {rows} query rows over pages out of "
            "order runs on them copied in order first (ordered_pages), others read them in place")


def scattered(kv_cache: PagedKVCache, plan: BatchPlan) -> float:
    """The share of steps from one page of a request to its next that are not to the next page
    id (0 for a fresh cache's requests, about 1 for shuffled pages), from the host page tables."""
    page, steps, breaks = kv_cache.page_size, 0, 0
    for seq, n in zip(plan.seq_ids, plan.kv_lens_host):
        pages = kv_cache.page_table(seq)[: -(-n // page)]
        steps += max(len(pages) - 1, 0)
        breaks += sum(b != a + 1 for a, b in zip(pages, pages[1:]))
    return breaks / steps if steps else 0.0


def gathered_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
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


def gather_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, source: torch.Tensor, k_out: torch.Tensor,
                 v_out: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``k_out[i] = k_pages[source[i]]`` and ``v_out`` alike, FP8 pages dequantized with
    ``scales`` (float32 ``[1]`` / ``[kv_heads]`` each) as ``kv_quant.dequantize`` does: the
    plugin's ``gather_pages`` kernel (one launch) where the module has it, else torch ops."""
    _gather(_gather_entry(k_out.device), k_pages, v_pages, source, k_out, v_out, scales)


def _gather_entry(device: torch.device):
    """The compiled ``gather_pages`` entry point, or None (a module built before it)."""
    return getattr(_plugin.require(ATTN_PAGED_PREFILL, device), "gather_pages", None)


def _gather(entry, k_pages: torch.Tensor, v_pages: torch.Tensor, source: torch.Tensor, k_out: torch.Tensor,
            v_out: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    if entry is not None:
        launch(k_out.device, entry, tensor_arg(k_pages), tensor_arg(v_pages), tensor_arg(source), tensor_arg(k_out),
               tensor_arg(v_out), **kv_scales_arg(*(scales or (None, None))))
        return
    scratch = None if scales is None else torch.empty(k_out.shape, dtype=torch.uint8, device=k_out.device)
    for i, (pages, out) in enumerate(((k_pages, k_out), (v_pages, v_out))):
        if scratch is None:
            torch.index_select(pages, 0, source, out=out)
        else:
            torch.index_select(pages.view(torch.uint8), 0, source, out=scratch)
            out.copy_(scratch.view(pages.dtype))  # FP8 values are exact in both 16-bit formats
            torch.mul(out, scales[i].view(-1, 1), out=out)  # in float32 (the scale's dtype), rounded once


class GatheredPrefill:
    """One batch's prefill over its pages gathered into consecutive 16-bit pages: the launch
    over them and the scratch they are written into (one layer's worth, reused by every layer
    of the batch, in stream order)."""

    def __init__(self, kv_cache: PagedKVCache, plan: BatchPlan) -> None:
        page = kv_cache.page_size
        device = plan.kv_lens.device
        self.source, kv_indptr, kv_indices = gathered_table(plan.kv_indptr, plan.kv_indices, plan.kv_lens,
                                                            plan.kv_lens_host, page)
        tiles = plan.q_tiles(attn_ops.q_tile_rows(device))
        self.launch = plan_paged_prefill(plan.qo_indptr, kv_indptr, kv_indices, plan.kv_lens, *tiles,
                                         total_q=plan.total_q, page_size=page, num_pages=max(len(kv_indices), 1))
        shape = (len(kv_indices), *kv_cache.k_cache(0).shape[1:])
        self.k = torch.empty(shape, dtype=kv_cache.dtype, device=device)
        self.v = torch.empty_like(self.k)
        self._entry = _gather_entry(device)  # looked up once for every layer of the batch

    def pages(self, kv_cache: PagedKVCache, layer_id: int, scales: tuple[torch.Tensor, torch.Tensor] | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pages of the batch in the scratch (FP8 ones dequantized with ``scales``)."""
        _gather(self._entry, kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id), self.source, self.k, self.v,
                scales)
        return self.k, self.v

    @classmethod
    def of(cls, kv_cache: PagedKVCache, plan: BatchPlan) -> GatheredPrefill:
        """The batch's instance, built by the first layer that needs it."""
        return plan.memo(("cuda", "prefill-gathered"), lambda: cls(kv_cache, plan))
