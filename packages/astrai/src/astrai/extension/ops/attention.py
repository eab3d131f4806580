"""The astrai-attention plugin's kernels as torch custom ops (stateless; no fallback here).

=====================  ===========================================================================
``attn_decode``        ``(q [B,1,Hq,D], k [B,S,Hkv,D], v, mask=None [B,S] | [B,1,S]) -> [B,1,Hq,D]``
``attn_prefill``       ``(q [B,Lq,Hq,D], k [B,Lkv,Hkv,D], v, mask=None [B,Lkv] | [B,Lq,Lkv],
                       is_causal=False) -> [B,Lq,Hq,D]``
``attn_paged_decode``  ``(q [B,1,Hq,D], k_cache [P,page,Hkv,D], v_cache, kv_indptr [B+1],
                       kv_indices [nnz_pages], kv_lens [B], k_scale=None, v_scale=None) -> [B,1,Hq,D]``
``attn_paged_prefill`` ``(q [total_q,Hq,D], k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                       kv_lens, q_tile_to_batch, q_tile_to_index, is_causal=True, k_scale=None,
                       v_scale=None) -> [total_q,Hq,D]``
=====================  ===========================================================================

bf16 or fp16, head_dim 64/128/256, ``Hq`` a multiple of ``Hkv``; index tensors int32 on the
same device (the :class:`~astrai.extension.kv_cache.BatchPlan` fields). Every op also takes the
variant keywords of ``attention()``: ``scale``, ``logits_soft_cap``, ``window_left``, ``sinks``
and ``alibi_slopes`` (both float32 ``[Hq]``), validated by the compiled module. Any strides with a
contiguous last dim are accepted (BHLD is a permuted view); rows that are not 16-byte
aligned are copied first. Masks are bool, True = keep; causal is bottom-right aligned;
scale is ``1/sqrt(head_dim)``; a row that sees no key returns zeros. The paged ops also
read FP8 pages (``float8_e4m3fn`` / ``float8_e5m2``, the module's ``KV_DTYPES``) with the layer's
float32 dequantization scales ``k_scale`` / ``v_scale`` (``[1]`` or ``[Hkv]``: docs/kv_cache_fp8.md).

Each op is a ``torch.library.custom_op`` (``torch.ops.astrai.attn_*``) with a fake
implementation, so it traces under ``torch.compile``. Called alone, the decode ops size
their split-K workspace from shapes only (``decode_plan``) and never synchronize, so they
can be captured in a CUDA graph; a batch that runs many layers plans once instead
(:mod:`.attention_plan`). Type errors raise ``TypeError`` here; the paged ops check their
page tables' shapes on the host, and their values on the device with ``ASTRAI_DEBUG=1``
(:mod:`.page_table`); the compiled module validates everything else before launching
(``ValueError`` naming the argument). A
missing or unusable plugin raises ``RuntimeError`` with the install command
(``_plugin.require``).

Call convention (ABI 1): tensors as ``(data_ptr, shape, strides, dtype_code)`` tuples,
the stream as an int; the module writes into a preallocated ``out``.
"""

from __future__ import annotations

import torch

from ..abi import (contiguous_strides, current_device, current_stream, dtype_code, empty_allocator,
                   launch, tensor_arg)
from ..compiling import assume_constant_result
from ..op_names import ATTN_DECODE, ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL, ATTN_PREFILL
from . import _plugin
from .attention_args import kv_scales_arg, variant_arg
# _num_sms, fp8_plan_arg and _split_workspaces are attention_plan's too, through this module
from .decode_splits import (_decode_workspace, _num_sms, _split_count, _split_workspace_shapes,  # noqa: F401
                            _split_workspaces, fp8_plan_arg)
from .page_table import check_decode_table, check_prefill_table, check_q_tiles, debug_checks_enabled

__all__ = ["attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill", "q_tile_rows"]



def _rows_layout_ok(t: torch.Tensor) -> bool:
    """Whether ``t``'s layout lets the kernels stream its rows with 16-byte copies (given a
    16-byte aligned data pointer): a contiguous last dim, every other stride of a dim longer
    than one a multiple of 8 elements."""
    if t.is_contiguous() and t.shape[-1] % 8 == 0:
        return True  # every stride is a multiple of the last dim
    return t.stride(-1) == 1 and all(s % 8 == 0 or n <= 1 for s, n in zip(t.stride()[:-1], t.shape[:-1]))


