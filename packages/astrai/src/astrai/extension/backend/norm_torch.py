"""The torch path of the norm ops: the engine's own math, op for op (transformers' LlamaRMSNorm).

``rms_norm_torch`` casts to float32, takes the mean of squares, adds ``eps``, multiplies by
its ``rsqrt``, casts back, then multiplies by the weight in the input dtype (so a bfloat16
model rounds twice, as transformers does). ``fused_add_rms_norm_torch`` adds in the input
dtype, in place, then normalizes into ``x``; ``silu_and_mul_torch`` is ``F.silu(gate) * up``
over the two halves of the last dim. Autograd-capable (the in-place ops on non-leaf tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_add_rms_norm_torch", "rms_norm_torch", "silu_and_mul_torch"]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * T(x * rsqrt(mean(x^2) + eps))`` with the statistics in float32 (float64 too, as transformers)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x``, then ``x = rms_norm(residual)``, both in place; returns ``(x, residual)``."""
    residual.add_(x)
    x.copy_(rms_norm_torch(residual, weight, eps))
    return x, residual


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, dim=-1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
