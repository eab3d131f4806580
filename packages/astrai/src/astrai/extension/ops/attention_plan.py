"""Launch plans of the paged attention ops: plan once per batch, then every layer only launches.

A batch's page table is the same for every layer, so everything a paged kernel launch needs
besides the layer's own tensors is built once, by :func:`plan_paged_decode` /
:func:`plan_paged_prefill` (FlashInfer's plan -> run):

- the compiled entry point (the registry is asked once, not per call);
- for decode, the split-KV count from the plugin's C++ planner (``decode_plan``) given the
  batch's longest request, and the split-K workspaces of that count;
- the page table already converted to the binaries' call convention.

Calling a plan with ``(q, k_cache, v_cache)`` then allocates ``out``, converts the three
layer tensors and launches: no device-property query, no planner call, no workspace
allocation. Under ``torch.compile`` (or for tensor subclasses) the call goes through the
registered custom op with the plan's split count, so graphs trace as before. A caller that
keeps a plan per kind of call (shapes, strides, dtypes) binds the launch to that kind once
(:meth:`PagedDecodeLaunch.runner`): a call then reads only the data pointers.

With ``ASTRAI_DEBUG=1`` the plan checks its page table on the device once, when it is built
(:mod:`.page_table`).

>>> launch = plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens,   # doctest: +SKIP
...                            q_heads=32, kv_heads=8, head_dim=128, max_kv_len=plan.max_kv_len)
>>> out = launch(q, k_cache, v_cache)                                            # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..abi import contiguous_strides, current_device, current_stream, dtype_code, empty_allocator, tensor_arg
from ..op_names import ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL
from . import _plugin
from .attention import (_num_sms, _rows_aligned, _rows_layout_ok, _split_workspaces, attn_paged_decode,
                        attn_paged_prefill, fp8_plan_arg)
from .attention_args import kv_scales_arg, variant_binding, variant_kwargs
from .page_table import check_decode_table, check_prefill_table, check_q_tiles, debug_checks_enabled

__all__ = ["PagedDecodeLaunch", "PagedPrefillLaunch", "plan_paged_decode", "plan_paged_prefill"]


def _run(device_index: int, entry, head: tuple, tail: tuple, kwargs: dict | None = None) -> None:
    """``entry(*head, stream, *tail, **kwargs)`` on ``device_index``'s current stream."""
    kwargs = kwargs or {}
    current = current_device()
    if device_index == current:
        entry(*head, current_stream(current), *tail, **kwargs)
    else:
        with torch.cuda.device(device_index):
            entry(*head, current_stream(device_index), *tail, **kwargs)


