"""Linears over FP8 weights with one scale per output channel, for decoding.

``quantize_weight(weight, dtype=torch.float8_e4m3fn) -> (w, w_scale)``: ``weight [N, K]`` in
one byte a value, ``w_scale [N]`` float32 the dequantization scale of each output channel
(``amax of the row / the format's largest value``; a zero row gets 1), so that ``weight ~
w * w_scale[:, None]`` with FP8's relative rounding (2^-4 for e4m3, 2^-3 for e5m2).

``fp8_weight_linear(x, w, w_scale, bias=None) -> y``: ``F.linear(x, w * w_scale[:, None], bias)``
for ``x [..., K]`` bfloat16 / float16 / float32, ``y`` in ``x``'s dtype. The activations stay
in their dtype: a decode step reads every weight once for a few tokens, so the weights' one byte
is what halves its time. The astrai-fp8 plugin's kernel (op ``fp8_weight_gemm``) runs CUDA calls
of at most 256 rows it can take (in launches of 64 rows; 16-bit ``x``, K a multiple of 256,
16-byte aligned rows, no gradient wanted) below ``W8A8_MIN_ROWS`` rows; from there, on Hopper,
the activations are quantized per token and multiplied in FP8 (the plugin's row-wise GEMM up to
64 rows, ``torch._scaled_mm`` above; the route table, :func:`fp8_weight_route`); otherwise the
torch path: float32 products of the dequantized weights, summed in float32 and rounded once, as
the kernel does (16-bit CUDA calls, a prefill's, multiply in their dtype: ``_torch_path``).
Decisions go through the resolver once per (device, dtype, K) (``explain("fp8_weight_gemm")``).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn.functional as F

from ..device import probe_device
from ..op_names import FP8_WEIGHT_GEMM
from ..ops import fp8_weights as ops_fp8_weights
from .rotary import choose, fall_back

__all__ = ["W8A8_MIN_ROWS", "decided_routes", "fp8_input_linear", "fp8_weight_linear", "fp8_weight_route", "quantize_activations",
           "quantize_per_token", "quantize_weight"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# rows of x the kernel serves, in launches of ops_fp8_weights.MAX_ROWS: a decode step of up to 256
# requests (the torch path's dequantized copy moves about 5 bytes a weight, a launch 1)
MAX_CHUNKED_ROWS = 4 * ops_fp8_weights.MAX_ROWS
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The route table, by the rows of x (a decode step's tokens), for 16-bit CUDA calls:
#   rows <  W8A8_MIN_ROWS: the weight-only kernel (16-bit activations: nothing to quantize, and
#                          the weights' one byte is the whole cost);
#   rows >= W8A8_MIN_ROWS: W8A8 on Hopper: the activations quantized per token to e4m3, then
#                          an FP8 tensor-core GEMM with row-wise scales: the plugin's (gemm_rowwise)
#                          up to 64 rows, torch._scaled_mm (cuBLASLt) above.
# The weight-only kernel runs mma.sync in fp16, whose ~300 TFLOP/s bound a GEMM of 2*M*N*K flops
# above the weights' N*K bytes at 3 TB/s past M ~ 50 rows (its byte conversions cost more: 3.2x
# its bytes' time at 64 rows, measured). Measured on an H100 (bench/bench_fp8_weight_routes.py,
# weights cold in L2; docs/fp8.md): Llama-3-8B's four decoder linears take 124.6 us on the kernel
# and 130.7 on W8A8 at 32 rows, 240.7 and 130.2 at 64. W8A8 pays only with the plugin's one-launch
# quantize (quantize_rows, 2.5-4 us): torch's seven element-wise kernels cost 15-35 us a call.
W8A8_MIN_ROWS = 33
W8A8_MIN_SM = 90  # row-wise scaled FP8 GEMMs of torch._scaled_mm
ROWWISE_SM = 90  # the plugin's row-wise GEMM: sm_90a code (wgmma, TMA, clusters)
_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, w_scale)``: ``weight [N, K]`` as FP8 of ``dtype`` with one float32 scale per row."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or not weight.is_floating_point() or weight.dtype in _FP8:
        raise ValueError(f"weight must be a 2-D [N, K] floating tensor (not FP8), got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if dtype not in _FP8:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if not torch.isfinite(amax).all():
        raise ValueError("weight holds inf or NaN: its rows cannot be scaled into FP8")
    w_scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    return (w / w_scale[:, None]).to(dtype), w_scale


def _check(x: object, w: object, w_scale: object, bias: object) -> None:
    for name, t in (("x", x), ("w", w), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in _X_DTYPES or x.dim() < 1:
        raise TypeError(f"x must be a bfloat16, float16 or float32 tensor [..., K], got {x.dtype} {tuple(x.shape)}")
    if w.dtype not in _FP8 or w.dim() != 2:
        raise TypeError(f"w must be a float8_e4m3fn or float8_e5m2 [N, K] tensor (quantize_weight), got {w.dtype} "
                        f"{tuple(w.shape)}")
    if w.shape[1] != x.shape[-1]:
        raise ValueError(f"w has shape {tuple(w.shape)}: expected [N, {x.shape[-1]}] (x's last dim is K)")
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (w.shape[0],):
        raise ValueError(f"w_scale must be float32 [{w.shape[0]}] (one scale per output channel), got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (w.shape[0],)):
        raise ValueError(f"bias must be None or a [{w.shape[0]}] tensor")
    for name, t in (("w", w), ("w_scale", w_scale)) + ((("bias", bias),) if bias is not None else ()):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.dim() < 2 or (t.stride(0) * t.element_size()) % 16 == 0)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, scale)``: each row of ``x [M, K]`` in e4m3 with its own float32 dequantization
    scale ``[M, 1]`` (``amax of the row * float32(1 / 448)``; a zero row gets 1), the torch path
    of the activations' quantize that the W8A8 route runs before its GEMM (the plugin's
    ``quantize_rows`` gives the same bytes: a multiply by the reciprocal, on every device, where
    a division by 448 is one on CUDA and not on the CPU)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax * (1.0 / _E4M3_MAX), torch.ones_like(amax))
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def quantize_activations(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token(x2)`` for ``x2 [M, K]``: the plugin's one launch where it has it
    (CUDA, 16-bit rows it can take), torch's seven kernels otherwise (the same bytes)."""
    return ops_fp8_weights.fp8_quantize_rows_unchecked(x2) if _plugin_quantizes(x2) else quantize_per_token(x2)


