"""Paged KV cache and the per-batch plan every layer reuses.

The cache stores, for every layer, keys and values as pages
``[num_pages, page_size, kv_heads, head_dim]``. Each sequence owns a list of pages
(its page table); page ``i`` of a sequence holds its tokens
``i * page_size .. (i + 1) * page_size - 1``.

A step of inference runs in two stages:

1. :meth:`PagedKVCache.plan` once per batch: reserves pages for the new tokens of every
   sequence, advances the sequence lengths and returns a :class:`BatchPlan` holding the
   ragged metadata the kernels read (``qo_indptr``, ``kv_indptr``, ``kv_indices``,
   ``kv_lens``; the prefill kernels' Q tiles on demand, :meth:`BatchPlan.q_tiles`). The plan becomes the cache's
   :attr:`~PagedKVCache.active_plan`.
2. every layer calls ``attention(q, k, v, kv_cache=cache, layer_id=i)``, which writes the
   layer's new keys/values (:meth:`PagedKVCache.append`) and attends over the cache
   using the same plan. No layer rebuilds metadata. ``with cache.step(...) as plan:`` does
   both and rolls the batch back if the block fails (see "Failed steps" in
   :class:`PagedKVCache`).

The page table lives on the cache's device and is updated incrementally
(:mod:`~astrai.extension.device_page_table`): a decode step's :meth:`~PagedKVCache.plan`
does O(batch) host work whatever the context length, and one small host->device copy.

Example (plan once, run many)::

    >>> import torch
    >>> from astrai.extension.kv_cache import PagedKVCache
    >>> cache = PagedKVCache(num_layers=2, num_pages=16, page_size=16,
    ...                      kv_heads=2, head_dim=64, dtype=torch.float32)
    >>> for seq in ("a", "b"):
    ...     cache.add_sequence(seq)
    >>> plan = cache.plan(["a", "b"], q_lens=[70, 10])      # prefill: ragged q lengths
    >>> plan.qo_indptr.tolist(), [t.tolist() for t in plan.q_tiles(64)]  # (request, tile) of each Q tile
    ([0, 70, 80], [[1, 0, 0], [0, 1, 0]])
    >>> for layer in range(2):                              # every layer reuses the plan
    ...     k = torch.randn(plan.total_q, 2, 64)
    ...     cache.append(layer, k, torch.randn_like(k))
    >>> plan = cache.plan(["a", "b"], q_lens=[1, 1])        # one decode step
    >>> plan.kv_lens.tolist(), plan.is_decode
    ([71, 11], True)
    >>> with cache.step(["a", "b"], q_lens=[1, 1]) as plan:  # rolled back if the block raises
    ...     for layer in range(2):
    ...         k = torch.randn(plan.total_q, 2, 64)
    ...         cache.append(layer, k, torch.randn_like(k))
    >>> cache.seq_len("a")
    72

Writes are detached: the cache is inference state, gradients never flow into it. Decode
steps for CUDA graphs: :mod:`~astrai.extension.kv_static`.

FP8 storage: ``PagedKVCache(..., kv_dtype=torch.float8_e4m3fn)`` (or ``float8_e5m2``) stores
one byte per value with per-layer K and V scales (:mod:`~astrai.extension.kv_quant`):
:meth:`~PagedKVCache.append` quantizes, the gathers dequantize into the compute dtype
(:attr:`~PagedKVCache.dtype`). Design and error bound: docs/kv_cache_fp8.md.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Sequence

import torch

from .batch_plan import BatchPlan, staged_plan
from .device_page_table import DevicePageTable
from .kv_pages import PageStore, locked as _locked
from .kv_quant import LayerScales, check_granularity, check_kv_dtype
from .kv_steps import CacheStateError, CacheSteps, OpenStep, StepLog
from .kv_window import WindowPages, check_window
from .kv_static import StaticPlans
from .static_plan import StaticDecodePlan

__all__ = ["BatchPlan", "CacheFullError", "CacheStateError", "PagedKVCache", "StaticDecodePlan"]


class CacheFullError(RuntimeError):
    """Raised by :meth:`PagedKVCache.plan` when the free pages cannot hold the new tokens."""


class PagedKVCache(CacheSteps, PageStore, WindowPages, StaticPlans):
    """Paged key/value storage for ``num_layers`` layers, with a page allocator per sequence.

    One device: every layer's pages live on ``device``; nothing here shards heads or layers
    across GPUs. Past one GPU, vLLM owns the cache and AstrAI's vLLM backend reads its pages
    in place (:mod:`astrai.integrations.vllm`), or transformers' tensor parallelism runs
    ``attn_implementation="astrai"`` per rank (docs/serve.md, "Serving on more than one GPU").

    Args:
        num_layers: layers stored (``layer_id`` runs over ``0 .. num_layers - 1``).
        num_pages: pages per layer (shared by all sequences).
        page_size: tokens per page, >= 1.
        kv_heads, head_dim: shape of one token's keys (and values).
        dtype, device: the compute dtype and the device; ``attention`` requires q/k/v of this
            dtype and device.
        kv_dtype: the storage dtype: None (or ``dtype``) stores pages in ``dtype``;
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` store one byte per value, with
            per-layer dequantization scales (:meth:`set_kv_scales`, else calibrated on the
            layer's first append).
        kv_scale_granularity: of an FP8 cache's scales: ``"tensor"`` (one K and one V scale per
            layer, shape ``[1]``) or ``"head"`` (one per KV head, shape ``[kv_heads]``).
        page_order: the order free pages are handed out (a permutation of ``range(num_pages)``);
            default ascending. A shuffled order gives non-contiguous page tables.
        window: None (keep every page until its sequence is released), or ``W >= 0``: every
            layer attends with ``attention(..., window_left=w)``, ``0 <= w <= W``
            (:func:`~astrai.extension.kv_window.shared_window` of the layers' windows), and
            each plan returns to the pool its requests' leading pages wholly left of
            ``length - W``; their page-table columns then point at :attr:`null_page`, one page
            taken out of the pool for good (zeros, never written), so positions stay right
            for every backend (:mod:`~astrai.extension.kv_window`).

    Storage: :attr:`k_pages` / :attr:`v_pages` are ``[num_layers, num_pages, page_size,
    kv_heads, head_dim]`` of :attr:`kv_dtype`; :meth:`k_cache` / :meth:`v_cache` give one
    layer's ``[num_pages, page_size, kv_heads, head_dim]`` view (what the paged kernels take;
    raw FP8 bytes for a quantized cache). :meth:`gather_flat` / :meth:`gather_padded` return
    :attr:`dtype` values (dequantized).

    Threads: :meth:`add_sequence`, :meth:`release`, :meth:`plan`, :meth:`step`,
    :meth:`rollback`, :meth:`append`, :meth:`set_kv_scales` and the
    readers of the page accounting hold one lock, so request threads may add and release
    sequences while an engine thread plans and runs batches: a page is never handed out
    twice and free + owned pages (+ the :attr:`null_page` of a cache with a ``window``)
    always make up the cache. The batch itself stays the
    engine's to order: a plan is the cache's :attr:`active_plan` until the next ``plan``,
    so one thread should plan a batch and run its layers (or pass ``plan=`` to
    :meth:`append`).

    Failed steps: a step abandoned half-way is rolled back, never read
    (:class:`~astrai.extension.kv_steps.CacheSteps`: :meth:`step`, :meth:`rollback`,
    :meth:`mark_written`).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        page_order: Sequence[int] | None = None,
        kv_dtype: torch.dtype | None = None,
        kv_scale_granularity: str = "tensor",
        window: int | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        storage = check_kv_dtype(kv_dtype, dtype)
        check_granularity(kv_scale_granularity)
        self.window = check_window(window)
        if page_order is None:
            order = list(range(num_pages))
        else:
            order = [int(p) for p in page_order]
            if sorted(order) != list(range(num_pages)):
                raise ValueError(f"page_order must be a permutation of range({num_pages})")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.kv_scale_granularity = kv_scale_granularity
        self._dtype = dtype
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k_pages = torch.empty(shape, dtype=storage, device=device)
        self.v_pages = torch.empty(shape, dtype=storage, device=device)
        self._k_layers = self.k_pages.unbind(0)  # one view per layer, made once
        self._v_layers = self.v_pages.unbind(0)
        flat = (num_layers, num_pages * page_size, kv_heads, head_dim)  # token slots, for writes
        self._scales: LayerScales | None = None
        if storage == dtype:
            self._k_slots = self.k_pages.view(flat).unbind(0)
            self._v_slots = self.v_pages.view(flat).unbind(0)
        else:  # fp8 slots as bytes: index_copy_ has no fp8 kernel, and a byte copy is exact
            self._scales = LayerScales(num_layers, kv_heads, kv_scale_granularity, storage, self.k_pages.device)
            self._k_slots = self.k_pages.view(torch.uint8).view(flat).unbind(0)
            self._v_slots = self.v_pages.view(torch.uint8).view(flat).unbind(0)
        self._lock = threading.RLock()
        self._free: list[int] = order[::-1]  # pop() hands out page_order[0] first
        self._table = DevicePageTable(self.k_pages.device)
        self._pages: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self._dropped: dict[Hashable, int] = {}  # leading columns released to the pool (window)
        self._null_page = None if self.window is None else self._reserve_null_page()
        self._active: BatchPlan | None = None
        self._steps = StepLog(num_layers)
        self._preparers: dict[Hashable, Callable[[PagedKVCache, BatchPlan], object]] = {}
        self._static_plans: weakref.WeakSet[StaticDecodePlan] = weakref.WeakSet()

    # -- properties

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: of q/k/v and of what the gathers return."""
        return self._dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The storage dtype of the pages (:attr:`dtype` unless the cache is FP8)."""
        return self.k_pages.dtype

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    @_locked
    def free_pages(self) -> int:
        return len(self._free)

    @property
    @_locked
    def sequences(self) -> tuple[Hashable, ...]:
        return tuple(self._pages)

    @property
    def active_plan(self) -> BatchPlan:
        """The plan of the current batch (set by :meth:`plan`)."""
        if self._active is None:
            raise RuntimeError("kv_cache has no active plan: call kv_cache.plan(seq_ids, q_lens) once per batch")
        return self._active

    @_locked
    def seq_len(self, seq_id: Hashable) -> int:
        self._require_seq(seq_id)
        return self._lens[seq_id]

    @_locked
    def page_table(self, seq_id: Hashable) -> tuple[int, ...]:
        """``seq_id``'s page per column; a column released by the window holds :attr:`null_page`."""
        self._require_seq(seq_id)
        return tuple(self._pages[seq_id])

    @_locked
    def add_preparer(self, key: Hashable, prepare: Callable[[PagedKVCache, BatchPlan], object]) -> None:
        """Have every later :meth:`plan` call ``prepare(cache, plan)`` and keep its result (unless
        None: nothing to prepare for that batch) in ``plan.launches[key]``: a backend registers how to build its per-batch launch once,
        so the layers' calls only launch. A preparer that raises ``RuntimeError`` (its
        plugin became unusable) is dropped; the layer's call then decides again."""
        self._preparers[key] = prepare

    # -- sequences and pages

    @_locked
    def add_sequence(self, seq_id: Hashable) -> None:
        """Register an empty sequence (it owns no page until a plan adds tokens)."""
        if seq_id in self._pages:
            raise ValueError(f"seq_id {seq_id!r} is already in the cache")
        self._pages[seq_id] = []
        self._lens[seq_id] = 0
        self._dropped[seq_id] = 0
        self._table.add(seq_id)

    @_locked
    def release(self, seq_id: Hashable) -> None:
        """Drop a sequence and return its pages to the free list. An uncommitted plan over it
        is settled first: committed if every layer (or none) wrote it, else rolled back."""
        self._require_seq(seq_id)
        step = self._steps.released(seq_id)
        if step is not None:
            self._warn_rolled_back(step, f"the release of {seq_id!r}", 4)
            self._roll_back(step)
        self._free.extend(reversed(self._pages.pop(seq_id)[self._dropped.pop(seq_id):]))
        del self._lens[seq_id]
        self._table.release(seq_id)
        if self._scales is not None and not any(self._lens.values()):
            self._scales.forget_writes()
        if self._active is not None and seq_id in self._active.seq_ids:
            self._active = None

    def _require_seq(self, seq_id: Hashable) -> None:
        if seq_id not in self._pages:
            raise KeyError(f"seq_id {seq_id!r} is not in the cache (add it with add_sequence)")

    @_locked
    def plan(self, seq_ids: Sequence[Hashable], q_lens: Sequence[int], *,
             into: StaticDecodePlan | None = None) -> BatchPlan:
        """Reserve pages for ``q_lens[b]`` new tokens of ``seq_ids[b]`` and build the batch plan.

        Sequence lengths advance now; every layer then appends the same new tokens. Raises
        :class:`CacheFullError` (reserving nothing) when the free pages do not suffice. A
        cache with a ``window`` first returns the requests' pages left of it to the pool.
        An earlier plan over any of ``seq_ids`` that some layers wrote and others did not is
        rolled back first, with a ``RuntimeWarning`` (see the class docstring); prefer
        :meth:`step`, which rolls a failed batch back as it fails.

        ``into``: a decode step (every ``q_lens`` 1) written into the fixed buffers of a
        :meth:`static_decode_plan` (what a CUDA graph reads); the plan returned is a view of
        them. The backends' per-batch preparations are left to :meth:`prepare`.
        """
        return self._plan(tuple(seq_ids), tuple(q_lens), False, into)[0]

    @_locked
    def prepare(self, plan: BatchPlan) -> None:
        """Run the backends' per-batch preparations (:meth:`add_preparer`) on ``plan``, as
        :meth:`plan` does for the plans it builds (not for those ``into`` a static plan)."""
        for key, prepare in list(self._preparers.items()):
            try:
                launch = prepare(self, plan)
            except RuntimeError:
                del self._preparers[key]
                continue
            if launch is not None:
                plan.launches[key] = launch

    def _plan(self, seq_ids: tuple, q_lens: tuple, strict: bool,
              into: StaticDecodePlan | None = None) -> tuple[BatchPlan, OpenStep]:
        self._check_batch(seq_ids, q_lens)
        if into is not None:
            self._check_static(into, seq_ids, q_lens)
        for step in self._steps.settle(seq_ids):
            self._warn_rolled_back(step, "a new plan over its requests", 5)
            self._roll_back(step)
        if self.window is not None:  # lengths are committed now
            self._drop_left_of_window(seq_ids)
        page, lens, pages = self.page_size, self._lens, self._pages
        new_lens = tuple(lens[s] + n for s, n in zip(seq_ids, q_lens))
        extra = [-(-n // page) - len(pages[s]) for s, n in zip(seq_ids, new_lens)]
        needed = sum(extra)
        if needed > len(self._free):
            raise CacheFullError(
                f"kv_cache is out of pages: the batch needs {needed} more pages of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages} are free (release finished sequences or build a larger cache)"
            )
        if needed:  # only sequences that cross a page boundary get a page
            free = self._free
            for s, n_pages in zip(seq_ids, extra):
                if n_pages > 0:
                    new = [free.pop() for _ in range(n_pages)]
                    self._table.add_pages(s, len(pages[s]), new)
                    pages[s].extend(new)
        for s, n in zip(seq_ids, new_lens):
            lens[s] = n
        try:
            if into is None:
                plan = self._build_plan(seq_ids, q_lens, new_lens)
                self.prepare(plan)
            else:
                plan = self._stage_static(into, seq_ids, new_lens)
        except BaseException:
            self._undo(seq_ids, q_lens, new_lens)
            raise
        self._active = plan
        return plan, self._steps.start(plan, strict)

    def _undo(self, seq_ids: tuple, q_lens: tuple, kv_lens: tuple) -> None:
        """Lengths back by ``q_lens``, pages past them back to the pool, in the order they left
        it. The device table keeps their ids as unused capacity: the next pages overwrite them."""
        page, pages, lens, free = self.page_size, self._pages, self._lens, self._free
        for s, n, kv in reversed(tuple(zip(seq_ids, q_lens, kv_lens))):  # last taken, first returned
            keep = -(-(kv - n) // page)
            free.extend(reversed(pages[s][keep:]))
            del pages[s][keep:]
            lens[s] = kv - n
        if self._scales is not None and not any(lens.values()):
            self._scales.forget_writes()

    def _check_batch(self, seq_ids: tuple, q_lens: tuple) -> None:
        if not seq_ids:
            raise ValueError("seq_ids must name at least one sequence")
        if len(q_lens) != len(seq_ids):
            raise ValueError(f"q_lens has {len(q_lens)} entries but seq_ids has {len(seq_ids)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids has duplicates: {list(seq_ids)}")
        for n in q_lens:
            if type(n) is not int or n < 1:
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"q_lens must be ints >= 1, got {list(q_lens)}")
        for s in seq_ids:
            if s not in self._pages:
                self._require_seq(s)

    def _build_plan(self, seq_ids: tuple, q_lens: tuple[int, ...], kv_lens: tuple[int, ...]) -> BatchPlan:
        slots = self._decode_slots(seq_ids, q_lens, kv_lens)
        return staged_plan(self._table, seq_ids, q_lens, kv_lens, self.page_size, slots)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_pages={self.num_pages}, page_size={self.page_size}, "
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"{f'kv_dtype={self.kv_dtype}, ' if self._scales is not None else ''}"
            f"{f'window={self.window}, ' if self.window is not None else ''}device={self.device}, "
            f"sequences={len(self._pages)}, free_pages={self.free_pages})"
        )