@dataclass(frozen=True, eq=False)
class PagedDecodeLaunch:
    """One batch's paged decode launch; call it with ``(q [B, 1, Hq, D], k_cache, v_cache)``.

    When the compiled module writes the step's keys/values itself, :attr:`appends` says so,
    and a call with ``k_new`` / ``v_new`` (``[B, 1, Hkv, D]`` or ``[1, B, Hkv, D]``) writes
    them to the caches in the same binding call: with :attr:`append_last`, inside the decode
    launch, to each request's last position through the page table; else first, to rows
    ``slots`` (int64 ``[B]``, the plan's ``write_index``). ``variant`` (an ``AttentionVariant``
    of the backend layer, or None) carries a call's window, soft-cap, sinks and scale;
    ``kv_scales``: an FP8 cache's ``(k_scale, v_scale)`` of the layer (the append then
    quantizes in a launch of its own, before the decode's).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    num_splits: int
    ws_o: torch.Tensor | None
    ws_lse: torch.Tensor | None
    ws_count: torch.Tensor | None  # arrival counters of the in-kernel split merge, or None
    pdl: bool
    _entry: object
    _device_index: int
    _table_args: tuple  # kv_indptr .. ws_lse in the binding's order
    _tail_args: tuple  # ws_count, pdl (after the stream)
    slots: torch.Tensor | None = None
    append_last: bool = False
    _append_args: tuple | None = None  # the binding's (slots) or (slots=None, append_last=True)
    _unguarded: tuple | None = None  # (entry point, failed): _plugin.unguarded's, for the runner

    @property
    def appends(self) -> bool:
        """True when a call can write the step's keys/values (the module has the fused append)."""
        return self._append_args is not None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, *,
                 cache_args: tuple | None = None, variant=None, kv_scales: tuple | None = None) -> torch.Tensor:
        """``cache_args``: ``(tensor_arg(k_cache), tensor_arg(v_cache))`` when the caller keeps them."""
        if type(q) is not torch.Tensor or torch.compiler.is_compiling():
            if k_new is not None:
                raise ValueError("k_new: the fused append runs in eager mode only (append first)")
            k_scale, v_scale = kv_scales or (None, None)
            return attn_paged_decode(q, k_cache, v_cache, self.kv_indptr, self.kv_indices, self.kv_lens,
                                     num_splits=self.num_splits, k_scale=k_scale, v_scale=v_scale,
                                     **variant_kwargs(variant))
        if k_new is not None and self._append_args is None:
            raise ValueError("k_new: this launch has no fused append (the compiled module predates it)")
        return self.run_eager(q, cache_args or (tensor_arg(k_cache), tensor_arg(v_cache)), k_new, v_new,
                              variant=variant, kv_scales=kv_scales)

    def run_eager(self, q: torch.Tensor, cache_args: tuple, k_new: torch.Tensor | None = None,
                  v_new: torch.Tensor | None = None, *, variant=None, kv_scales: tuple | None = None) -> torch.Tensor:
        """The call for a caller that checked what ``__call__`` checks (plain tensors, eager
        mode, ``k_new`` only where :attr:`appends`) and keeps the layer's ``cache_args``."""
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # cheaper to call than torch.empty
        head = (tensor_arg(_rows_aligned(q)), *cache_args, tensor_arg(out), *self._table_args)
        tail = self._tail_args if k_new is None else (*self._tail_args, tensor_arg(k_new), tensor_arg(v_new),
                                                      *self._append_args)
        kwargs = variant_binding(variant)
        if kv_scales is not None:
            kwargs.update(kv_scales_arg(*kv_scales))
        _run(self._device_index, self._entry, head, tail, kwargs)
        return out

    def runner(self, q: torch.Tensor, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None):
        """``run_eager`` reduced to its launch for a caller's per-shape plan: ``run(q, cache_args,
        k_new, v_new, kv_scales=None)`` for plain tensors of these shapes, strides and dtypes
        (``k_new`` / ``v_new`` given here only where :attr:`appends`; None in a call: no append;
        ``kv_scales``: an FP8 cache's layer scales); only the data pointers are read per call.
        None when ``q``'s layout always needs a copy (``run_eager`` makes it)."""
        if not _rows_layout_ok(q):  # the pointer's alignment is checked per call
            return None
        shape, strides = tuple(q.shape), tuple(q.stride())
        code, dtype = dtype_code(q), q.dtype
        out_strides = contiguous_strides(shape)
        empty = empty_allocator(q.device)
        k_meta = None if k_new is None else (tuple(k_new.shape), tuple(k_new.stride()), dtype_code(k_new))
        v_meta = None if v_new is None else (tuple(v_new.shape), tuple(v_new.stride()), dtype_code(v_new))
        entry, failed = self._unguarded or (self._entry, _plugin.reraise)
        index, table, tail, append = self._device_index, self._table_args, self._tail_args, self._append_args

        def run(q: torch.Tensor, cache_args: tuple, k_new: torch.Tensor | None,
                v_new: torch.Tensor | None, kv_scales: tuple | None = None) -> torch.Tensor:
            ptr = q.data_ptr()
            current = current_device()
            if ptr % 16 or current != index:  # rows to copy, or another device current: run_eager does both
                return self.run_eager(q, cache_args, k_new, v_new, kv_scales=kv_scales)
            out = empty(shape, out_strides, dtype)
            k_cache, v_cache = cache_args
            scales = {} if kv_scales is None else kv_scales_arg(*kv_scales)
            try:
                if k_new is None:
                    entry((ptr, shape, strides, code), k_cache, v_cache, (out.data_ptr(), shape, out_strides, code),
                          *table, current_stream(current), *tail, **scales)
                else:
                    entry((ptr, shape, strides, code), k_cache, v_cache, (out.data_ptr(), shape, out_strides, code),
                          *table, current_stream(current), *tail, (k_new.data_ptr(), *k_meta),
                          (v_new.data_ptr(), *v_meta), *append, **scales)
            except BaseException as exc:
                failed(exc)
            return out

        return run