def fp8_input_linear(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The W8A8 route's GEMM over activations already quantized per token (``xq [M, K]`` e4m3,
    ``x_scale [M, 1]``: :func:`quantize_per_token`'s pair, or a norm's that made them,
    ``backend.norm_fp8``): ``(xq * x_scale) @ (w * w_scale[:, None]).T (+ bias)`` in ``out_dtype``,
    float32 accumulation: the plugin's row-wise GEMM where it takes the call (:func:`_plugin_multiplies`),
    else ``torch._scaled_mm`` with row-wise scales (cuBLASLt). Only where :func:`fp8_weight_route`
    gives "w8a8" for the 16-bit rows."""
    _ran("w8a8")
    if _plugin_multiplies(xq, x_scale, w, w_scale, out_dtype):
        y = ops_fp8_weights.fp8_rowwise_gemm_unchecked(xq, x_scale, w, w_scale)
    else:
        y = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


def _plugin_multiplies(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> bool:
    """Whether the plugin's row-wise GEMM takes a W8A8 call: bfloat16 out, at most
    ``ROWWISE_MAX_ROWS`` rows (its swap-AB tiles), an sm_90 device, K a multiple of 16, TMA-ready
    operands, and a plugin that has it."""
    return (out_dtype == torch.bfloat16 and xq.shape[0] <= ops_fp8_weights.ROWWISE_MAX_ROWS
            and probe_device(xq.device).sm == ROWWISE_SM and xq.shape[1] % 16 == 0 and _aligned(xq) and _aligned(w)
            and x_scale.is_contiguous() and w_scale.is_contiguous() and ops_fp8_weights.has_rowwise_gemm(xq.device))


def _w8a8(x2: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Per-token e4m3 activations times the e4m3 weights, scaled by rows and by channels, in
    ``x2``'s dtype (float32 accumulation)."""
    return fp8_input_linear(*quantize_activations(x2), w, w_scale, None, x2.dtype)


def _plugin_quantizes(x2: torch.Tensor) -> bool:
    return (x2.dtype in (torch.bfloat16, torch.float16) and x2.shape[1] % 8 == 0 and _aligned(x2)
            and ops_fp8_weights.has_quantize_rows(x2.device))


_DECIDING: list[tuple[str | None, Counter]] = []  # decided_routes' contexts, innermost last


