"""RMSNorm, residual add + RMSNorm and SiLU-and-mul: the astrai-elementwise plugin's kernels as torch custom ops.

- ``rms_norm(x, weight, eps)``: a new tensor ``weight * T(x * rsqrt(mean(x^2) + eps))`` of
  ``x [..., hidden]`` (float16/bfloat16/float32, CUDA), statistics in float32, ``weight
  [hidden]`` in ``x``'s dtype (transformers' ``LlamaRMSNorm``, rounded as it rounds);
- ``fused_add_rms_norm(x, residual, weight, eps)``: in place, one launch: ``residual += x``,
  then ``x = rms_norm(residual, weight, eps)``; returns ``(x, residual)``;
- ``silu_and_mul(gate_up)``: ``silu(gate) * up`` of ``gate_up [..., 2 * inter]`` (gate the
  first half of the last dim, up the second: one linear with stacked weights), a new
  ``[..., inter]`` tensor.

Each is a custom op ``torch.ops.astrai.*`` with a fake implementation, so it traces under
``torch.compile`` and records into CUDA graphs (no host sync, outputs from torch's caching
allocator). The public functions validate first (``TypeError`` / ``ValueError`` naming the
argument); the ``*_unchecked`` ones are for callers that already did. ``RuntimeError``
naming the plugin when it can't run here.

Call convention (ABI 1): ``module.rms_norm(x, weight, out, eps, stream)``,
``module.fused_add_rms_norm(x, residual, weight, out, eps, stream)``,
``module.silu_and_mul(gate_up, out, stream)``; tensors ``[rows, channels]`` as tuples
``(data_ptr, shape, strides_in_elements, dtype_code)``, the stream an int.
"""

from __future__ import annotations

import torch

from ..abi import launch, tensor_arg
from ..op_names import FUSED_ADD_RMS_NORM, RMS_NORM, SILU_AND_MUL
from . import _plugin
from .norm_args import check_gate_up, check_norm, rows

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_unchecked", "rms_norm", "rms_norm_unchecked", "silu_and_mul",
           "silu_and_mul_unchecked"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_kernel_input(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
    if t.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32 for the kernel, got {t.dtype}")


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dtype != x.dtype:
        raise TypeError(f"weight's dtype {weight.dtype} must equal x's {x.dtype} for the kernel")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]`` (CUDA) scaled by ``weight [hidden]``: a new tensor."""
    check_norm(x, weight, eps)
    _check_kernel_input("x", x)
    _check_weight(x, weight)
    return rms_norm_unchecked(x, weight, float(eps))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x``, then ``x = rms_norm(residual, weight, eps)``, in place, one launch."""
    check_norm(x, weight, eps, residual, fused=True)
    _check_kernel_input("x", x)
    _check_weight(x, weight)
    for name, t in (("x", x), ("residual", residual)):
        if rows(t) is None:
            raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) must be viewable as "
                             f"[rows, hidden] with a contiguous last dim: it is written in place")
    fused_add_rms_norm_unchecked(x, residual, weight, float(eps))
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :inter]) * gate_up[..., inter:]`` (CUDA): a new ``[..., inter]`` tensor."""
    check_gate_up(gate_up)
    _check_kernel_input("gate_up", gate_up)
    return silu_and_mul_unchecked(gate_up)


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, channels]``: a view, else a contiguous copy (inputs only)."""
    view = rows(t)
    return view if view is not None else t.reshape(-1, t.shape[-1]).contiguous()


@_plugin.plugin_op(f"astrai::{RMS_NORM}")
def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    module = _plugin.require(RMS_NORM, x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch(x.device, module.rms_norm, tensor_arg(_matrix(x)), tensor_arg(weight.contiguous()),
           tensor_arg(out.view(-1, x.shape[-1])), eps)
    return out


@rms_norm_unchecked.op.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@_plugin.plugin_op("astrai::fused_add_rms_norm_", mutates_args=("x", "residual"))
def fused_add_rms_norm_unchecked(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    module = _plugin.require(FUSED_ADD_RMS_NORM, x.device)
    x2, r2 = rows(x), rows(residual)
    if x2 is None or r2 is None:
        raise ValueError("fused_add_rms_norm in place needs x and residual viewable as [rows, hidden]")
    launch(x.device, module.fused_add_rms_norm, tensor_arg(x2), tensor_arg(r2), tensor_arg(weight.contiguous()),
           tensor_arg(x2), eps)


@fused_add_rms_norm_unchecked.op.register_fake
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return None


@_plugin.plugin_op(f"astrai::{SILU_AND_MUL}")
def silu_and_mul_unchecked(gate_up: torch.Tensor) -> torch.Tensor:
    module = _plugin.require(SILU_AND_MUL, gate_up.device)
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    launch(gate_up.device, module.silu_and_mul, tensor_arg(_matrix(gate_up)), tensor_arg(out.view(-1, inter)))
    return out


@silu_and_mul_unchecked.op.register_fake
def _silu_and_mul_fake(gate_up):
    return torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)
