"""The norm and SiLU-and-mul kernels with per-token e4m3 output: the W8A8 linear's input quantize, fused.

- ``rms_norm_fp8_unchecked(x, weight, eps) -> (q, scale)``: ``rms_norm(x, weight, eps)`` as
  e4m3 rows ``q [rows, hidden]`` and their float32 dequantization scales ``scale [rows, 1]``
  (``amax of the 16-bit row * float32(1 / 448)``, 1 for a row whose amax is not > 0);
- ``fused_add_rms_norm_fp8_unchecked(x, residual, weight, eps) -> (q, scale)``: ``residual +=
  x`` in place, then the same of ``rms_norm(residual)`` (``x`` is left as it is);
- ``silu_and_mul_fp8_unchecked(gate_up) -> (q, scale)``: the same of ``silu_and_mul(gate_up)``.

The bytes and scales equal the 16-bit op followed by the per-token quantize (torch's
``(y.float() / scale).to(float8_e4m3fn)``, or the astrai-fp8 plugin's ``quantize_rows``): one
launch where there were two, and the 16-bit row never goes to memory. The astrai-elementwise
plugin's module has them from this release on: :func:`has_fp8_rows` says whether the module
serving an op on a device does. Inputs are 2-D ``[rows, channels]`` with a contiguous last dim
(the callers check; ``ValueError`` from the plugin otherwise).

Call convention (ABI 1): ``module.rms_norm_fp8(x, residual_or_None, weight, q, scale, eps,
stream)``, ``module.silu_and_mul_fp8(gate_up, q, scale, stream)``.
"""

from __future__ import annotations

import torch

from ..abi import launch, tensor_arg
from ..op_names import FUSED_ADD_RMS_NORM, RMS_NORM, SILU_AND_MUL
from . import _plugin

__all__ = ["fused_add_rms_norm_fp8_unchecked", "has_fp8_rows", "rms_norm_fp8_unchecked", "silu_and_mul_fp8_unchecked"]

_ENTRY = {RMS_NORM: "rms_norm_fp8", FUSED_ADD_RMS_NORM: "rms_norm_fp8", SILU_AND_MUL: "silu_and_mul_fp8"}


def has_fp8_rows(op: str, device: torch.device) -> bool:
    """Whether the plugin serving ``op`` (rms_norm, fused_add_rms_norm or silu_and_mul) on
    ``device`` has the op's e4m3-output form (a plugin built before it has not)."""
    return _plugin.has_entry(op, device, _ENTRY[op])


def _outputs(rows: int, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((rows, channels), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


@_plugin.plugin_op("astrai::rms_norm_fp8")
def rms_norm_fp8_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    module = _plugin.require(RMS_NORM, x.device)
    q, scale = _outputs(x.shape[0], x.shape[1], x.device)
    launch(x.device, module.rms_norm_fp8, tensor_arg(x), None, tensor_arg(weight), tensor_arg(q),
           tensor_arg(scale.view(-1)), eps)
    return q, scale


@rms_norm_fp8_unchecked.op.register_fake
def _rms_norm_fp8_fake(x, weight, eps):
    return _outputs(x.shape[0], x.shape[1], x.device)


@_plugin.plugin_op("astrai::fused_add_rms_norm_fp8_", mutates_args=("residual",))
def fused_add_rms_norm_fp8_unchecked(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    module = _plugin.require(FUSED_ADD_RMS_NORM, x.device)
    q, scale = _outputs(x.shape[0], x.shape[1], x.device)
    launch(x.device, module.rms_norm_fp8, tensor_arg(x), tensor_arg(residual), tensor_arg(weight), tensor_arg(q),
           tensor_arg(scale.view(-1)), eps)
    return q, scale


@fused_add_rms_norm_fp8_unchecked.op.register_fake
def _fused_add_rms_norm_fp8_fake(x, residual, weight, eps):
    return _outputs(x.shape[0], x.shape[1], x.device)


@_plugin.plugin_op("astrai::silu_and_mul_fp8")
def silu_and_mul_fp8_unchecked(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    module = _plugin.require(SILU_AND_MUL, gate_up.device)
    q, scale = _outputs(gate_up.shape[0], gate_up.shape[1] // 2, gate_up.device)
    launch(gate_up.device, module.silu_and_mul_fp8, tensor_arg(gate_up), tensor_arg(q), tensor_arg(scale.view(-1)))
    return q, scale


@silu_and_mul_fp8_unchecked.op.register_fake
def _silu_and_mul_fp8_fake(gate_up):
    return _outputs(gate_up.shape[0], gate_up.shape[1] // 2, gate_up.device)
