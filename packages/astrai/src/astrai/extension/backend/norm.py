"""RMSNorm, residual add + RMSNorm and SiLU-and-mul: the plugin kernel where it can run, the torch path otherwise.

``rms_norm(x, weight, eps)`` is transformers' ``LlamaRMSNorm``: ``x`` cast to float32,
scaled by ``rsqrt(mean(x^2) + eps)``, cast back, then multiplied by ``weight`` in the
input dtype. ``fused_add_rms_norm(x, residual, weight, eps)`` is a decoder layer's
``residual = residual + x; x = rms_norm(residual)`` in place (both tensors are overwritten;
returns ``(x, residual)``); ``silu_and_mul(gate_up)`` is ``F.silu(gate) * up`` of the two
halves of a fused gate/up projection's last dim.

Per call the astrai-elementwise plugin's kernel (ops ``rms_norm``, ``fused_add_rms_norm``,
``silu_and_mul``) runs for CUDA tensors in a dtype its manifest lists, with the weight in
``x``'s dtype, rows the kernel can address (a contiguous last dim; in place: leading dims
that fold into one stride) and no gradient wanted (the kernels have no backward). Otherwise
the torch path runs (``norm_torch``: the same math, op for op; the CPU's results are the
engine's own). The choice goes through the runtime's resolver once per (op, device,
dtype, hidden size) (``explain("rms_norm")`` shows why); a plugin found unusable at its
first launch falls back to the torch path, as rotary does.
"""

from __future__ import annotations

import torch

from ..op_names import FUSED_ADD_RMS_NORM, RMS_NORM, SILU_AND_MUL
from ..ops import norm as ops_norm
from ..ops.norm_args import check_gate_up, check_norm, rows
from .norm_torch import fused_add_rms_norm_torch, rms_norm_torch, silu_and_mul_torch
from .rotary import choose, fall_back

__all__ = ["fused_add_rms_norm", "kernel_takes", "rms_norm", "silu_and_mul"]


def kernel_takes(op: str, x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Can ``op``'s kernel take this call: the plugin chosen for ``x``'s device and dtype (the
    resolver's decision, traced), one dtype for every tensor, no gradient wanted."""
    if choose(x, False, op) != "cuda" or any(t.dtype != x.dtype for t in others):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]`` scaled by ``weight [hidden]``: a new tensor of ``x``'s
    shape (and dtype, for a weight of ``x``'s dtype). Bad arguments raise ``TypeError`` /
    ``ValueError`` naming the argument."""
    check_norm(x, weight, eps)
    if kernel_takes(RMS_NORM, x, weight):
        try:
            return ops_norm.rms_norm_unchecked(x, weight, float(eps))
        except RuntimeError:
            return fall_back(x.device, lambda: rms_norm_torch(x, weight, eps), RMS_NORM)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x``, then ``x = rms_norm(residual, weight, eps)``, both in place (one
    launch on CUDA); returns ``(x, residual)``. ``residual`` has ``x``'s shape, dtype and
    device. Bad arguments raise ``TypeError`` / ``ValueError`` naming the argument."""
    check_norm(x, weight, eps, residual, fused=True)
    op = FUSED_ADD_RMS_NORM
    if kernel_takes(op, x, residual, weight) and rows(x) is not None and rows(residual) is not None:
        try:
            ops_norm.fused_add_rms_norm_unchecked(x, residual, weight, float(eps))
            return x, residual
        except RuntimeError:
            return fall_back(x.device, lambda: fused_add_rms_norm_torch(x, residual, weight, eps), op)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, dim=-1)``: a new ``[..., inter]``
    tensor. Bad arguments raise ``TypeError`` / ``ValueError`` naming the argument."""
    check_gate_up(gate_up)
    if kernel_takes(SILU_AND_MUL, gate_up):
        try:
            return ops_norm.silu_and_mul_unchecked(gate_up)
        except RuntimeError:
            return fall_back(gate_up.device, lambda: silu_and_mul_torch(gate_up), SILU_AND_MUL)
    return silu_and_mul_torch(gate_up)