@dataclass(frozen=True, eq=False)
class PagedPrefillLaunch:
    """One batch's ragged paged prefill; call it with ``(q [total_q, Hq, D], k_cache, v_cache, is_causal)``."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    q_tile_to_batch: torch.Tensor
    q_tile_to_index: torch.Tensor
    _entry: object
    _device_index: int
    _table_args: tuple

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 is_causal: bool = True, *, variant=None, kv_scales: tuple | None = None) -> torch.Tensor:
        """``variant``: an ``AttentionVariant`` of the backend layer, or None (plain);
        ``kv_scales``: an FP8 cache's ``(k_scale, v_scale)`` of the layer."""
        if type(q) is not torch.Tensor or torch.compiler.is_compiling():
            k_scale, v_scale = kv_scales or (None, None)
            return attn_paged_prefill(q, k_cache, v_cache, self.qo_indptr, self.kv_indptr, self.kv_indices,
                                      self.kv_lens, self.q_tile_to_batch, self.q_tile_to_index, is_causal,
                                      k_scale=k_scale, v_scale=v_scale, **variant_kwargs(variant))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q = _rows_aligned(q)
        head = (tensor_arg(q), tensor_arg(k_cache), tensor_arg(v_cache), tensor_arg(out), *self._table_args,
                bool(is_causal))
        kwargs = variant_binding(variant)
        if kv_scales is not None:
            kwargs.update(kv_scales_arg(*kv_scales))
        _run(self._device_index, self._entry, head, (), kwargs)
        return out