def _rows_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` when the kernels can stream it with 16-byte copies, else a contiguous copy."""
    if t.data_ptr() % 16 == 0 and _rows_layout_ok(t):
        return t
    # clone, not contiguous(): a contiguous view at a misaligned offset needs its copy too
    return t.clone(memory_format=torch.contiguous_format)


def _check_tensors(op: str, device_of: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device_of.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {device_of.device}")
    if not device_of.is_cuda:
        raise ValueError(f"{op}: q must be a CUDA tensor, got one on {device_of.device}")
    if torch.compiler.is_compiling():  # the registry's context is not traceable; the binding checks dtypes too
        return
    spec = _plugin.op_spec(op, device_of.device)  # None without a usable plugin: require() says why
    reason = None if spec is None else spec.unsupported(str(device_of.dtype).removeprefix("torch."))
    if reason is not None:
        raise TypeError(f"{op}: q: {reason}")


@assume_constant_result  # a constant of the binary: traced graphs read it once, not the registry
def q_tile_rows(device: torch.device | str | None = None) -> int:
    """Rows of the paged prefill kernels' Q tiles (``q_tile_to_batch`` / ``q_tile_to_index``):
    the compiled module's ``Q_TILE_ROWS``, the one definition of it."""
    return int(_plugin.require(ATTN_PAGED_PREFILL, device).Q_TILE_ROWS)


# ---- attn_decode ----------------------------------------------------------------------

def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                scale: float | None = None, logits_soft_cap: float | None = None, window_left: int = -1,
                sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over contiguous K/V (split-KV). See the module docstring."""
    _check_tensors(ATTN_DECODE, q, q=q, k=k, v=v, mask=mask, sinks=sinks, alibi_slopes=alibi_slopes)
    return _attn_decode_op(q, k, v, mask, scale, logits_soft_cap, window_left, sinks, alibi_slopes)


@_plugin.plugin_op(f"astrai::{ATTN_DECODE}")
def _attn_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float | None = None, logits_soft_cap: float | None = None, window_left: int = -1,
                    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    module = _plugin.require(ATTN_DECODE, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q, k, v = _rows_aligned(q), _rows_aligned(k), _rows_aligned(v)
    kv_heads = k.shape[2] if k.dim() == 4 else 1
    kv_len = k.shape[1] if k.dim() == 4 else 1
    splits, ws_o, ws_lse = _decode_workspace(module, q, kv_heads, kv_len) if q.dim() == 4 else (1, None, None)
    launch(q.device, module.attn_decode, tensor_arg(q), tensor_arg(k), tensor_arg(v), tensor_arg(out), tensor_arg(mask), splits, tensor_arg(ws_o),
         tensor_arg(ws_lse), **variant_arg(scale, logits_soft_cap, window_left, sinks, alibi_slopes))
    return out


@_attn_decode_op.op.register_fake
def _(q, k, v, mask, scale=None, logits_soft_cap=None, window_left=-1, sinks=None, alibi_slopes=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ---- attn_prefill ---------------------------------------------------------------------

def attn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 is_causal: bool = False, *, scale: float | None = None, logits_soft_cap: float | None = None,
                 window_left: int = -1, sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention over contiguous K/V (split-Q). See the module docstring."""
    _check_tensors(ATTN_PREFILL, q, q=q, k=k, v=v, mask=mask, sinks=sinks, alibi_slopes=alibi_slopes)
    return _attn_prefill_op(q, k, v, mask, bool(is_causal), scale, logits_soft_cap, window_left, sinks,
                            alibi_slopes)


@_plugin.plugin_op(f"astrai::{ATTN_PREFILL}")
def _attn_prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     is_causal: bool, scale: float | None = None, logits_soft_cap: float | None = None,
                     window_left: int = -1, sinks: torch.Tensor | None = None,
                     alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    module = _plugin.require(ATTN_PREFILL, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q, k, v = _rows_aligned(q), _rows_aligned(k), _rows_aligned(v)
    launch(q.device, module.attn_prefill, tensor_arg(q), tensor_arg(k), tensor_arg(v), tensor_arg(out), tensor_arg(mask), is_causal,
           **variant_arg(scale, logits_soft_cap, window_left, sinks, alibi_slopes))
    return out


@_attn_prefill_op.op.register_fake
def _(q, k, v, mask, is_causal, scale=None, logits_soft_cap=None, window_left=-1, sinks=None, alibi_slopes=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ---- attn_paged_decode ----------------------------------------------------------------

def _cache_geometry(op: str, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    """(batch, page_size, num_pages) of a paged call, or a ValueError naming the argument."""
    if not isinstance(q, torch.Tensor) or not isinstance(k_cache, torch.Tensor):
        name, t = ("q", q) if not isinstance(q, torch.Tensor) else ("k_cache", k_cache)
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 4:
        raise ValueError(f"{op}: k_cache must be [num_pages, page_size, kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if q.dim() < 1:
        raise ValueError(f"{op}: q must have a batch (or token) dimension, got shape {tuple(q.shape)}")
    return q.shape[0], k_cache.shape[1], k_cache.shape[0]


def attn_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, kv_lens: torch.Tensor, *, num_splits: int = 0,
                      scale: float | None = None, logits_soft_cap: float | None = None, window_left: int = -1,
                      sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache (split-KV). See the module docstring.

    ``num_splits``: the split-KV count (a :func:`~.attention_plan.plan_paged_decode` plan's);
    0 plans it here from shapes (the mean tokens per request). ``k_scale`` / ``v_scale``: an
    FP8 cache's dequantization scales of this layer (``PagedKVCache.kv_scales``).

    An eager call is checked once per kind of call (:func:`_eager_decode_key`); a repeated one
    only launches.
    """
    key = _eager_decode_key(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, num_splits, scale,
                            logits_soft_cap, window_left, sinks, alibi_slopes, k_scale, v_scale)
    if key is not None:
        found = _EAGER_DECODES.get(key)
        if found is not None and found[0] is _plugin.op_status(ATTN_PAGED_DECODE, q.device):
            return found[1](q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, sinks, alibi_slopes, k_scale,
                            v_scale)
    batch, page_size, num_pages = _cache_geometry(ATTN_PAGED_DECODE, q, k_cache)
    check_decode_table(ATTN_PAGED_DECODE, batch, kv_indptr, kv_indices, kv_lens, page_size=page_size,
                       num_pages=num_pages)
    _check_tensors(ATTN_PAGED_DECODE, q, q=q, k_cache=k_cache, v_cache=v_cache, kv_indptr=kv_indptr,
                   kv_indices=kv_indices, kv_lens=kv_lens, sinks=sinks, alibi_slopes=alibi_slopes, k_scale=k_scale,
                   v_scale=v_scale)
    if key is not None:  # checked: remember the kind of call with its launch
        if len(_EAGER_DECODES) >= 512:  # many shapes: start over rather than grow
            _EAGER_DECODES.clear()
        found = _EAGER_DECODES[key] = (_plugin.op_status(ATTN_PAGED_DECODE, q.device),
                                       _eager_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens,
                                                     num_splits, scale, logits_soft_cap, window_left, sinks,
                                                     alibi_slopes, k_scale, v_scale))
        return found[1](q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, sinks, alibi_slopes, k_scale,
                        v_scale)
    return _attn_paged_decode_op(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, int(num_splits), scale,
                                 logits_soft_cap, window_left, sinks, alibi_slopes, k_scale, v_scale)


@_plugin.plugin_op(f"astrai::{ATTN_PAGED_DECODE}")
def _attn_paged_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_indices: torch.Tensor, kv_lens: torch.Tensor, num_splits: int = 0,
                          scale: float | None = None, logits_soft_cap: float | None = None, window_left: int = -1,
                          sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    module = _plugin.require(ATTN_PAGED_DECODE, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q = _rows_aligned(q)
    splits = _split_count(module, q, k_cache, kv_indices, num_splits)
    ws_o, ws_lse = _split_workspaces(splits, q.shape[0], q.shape[2], q.shape[3], q.device) if splits > 1 else \
        (None, None)
    launch(q.device, module.attn_paged_decode, tensor_arg(q), tensor_arg(k_cache), tensor_arg(v_cache), tensor_arg(out), tensor_arg(kv_indptr),
         tensor_arg(kv_indices), tensor_arg(kv_lens), splits, tensor_arg(ws_o), tensor_arg(ws_lse),
           **variant_arg(scale, logits_soft_cap, window_left, sinks, alibi_slopes), **kv_scales_arg(k_scale, v_scale))
    return out


# The eager attn_paged_decode calls checked so far: key (``_eager_decode_key``) -> (the op's
# registry status they were checked under, their launch). A status that changed (the op
# marked unusable, another runtime) checks the call again.
_EAGER_DECODES: dict[tuple, tuple] = {}
_SCALARS = (type(None), int, float)


def _tensor_facts(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _eager_decode_key(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, num_splits, scale, logits_soft_cap,
                      window_left, sinks, alibi_slopes, k_scale, v_scale) -> tuple | None:
    """Every fact of an ``attn_paged_decode`` call that its checks read: each tensor's shape,
    strides, dtype and device (``kv_indices``' length aside: it grows with the requests, it is
    checked by nothing and read by the launch), the split count and the variant's values. None
    for a call that is checked every time: traced, with ``ASTRAI_DEBUG`` (the page tables'
    values are checked), an argument of another type than the plain ones (tensor subclasses,
    numbers that are no int or float)."""
    if not (type(q) is type(k_cache) is type(v_cache) is type(kv_indptr) is type(kv_indices) is type(kv_lens)
            is torch.Tensor and type(num_splits) is int and type(window_left) is int
            and type(scale) in _SCALARS and type(logits_soft_cap) in _SCALARS):
        return None
    optional = (sinks, alibi_slopes, k_scale, v_scale)
    plain = sinks is None and alibi_slopes is None and k_scale is None and v_scale is None
    if not plain and any(t is not None and type(t) is not torch.Tensor for t in optional):
        return None
    if torch.compiler.is_compiling() or debug_checks_enabled():
        return None
    return (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, kv_indptr.shape, kv_indptr.stride(),
            kv_indptr.dtype, kv_indptr.device, kv_indices.stride(), kv_indices.dtype, kv_indices.device,
            kv_lens.shape, kv_lens.stride(), kv_lens.dtype, kv_lens.device, num_splits, scale, logits_soft_cap,
            window_left, None if plain else tuple(map(_tensor_facts, optional)))


def _eager_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, num_splits, scale, logits_soft_cap,
                  window_left, sinks, alibi_slopes, k_scale, v_scale):
    """``_attn_paged_decode_op`` reduced to its launch for the checked calls of one key: ``run(q,
    k_cache, v_cache, kv_indptr, kv_indices, kv_lens, sinks, alibi_slopes, k_scale, v_scale)`` reads
    the data pointers and ``kv_indices``' length only (rows to copy, or another device current: the
    op itself runs)."""
    module = _plugin.require(ATTN_PAGED_DECODE, q.device)
    entry, failed = _plugin.unguarded(module, ATTN_PAGED_DECODE)
    rows_ok, index = _rows_layout_ok(q), q.device.index
    shape, dtype = tuple(q.shape), q.dtype
    out_strides = contiguous_strides(shape)
    q_m, k_m, v_m, indptr_m, lens_m = (_arg_meta(t) for t in (q, k_cache, v_cache, kv_indptr, kv_lens))
    out_m, indices_m = (shape, out_strides, q_m[2]), (tuple(kv_indices.stride()), dtype_code(kv_indices))
    empty = empty_allocator(q.device)
    by_length: dict[torch.Size, tuple] = {}  # kv_indices' shape -> (split count, workspace shapes)
    # the variant / FP8-scale keywords: fixed without tensors among them, else built per call
    fixed_extra = variant_arg(scale, logits_soft_cap, window_left) \
        if sinks is None and alibi_slopes is None and k_scale is None and v_scale is None else None

    def run(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, sinks, alibi_slopes, k_scale,
            v_scale) -> torch.Tensor:
        ptr = q.data_ptr()
        current = current_device()
        if ptr % 16 or not rows_ok or (index is not None and current != index):
            return _attn_paged_decode_op(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, num_splits, scale,
                                         logits_soft_cap, window_left, sinks, alibi_slopes, k_scale, v_scale)
        indices_shape = kv_indices.shape
        split = by_length.get(indices_shape)
        if split is None:
            if len(by_length) >= 1024:
                by_length.clear()
            splits = _split_count(module, q, k_cache, kv_indices, num_splits)
            split = by_length[indices_shape] = (splits, _split_workspace_shapes(splits, shape))
        splits, ws = split
        extra = fixed_extra if fixed_extra is not None else \
            {**variant_arg(scale, logits_soft_cap, window_left, sinks, alibi_slopes),
             **kv_scales_arg(k_scale, v_scale)}
        out = empty(shape, out_strides, dtype)
        ws_o = ws_lse = None
        if ws is not None:
            (o_shape, lse_shape), strides, code = ws
            # the tensors stay referenced until the launch is issued: freed earlier, the
            # allocator hands their memory to the next allocation (ws_lse, or the graph's next op)
            o_ws, lse_ws = empty(o_shape, strides, torch.float32), empty(lse_shape, strides, torch.float32)
            ws_o = (o_ws.data_ptr(), o_shape, strides, code)
            ws_lse = (lse_ws.data_ptr(), lse_shape, strides, code)
        try:
            entry((ptr, *q_m), (k_cache.data_ptr(), *k_m), (v_cache.data_ptr(), *v_m), (out.data_ptr(), *out_m),
                  (kv_indptr.data_ptr(), *indptr_m), (kv_indices.data_ptr(), tuple(indices_shape), *indices_m),
                  (kv_lens.data_ptr(), *lens_m), splits, ws_o, ws_lse, current_stream(current), **extra)
        except BaseException as exc:
            failed(exc)
        return out

    return run


def _arg_meta(t: torch.Tensor) -> tuple:
    """``tensor_arg(t)`` without its data pointer: ``(shape, strides, dtype code)``."""
    return tuple(t.shape), tuple(t.stride()), dtype_code(t)


@_attn_paged_decode_op.op.register_fake
def _(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, num_splits=0, scale=None, logits_soft_cap=None,
      window_left=-1, sinks=None, alibi_slopes=None, k_scale=None, v_scale=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ---- attn_paged_prefill ---------------------------------------------------------------

def attn_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                       kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                       q_tile_to_batch: torch.Tensor, q_tile_to_index: torch.Tensor,
                       is_causal: bool = True, *, scale: float | None = None, logits_soft_cap: float | None = None,
                       window_left: int = -1, sinks: torch.Tensor | None = None,
                       alibi_slopes: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Ragged (packed-Q) prefill over a paged KV cache. See the module docstring; ``k_scale`` /
    ``v_scale`` as :func:`attn_paged_decode`'s."""
    total_q, page_size, num_pages = _cache_geometry(ATTN_PAGED_PREFILL, q, k_cache)
    check_prefill_table(ATTN_PAGED_PREFILL, total_q, qo_indptr, kv_indptr, kv_indices, kv_lens, q_tile_to_batch,
                        q_tile_to_index, page_size=page_size, num_pages=num_pages)
    _check_tensors(ATTN_PAGED_PREFILL, q, q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr,
                   kv_indptr=kv_indptr, kv_indices=kv_indices, kv_lens=kv_lens, q_tile_to_batch=q_tile_to_batch,
                   q_tile_to_index=q_tile_to_index, sinks=sinks, alibi_slopes=alibi_slopes, k_scale=k_scale,
                   v_scale=v_scale)
    if debug_checks_enabled():
        check_q_tiles(ATTN_PAGED_PREFILL, qo_indptr, q_tile_to_batch, q_tile_to_index, tile_rows=q_tile_rows(q.device))
    return _attn_paged_prefill_op(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens,
                                  q_tile_to_batch, q_tile_to_index, bool(is_causal), scale, logits_soft_cap,
                                  window_left, sinks, alibi_slopes, k_scale, v_scale)


@_plugin.plugin_op(f"astrai::{ATTN_PAGED_PREFILL}")
def _attn_paged_prefill_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                           q_tile_to_batch: torch.Tensor, q_tile_to_index: torch.Tensor,
                           is_causal: bool, scale: float | None = None, logits_soft_cap: float | None = None,
                           window_left: int = -1, sinks: torch.Tensor | None = None,
                           alibi_slopes: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    module = _plugin.require(ATTN_PAGED_PREFILL, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q = _rows_aligned(q)
    launch(q.device, module.attn_paged_prefill, tensor_arg(q), tensor_arg(k_cache), tensor_arg(v_cache), tensor_arg(out), tensor_arg(qo_indptr),
         tensor_arg(kv_indptr), tensor_arg(kv_indices), tensor_arg(kv_lens), tensor_arg(q_tile_to_batch), tensor_arg(q_tile_to_index),
         is_causal, **variant_arg(scale, logits_soft_cap, window_left, sinks, alibi_slopes),
         **kv_scales_arg(k_scale, v_scale))
    return out


@_attn_paged_prefill_op.op.register_fake
def _(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens, q_tile_to_batch, q_tile_to_index, is_causal,
      scale=None, logits_soft_cap=None, window_left=-1, sinks=None, alibi_slopes=None, k_scale=None, v_scale=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