@contextlib.contextmanager
def decided_routes(force: str | None = None):
    """Count the linears over FP8 weights run within, by route (a Counter, yielded: a CUDA
    graph's calls count once, at its capture); with ``force`` ("weight" or
    "w8a8"), that route wherever it can take a call the table sends to the other, so each
    route's accuracy can be measured at any batch size (``astrai generate --accuracy``).
    Process-wide while it lasts (the engine's step may run on another thread)."""
    if force not in (None, "weight", "w8a8"):
        raise ValueError(f"force must be None, 'weight' or 'w8a8', got {force!r}")
    counts: Counter = Counter()
    _DECIDING.append((force, counts))
    try:
        yield counts
    finally:
        _DECIDING.remove((force, counts))


def fp8_weight_route(x2: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, needs_grad: bool = False) -> str:
    """Which route a linear over FP8 weights takes for ``x2 [M, K]`` (see the route table):
    "weight" (the astrai-fp8 kernel), "w8a8" (per-token e4m3 activations, an FP8 GEMM)
    or "torch" (the dequantized weights' product)."""
    route = "torch"
    if _kernel_takes(x2, w, w_scale, needs_grad):
        w8a8 = _w8a8_takes(x2, w)
        route = "w8a8" if x2.shape[0] >= W8A8_MIN_ROWS and w8a8 else "weight"
        if _DECIDING and _DECIDING[-1][0] is not None:
            route = "w8a8" if _DECIDING[-1][0] == "w8a8" and w8a8 else "weight"
    return route


def _ran(route: str) -> None:
    if _DECIDING:
        _DECIDING[-1][1][route] += 1


def _w8a8_takes(x2: torch.Tensor, w: torch.Tensor) -> bool:
    sm = probe_device(x2.device).sm
    return (w.dtype == torch.float8_e4m3fn and sm is not None and sm >= W8A8_MIN_SM
            and x2.shape[1] % 16 == 0 and w.shape[0] % 16 == 0)


def _kernel_takes(x2: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, needs_grad: bool) -> bool:
    if x2.dtype == torch.float32 or x2.shape[0] > MAX_CHUNKED_ROWS or x2.shape[0] == 0:
        return False
    if x2.shape[1] % ops_fp8_weights.K_MULTIPLE or not (_aligned(x2) and _aligned(w) and w_scale.is_contiguous()):
        return False
    return choose(x2, needs_grad, FP8_WEIGHT_GEMM) == "cuda" and not needs_grad


def _kernel(x2: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The kernel over ``x2``'s rows, in launches of at most ``MAX_ROWS``: each reads the
    weights' bytes once, still fewer than the torch path's dequantized copy (written, then read
    in 16 bits) up to ``MAX_CHUNKED_ROWS``."""
    rows = ops_fp8_weights.MAX_ROWS
    if x2.shape[0] <= rows:
        return ops_fp8_weights.fp8_weight_gemm_unchecked(x2, w, w_scale)
    return torch.cat([ops_fp8_weights.fp8_weight_gemm_unchecked(x2[i:i + rows], w, w_scale)
                      for i in range(0, x2.shape[0], rows)])


def _torch_path(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float32 products summed in float32, one rounding (the kernel's arithmetic). A 16-bit CUDA
    call (a prefill's many rows) multiplies in its dtype instead, at cuBLAS's speed: FP8 values
    are exact in 16 bits, and the scale's extra rounding is far below FP8's own."""
    if x.is_cuda and x.dtype != torch.float32:
        return F.linear(x, w.to(x.dtype)) * w_scale.to(x.dtype)
    return (F.linear(x.float(), w.float()) * w_scale).to(x.dtype)


def fp8_weight_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w * w_scale[:, None], bias)`` in ``x``'s dtype (see the module docstring).
    Bad arguments raise ``TypeError`` / ``ValueError`` naming the argument."""
    _check(x, w, w_scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or w_scale.requires_grad)
    route = fp8_weight_route(x2, w, w_scale, needs_grad)
    if route != "w8a8":  # (fp8_input_linear counts its own)
        _ran(route)
    if route == "w8a8":
        y = _w8a8(x2, w, w_scale)
    elif route == "weight":
        try:
            y = _kernel(x2, w, w_scale)
        except RuntimeError:
            y = fall_back(x.device, lambda: _torch_path(x2, w, w_scale), FP8_WEIGHT_GEMM)
    else:
        y = _torch_path(x2, w, w_scale)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias.to(y.dtype)
