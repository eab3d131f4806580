"""RMSNorm and SiLU-and-mul into per-token e4m3 rows: a W8A8 linear's input, quantized where it is made.

``add_rms_norm_fp8(x, residual, weight, eps) -> (q, scale, residual)``: with ``residual`` None,
``rms_norm(x, weight, eps)`` quantized and ``x`` as the residual; else ``residual += x`` in place
and ``rms_norm(residual, weight, eps)`` quantized (``x`` is left as it is).
``silu_and_mul_fp8(gate_up) -> (q, scale)``: ``silu_and_mul(gate_up)`` quantized.

Quantized means the W8A8 route's per-token e4m3 (:func:`..backend.fp8_weights.quantize_per_token`):
``q [rows, channels]`` float8_e4m3fn and ``scale [rows, 1]`` float32 with ``q * scale`` the 16-bit
result to e4m3's rounding. One launch of the astrai-elementwise plugin where its kernel takes the
call (``ops.norm_fp8``: the bytes equal the 16-bit op then the quantize); otherwise the 16-bit op
then the quantize the W8A8 route runs (the astrai-fp8 plugin's ``quantize_rows`` where it has it,
torch's otherwise). Inputs are ``[rows, channels]`` tensors with a contiguous last dim.
"""

from __future__ import annotations

import torch

from ..op_names import FUSED_ADD_RMS_NORM, RMS_NORM, SILU_AND_MUL
from ..ops import norm_fp8 as ops_norm_fp8
from ..ops.norm_args import check_gate_up, check_norm
from .fp8_weights import quantize_activations
from .norm import kernel_takes, rms_norm, silu_and_mul
from .rotary import fall_back

__all__ = ["add_rms_norm_fp8", "silu_and_mul_fp8"]


def _two_d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or (t.stride(-1) != 1 and t.shape[-1] > 1):
        raise ValueError(f"{name} must be a [rows, channels] tensor with a contiguous last dim, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


# what the kernels make e4m3 rows from (astrai-elementwise's FP8_ROW_SOURCE_DTYPES: the W8A8
# route's 16-bit activations); a float32 call runs the two ops
ROW_SOURCE_DTYPES = (torch.float16, torch.bfloat16)


def _fused(op: str, x: torch.Tensor, *others: torch.Tensor) -> bool:
    return x.dtype in ROW_SOURCE_DTYPES and kernel_takes(op, x, *others) and ops_norm_fp8.has_fp8_rows(op, x.device)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, residual)`` (see the module docstring). Bad arguments raise ``TypeError`` /
    ``ValueError`` naming the argument."""
    check_norm(x, weight, eps, residual, fused=residual is not None)
    _two_d("x", x)
    if residual is None:
        if _fused(RMS_NORM, x, weight):
            try:
                return (*ops_norm_fp8.rms_norm_fp8_unchecked(x, weight, float(eps)), x)
            except RuntimeError:
                return (*fall_back(x.device, lambda: quantize_activations(rms_norm(x, weight, eps)), RMS_NORM), x)
        return (*quantize_activations(rms_norm(x, weight, eps)), x)
    _two_d("residual", residual)
    if _fused(FUSED_ADD_RMS_NORM, x, residual, weight):
        try:
            return (*ops_norm_fp8.fused_add_rms_norm_fp8_unchecked(x, residual, weight, float(eps)), residual)
        except RuntimeError:  # raised before the launch: residual is as it was
            return fall_back(x.device, lambda: _add_then_quantize(x, residual, weight, eps), FUSED_ADD_RMS_NORM)
    return _add_then_quantize(x, residual, weight, eps)


def _add_then_quantize(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    residual.add_(x)
    return (*quantize_activations(rms_norm(residual, weight, eps)), residual)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``silu_and_mul(gate_up)`` (see the module docstring)."""
    check_gate_up(gate_up)
    _two_d("gate_up", gate_up)
    if _fused(SILU_AND_MUL, gate_up):
        try:
            return ops_norm_fp8.silu_and_mul_fp8_unchecked(gate_up)
        except RuntimeError:
            return fall_back(gate_up.device, lambda: quantize_activations(silu_and_mul(gate_up)), SILU_AND_MUL)
    return quantize_activations(silu_and_mul(gate_up))
