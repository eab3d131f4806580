"""The torch path of rotary embedding: both layouts, positions, partial rotary; autograd-capable.

For pair ``(a, b)`` of channels and the angle of its row (``c = cos[p, i]``, ``s = sin[p, i]``)::

    a' = a * c - b * s
    b' = a * s + b * c

Interleaved (GPT-J / Meta): pair ``i`` is channels ``(2i, 2i + 1)``. NeoX (``interleaved=False``,
transformers' ``rotate_half``): channels ``(i, i + rotary_dim / 2)``. Channels past
``rotary_dim = 2 * cos.shape[-1]`` pass through. ``inverse=True`` rotates by ``-angle`` (the
backward of the rotation). Computed in float32 (float64 for float64 ``x``), rounded once.
"""

from __future__ import annotations

import torch

__all__ = ["rotary_torch"]


def angles(table: torch.Tensor, positions: torch.Tensor | None, seq: int) -> torch.Tensor:
    """The rows of ``table`` for each token, shaped to broadcast over ``[B, L, H, half]``."""
    rows = table[:seq] if positions is None else table[positions.long()]  # [L, half] or [B, L, half]
    return rows[..., None, :]


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                 interleaved: bool = True, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` by rows of ``cos``/``sin`` ``[max_pos, rotary_dim // 2]``."""
    compute = torch.promote_types(x.dtype, torch.float32)
    half = cos.shape[-1]
    c = angles(cos, positions, x.shape[1]).to(compute)
    s = angles(sin, positions, x.shape[1]).to(compute)
    if inverse:
        s = -s
    rot = x[..., :2 * half].to(compute)
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    out = out.to(x.dtype)
    if 2 * half < x.shape[-1]:
        out = torch.cat((out, x[..., 2 * half:]), dim=-1)
    return out
