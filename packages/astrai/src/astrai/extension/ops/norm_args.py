"""Argument checks of the norm ops: every error names the argument, before any launch.

``check_norm`` validates an RMSNorm call (``x [..., hidden]``, ``weight [hidden]``, ``eps``
and, for the fused residual add, ``residual`` like ``x``); ``check_gate_up`` the input of
SiLU-and-mul. ``rows`` views a tensor as the ``[rows, channels]`` matrix the kernels take.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_gate_up", "check_norm", "rows"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_input(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"{name} must have a last dim (the channels), got a 0-D tensor")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    return t


def check_norm(x: object, weight: object, eps: object, residual: object = None, *, fused: bool = False) -> None:
    """``x [..., hidden]`` float, ``weight [hidden]`` on its device, ``eps`` a finite number
    ``>= 0``; with ``fused``, ``residual`` of ``x``'s shape, dtype and device."""
    _check_input("x", x)
    if x.shape[-1] == 0:
        raise ValueError(f"x has no channels: shape {tuple(x.shape)}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape [hidden] = [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    if weight.dtype not in _DTYPES:
        raise TypeError(f"weight must be float16, bfloat16, float32 or float64, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if fused:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}: they must match")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual's dtype {residual.dtype} must equal x's {x.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")


def check_gate_up(gate_up: object) -> None:
    """``gate_up [..., 2 * intermediate]`` float: gate in the first half of the last dim, up in the second."""
    _check_input("gate_up", gate_up)
    if gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must hold gate and up (2 * intermediate, even and positive), "
                         f"got shape {tuple(gate_up.shape)}")


def rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, channels]`` sharing its memory (the leading dims folded, the last
    dim contiguous), or None where its strides do not allow such a view."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims that do not fold into one stride
        return None
