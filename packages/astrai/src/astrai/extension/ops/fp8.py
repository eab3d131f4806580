"""FP8 primitives of the astrai-fp8 plugin as torch custom ops.

``fp8_quantize(x, scale, fmt="e4m3", out_layout=0) -> (q, q_t, amax)``
    ``q = saturate(x * scale)`` in e4m3 / e5m2 (round to nearest even, clamped to the
    format's largest finite value), ``amax = max|x|`` in the *input* domain. ``scale`` is
    the quantization **multiplier** (the strategy layer passes the reciprocal of its
    dequantization scale). ``x`` is ``[M, K]`` float32 / float16 / bfloat16;
    ``out_layout`` 0 returns ``q [M, K]``, 1 ``q_t [K, M]`` (contiguous, the operand a
    K-major GEMM wants), 2 both; the output not asked for is an empty tensor.
``fp8_gemm(a, b, scale, bias=None, trans_a=False, trans_b=False) -> [M, N] bf16``
    ``scale * op(a) @ op(b) + bias``. ``a`` is ``[M, K]`` (``[K, M]`` if ``trans_a``),
    ``b`` is ``[K, N]`` (``[N, K]`` if ``trans_b``), both FP8 with a contiguous last dim;
    ``scale`` is the **combined dequantization scale** ``sa * sb``; ``bias`` bf16 ``[N]``.
``quantize(x, scale, fmt="e4m3") -> (q, amax)``: ``fp8_quantize`` with ``out_layout`` 0.
``mm_fp8(a [M, K], b [K, N], scale, bias=None) -> [M, N]``: ``fp8_gemm`` with the
    transposes read off the strides (``w.t()`` of a row-major ``[N, K]`` weight is the
    common ``b`` and costs no copy).
``quantize_launcher`` / ``scale_update`` call the module directly for the FP8 linear, which
    checked its operands once (the end-of-step update of delayed scaling in one kernel).

The two primitives are ``torch.ops.astrai.fp8_quantize`` / ``torch.ops.astrai.fp8_gemm``
with fake implementations (``torch.compile``, CUDA graphs). The public functions validate
first (``TypeError`` / ``ValueError`` naming the argument) and raise ``RuntimeError``
naming the plugin and its install command when it is missing (``_plugin.require``). No
fallback here: ``backend/fp8.py`` owns the policy (cuBLASLt, emulation).

Call convention (ABI 1) of ``astrai_fp8._fp8_ops``:
``quantize(x, scale, q, q_t, amax, out_layout, stream)`` and
``gemm(a, b, scale, bias_or_None, out, trans_a, trans_b, stream)``, tensors as tuples
``(data_ptr, shape, strides_in_elements, dtype_code)``, the stream an int.
"""

from __future__ import annotations

import functools
import threading

import torch

from ..abi import DTYPE_CODES, current_stream, launch, tensor_arg
from ..op_names import FP8_GEMM, FP8_QUANTIZE
from . import _plugin

__all__ = ["fp8_gemm", "fp8_quantize", "mm_fp8", "quantize"]

_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_scale(scale: object, device: torch.device) -> None:
    _check_tensor("scale", scale)
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise TypeError(f"scale must be a float32 tensor with one element, got {scale.dtype} "
                        f"with {scale.numel()} elements")
    if scale.device != device:
        raise ValueError(f"scale is on {scale.device}, the operands on {device}")


def _check_cuda_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if 0 in t.shape:
        raise ValueError(f"{name} has a zero-size dimension: shape {tuple(t.shape)}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")


def _rows_ok(t: torch.Tensor) -> bool:
    """Unit column stride and non-overlapping rows: the kernel reads ``t`` in place."""
    rows, cols = t.shape
    return (t.stride(1) == 1 or cols == 1) and (rows == 1 or t.stride(0) >= cols)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if _rows_ok(t) else t.contiguous()


# ---------------------------------------------------------------------------- quantize
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3",
                 out_layout: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, q_t, amax)``; see the module docstring. CUDA tensors only."""
    _check_tensor("x", x)
    if x.dtype not in _INPUTS:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    _check_cuda_2d("x", x)
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    if isinstance(out_layout, bool) or out_layout not in (0, 1, 2):
        raise ValueError(f"out_layout must be 0, 1 or 2, got {out_layout!r}")
    _check_scale(scale, x.device)
    return _fp8_quantize_op(x, scale, fmt, int(out_layout))


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K], amax)``: :func:`fp8_quantize` with ``out_layout=0``."""
    q, _, amax = fp8_quantize(x, scale, fmt, 0)
    return q, amax


def _quantize_outputs(x: torch.Tensor, fmt: str, out_layout: int):
    dtype = _FORMATS[fmt]
    rows, cols = x.shape
    empty = torch.empty(0, dtype=dtype, device=x.device)
    q = torch.empty((rows, cols), dtype=dtype, device=x.device) if out_layout != 1 else empty
    q_t = torch.empty((cols, rows), dtype=dtype, device=x.device) if out_layout != 0 else empty
    amax = torch.empty((), dtype=torch.float32, device=x.device)
    return q, q_t, amax