def _device_index(t: torch.Tensor) -> int:
    if t.device.type != "cuda":
        raise ValueError(f"the paged kernels need CUDA tensors, got kv_lens on {t.device}")
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def plan_paged_decode(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor, *,
                      q_heads: int, kv_heads: int, head_dim: int, max_kv_len: int, page_size: int,
                      num_pages: int, in_kernel_merge: bool = False, pdl: bool = False,
                      slots: torch.Tensor | Callable[[], torch.Tensor] | None = None,
                      append_last: bool = False, kv_bytes: int = 2,
                      workspaces: Callable[..., tuple] = _split_workspaces) -> PagedDecodeLaunch:
    """Plan a batch's paged decode (see the module docstring).

    ``max_kv_len``: the batch's longest request (tokens), which bounds the critical path of
    every split. ``in_kernel_merge`` / ``pdl``: the compiled module's alternatives to the
    combine kernel and to a plain launch, off by default (measured slower:
    docs/kernels/attention.md). ``page_size`` / ``num_pages``: the cache's, for the page-table
    checks. ``kv_bytes``: bytes per K/V value in the pages (1: FP8), for the split count.

    Appending in the launch, where the compiled module can (``PagedDecodeLaunch.appends``):
    ``append_last`` is the caller's word that every request adds exactly one token, at its
    last position ``kv_lens[b] - 1`` (a decode step); the decode kernel then writes it to the
    row the page table gives that position (what the table holds when the launch runs, so a
    CUDA graph replay writes its own step's rows). Otherwise, or with a module built before
    that, ``slots``: the plan's ``write_index`` (int64 ``[B]``), or a callable returning it,
    called only when the launch needs it.

    ``workspaces(splits, batch, q_heads, head_dim, device) -> (ws_o, ws_lse)``: where the
    split-K partials live; by default the launch allocates (and owns) them. A step of a
    static plan passes ``StaticDecodePlan.split_workspaces``, so a graph captured over the
    step writes memory that outlives the step.
    """
    batch = kv_lens.shape[0] if isinstance(kv_lens, torch.Tensor) and kv_lens.dim() == 1 else 0
    check_decode_table(ATTN_PAGED_DECODE, batch, kv_indptr, kv_indices, kv_lens, page_size=page_size,
                           num_pages=num_pages)
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a positive multiple of kv_heads ({kv_heads})")
    index = _device_index(kv_lens)
    device = kv_lens.device
    module = _plugin.require(ATTN_PAGED_DECODE, torch.device("cuda", index))
    splits = module.decode_plan(batch, kv_heads, q_heads // kv_heads, head_dim, max(max_kv_len, 1),
                                _num_sms(torch.device("cuda", index)), **fp8_plan_arg(kv_bytes)) if batch > 0 else 1
    ws_o, ws_lse = workspaces(splits, batch, q_heads, head_dim, device)
    # One counter per (request, kv head, group of query heads): q_heads per request bounds it.
    ws_count = (torch.zeros(batch * q_heads, dtype=torch.int32, device=device)
                if in_kernel_merge and splits > 1 else None)
    table = (tensor_arg(kv_indptr), tensor_arg(kv_indices), tensor_arg(kv_lens), splits, tensor_arg(ws_o),
             tensor_arg(ws_lse))
    append_last = bool(append_last) and bool(getattr(module, "APPEND_LAST", False))
    slots = None if append_last else _checked_slots(slots, batch, device, module)
    append_args = (None, True) if append_last else None if slots is None else (tensor_arg(slots),)
    return PagedDecodeLaunch(kv_indptr, kv_indices, kv_lens, splits, ws_o, ws_lse, ws_count, bool(pdl),
                             module.attn_paged_decode, index, table, (tensor_arg(ws_count), bool(pdl)), slots,
                             append_last, append_args, _plugin.unguarded(module, ATTN_PAGED_DECODE))


def _checked_slots(slots, batch: int, device: torch.device, module) -> torch.Tensor | None:
    """``slots`` (called if a callable) once checked, or None where the module can't append."""
    can_append = getattr(module, "kv_append", None) is not None  # not a module built before the fused append
    if callable(slots):
        slots = slots() if can_append else None
    if slots is not None and (slots.dtype != torch.int64 or slots.shape != (batch,) or slots.device != device):
        raise ValueError(f"slots must be int64 [{batch}] on {device} (one cache row per request), got "
                         f"{slots.dtype} {tuple(slots.shape)} on {slots.device}")
    return slots if can_append else None


def plan_paged_prefill(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       kv_lens: torch.Tensor, q_tile_to_batch: torch.Tensor, q_tile_to_index: torch.Tensor, *,
                       total_q: int, page_size: int, num_pages: int) -> PagedPrefillLaunch:
    """Plan a batch's ragged paged prefill (see the module docstring). The Q tiles are of the
    module's ``Q_TILE_ROWS`` rows (``BatchPlan.q_tiles(ops.attention.q_tile_rows(device))``)."""
    check_prefill_table(ATTN_PAGED_PREFILL, total_q, qo_indptr, kv_indptr, kv_indices, kv_lens,
                        q_tile_to_batch, q_tile_to_index, page_size=page_size, num_pages=num_pages)
    index = _device_index(kv_lens)
    module = _plugin.require(ATTN_PAGED_PREFILL, torch.device("cuda", index))
    if debug_checks_enabled():
        check_q_tiles(ATTN_PAGED_PREFILL, qo_indptr, q_tile_to_batch, q_tile_to_index,
                      tile_rows=int(module.Q_TILE_ROWS))
    table = tuple(tensor_arg(t) for t in (qo_indptr, kv_indptr, kv_indices, kv_lens, q_tile_to_batch,
                                          q_tile_to_index))
    return PagedPrefillLaunch(qo_indptr, kv_indptr, kv_indices, kv_lens, q_tile_to_batch, q_tile_to_index,
                              module.attn_paged_prefill, index, table)