@_plugin.plugin_op(f"astrai::{FP8_QUANTIZE}")
def _fp8_quantize_op(x: torch.Tensor, scale: torch.Tensor, fmt: str,
                     out_layout: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    module = _plugin.require(FP8_QUANTIZE, x.device)
    x = _row_major(x)
    amax = torch.empty((), dtype=torch.float32, device=x.device)
    q, q_t = quantize_launcher(module, fmt)(x, scale.reshape(()), out_layout, amax)
    if q is None or q_t is None:  # the op returns an empty tensor for the layout not asked for
        empty = torch.empty(0, dtype=_FORMATS[fmt], device=x.device)
        q, q_t = (empty, q_t) if q is None else (q, empty)
    return q, q_t, amax


@functools.lru_cache(maxsize=None)  # one per (plugin module, format): built once
def quantize_launcher(module, fmt: str):
    """``launch(x, scale, out_layout, amax, cache=None, out=None) -> (q, q_t)`` for one
    module and format: the quantize call itself, arguments taken as valid (2-D row-major
    ``x`` on a CUDA device, a 0-d float32 ``scale``, ``amax`` a float32 0-d tensor,
    possibly a view into a larger buffer, receiving ``max|x|``); ``q`` / ``q_t`` None for
    the layout not asked for. What does not change between calls (the output dtype and its
    code, the absent output's argument, the entry point) is looked up once; ``cache``, a
    dict kept by the caller with its ``scale`` and ``amax`` tensors, keeps their ABI
    arguments while the same tensors come back; ``out``, outputs a ``QuantizeScratch``
    keeps (made here where it has none). For callers that checked once and call often
    (the FP8 linear); everyone else goes through ``fp8_quantize``."""
    dtype = _FORMATS[fmt]
    code = DTYPE_CODES[dtype]
    absent = (0, (0,), (1,), code)  # the output not asked for: None, with its format
    entry = module.quantize

    def launch_quantize(x: torch.Tensor, scale: torch.Tensor, out_layout: int, amax: torch.Tensor,
                        cache: dict | None = None, out: tuple | None = None):
        rows, cols = x.shape
        device = x.device
        if out is None:
            q = q_t = None
        else:  # from a QuantizeScratch: (q, q_t) kept with their arguments, None where fresh
            q, q_t, q_arg, qt_arg = out
        if out_layout != 1 and q is None:
            q = torch.empty((rows, cols), dtype=dtype, device=device)
            q_arg = (q.data_ptr(), (rows, cols), (cols, 1), code)
        elif out_layout == 1:
            q_arg = absent
        if out_layout != 0 and q_t is None:
            q_t = torch.empty((cols, rows), dtype=dtype, device=device)
            qt_arg = (q_t.data_ptr(), (cols, rows), (rows, 1), code)
        elif out_layout == 0:
            qt_arg = absent
        kept = None if cache is None else cache.get("quantize")
        if kept is not None and kept[0] is scale and kept[1] is amax:
            scale_arg, amax_arg = kept[2], kept[3]
        else:
            scale_arg, amax_arg = tensor_arg(scale), tensor_arg(amax)
            if cache is not None:  # the tensors are kept with their arguments: their addresses stay theirs
                cache["quantize"] = (scale, amax, scale_arg, amax_arg)
        launch(device, entry, (x.data_ptr(), (rows, cols), tuple(x.stride()), DTYPE_CODES[x.dtype]),
               scale_arg, q_arg, qt_arg, amax_arg, out_layout)
        return q, q_t

    return launch_quantize


class QuantizeScratch:
    """Quantize outputs kept by one call site and written again on its next call, for
    outputs read only until then (the FP8 linear's activation and gradient copies, dead
    after its GEMMs): a call then allocates nothing. Safe as CUDA orders the next call's
    quantize after the reads on the same stream, so buffers are per thread and stream;
    none during a CUDA graph capture (its allocations belong to the graph). At most
    ``kept`` shapes are kept (token counts vary between calls), the oldest dropped first."""

    def __init__(self, fmt: str, kept: int = 4):
        self.dtype, self.code, self.kept = _FORMATS[fmt], DTYPE_CODES[_FORMATS[fmt]], kept
        self.buffers: dict[tuple, tuple] = {}

    def outputs(self, x: torch.Tensor, out_layout: int, tag: str, with_t: bool) -> tuple | None:
        """``out`` for ``quantize_launcher``'s launch: ``q`` kept (``q_t`` too if ``with_t``,
        else made fresh by the launch, as a caller that keeps it needs), tagged ``tag`` so
        two operands of one call never share a buffer; None while a graph is captured."""
        device = x.device
        if torch.cuda.is_current_stream_capturing():
            return None
        rows, cols = x.shape
        key = (threading.get_ident(), current_stream(device.index), tag, rows, cols, out_layout, with_t)
        out = self.buffers.get(key)
        if out is None:
            if len(self.buffers) >= self.kept:
                del self.buffers[next(iter(self.buffers))]
            q = q_t = q_arg = qt_arg = None
            if out_layout != 1:
                q = torch.empty((rows, cols), dtype=self.dtype, device=device)
                q_arg = (q.data_ptr(), (rows, cols), (cols, 1), self.code)
            if out_layout != 0 and with_t:
                q_t = torch.empty((cols, rows), dtype=self.dtype, device=device)
                qt_arg = (q_t.data_ptr(), (cols, rows), (rows, 1), self.code)
            out = self.buffers[key] = (q, q_t, q_arg, qt_arg)
        return out


@_fp8_quantize_op.op.register_fake
def _fp8_quantize_fake(x: torch.Tensor, scale: torch.Tensor, fmt: str, out_layout: int):
    return _quantize_outputs(x, fmt, out_layout)


# ---------------------------------------------------------------------------- gemm
def _check_gemm(a: object, b: object, scale: object, bias: object, trans_a: bool,
                trans_b: bool) -> tuple[int, int, int]:
    for name, t in (("a", a), ("b", b)):
        _check_tensor(name, t)
        if t.dtype not in _FP8:
            raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
        _check_cuda_2d(name, t)
    if a.device != b.device:
        raise ValueError(f"a is on {a.device}, b on {b.device}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    kb, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != kb:
        raise ValueError(f"inner dimensions differ: op(a) is [{m}, {k}], op(b) is [{kb}, {n}]")
    _check_scale(scale, a.device)
    if bias is not None:
        _check_tensor("bias", bias)
        if bias.dtype != torch.bfloat16:
            raise TypeError(f"bias must be bfloat16, got {bias.dtype}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device}, the operands on {a.device}")
    return m, n, k


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, trans_a: bool = False,
             trans_b: bool = False) -> torch.Tensor:
    """``bf16(scale * op(a) @ op(b) + bias)``; see the module docstring."""
    _check_gemm(a, b, scale, bias, bool(trans_a), bool(trans_b))
    return _fp8_gemm_op(a, b, scale, bias, bool(trans_a), bool(trans_b))


def _as_operand(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A logical ``[R, C]`` operand as (stored tensor, transposed?) without copying when
    either its rows or its columns are contiguous."""
    if _rows_ok(t):
        return t, False
    if _rows_ok(t.t()):
        return t.t(), True
    return t.contiguous(), False


def mm_fp8(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``bf16(scale * a @ b + bias)`` for FP8 ``a [M, K]``, ``b [K, N]`` of any strides."""
    for name, t in (("a", a), ("b", b)):
        _check_tensor(name, t)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    a_st, trans_a = _as_operand(a)
    b_st, trans_b = _as_operand(b)
    return fp8_gemm(a_st, b_st, scale, bias, trans_a, trans_b)


def _gemm_shape(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, int]:
    return (a.shape[1] if trans_a else a.shape[0]), (b.shape[0] if trans_b else b.shape[1])


@_plugin.plugin_op(f"astrai::{FP8_GEMM}")
def _fp8_gemm_op(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 trans_a: bool, trans_b: bool) -> torch.Tensor:
    module = _plugin.require(FP8_GEMM, a.device)
    m, n = _gemm_shape(a, b, trans_a, trans_b)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    a, b = _row_major(a), _row_major(b)
    bias_arg = None if bias is None else tensor_arg(bias.contiguous())
    launch(a.device, module.gemm, tensor_arg(a), tensor_arg(b), tensor_arg(scale.reshape(())),
           bias_arg, tensor_arg(out), trans_a, trans_b)
    return out


@_fp8_gemm_op.op.register_fake
def _fp8_gemm_fake(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   trans_a: bool, trans_b: bool) -> torch.Tensor:
    m, n = _gemm_shape(a, b, trans_a, trans_b)
    return torch.empty((m, n), dtype=torch.bfloat16, device=a.device)


# ---------------------------------------------------------------------------- scale update
def scale_update(module, hist: torch.Tensor, pending: torch.Tensor, scale: torch.Tensor,
                 scale_inv: torch.Tensor, factor: float, most_recent: bool, cache: dict | None = None) -> None:
    """Delayed scaling's end of step for ``rows`` amax histories at once, in place, one
    plugin kernel (``fp8_scale_update``; its contract in docs/plugins.md): ``hist``
    (float32, contiguous, ``[..., L]``) gains ``pending`` (one amax per row) as its newest
    slot, ``pending`` is zeroed, ``scale`` (read first, as the previous scales) and
    ``scale_inv`` receive the new scales. Arguments taken as valid (the FP8 linear's end
    of step made them; the binding still checks them before the launch), ``module`` from
    ``_plugin.require``. ``cache``: a dict kept with these very tensors (emptied by the
    caller if it swaps them), holding their ABI arguments, so a step's update builds none."""
    args = None if cache is None else cache.get("scale_update")
    if args is None:
        args = (tensor_arg(hist), tensor_arg(pending), tensor_arg(scale), tensor_arg(scale), tensor_arg(scale_inv))
        if cache is not None:
            cache["scale_update"] = args
    launch(hist.device, module.scale_update, *args, float(factor), bool(most_recent))
