"""Argument checks of the rotary API: every error names the argument, before any launch.

``check_x`` / ``check_qk`` validate the rotated tensors, ``check_freqs`` the ``(cos, sin)``
cache against them and ``check_positions`` the rows it selects. Out-of-range positions are
found on the host when ``positions`` lives there; on a GPU that check needs a device sync,
so it runs only with ``ASTRAI_DEBUG=1`` (never while compiling or capturing a graph).
"""

from __future__ import annotations

import torch

from ..environ import env_reader

__all__ = ["check_freqs", "check_positions", "check_qk", "check_x", "debug_checks"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_POSITION_DTYPES = (torch.int32, torch.int64)


def check_x(name: str, x: object, dims: tuple[int, ...] = (4,)) -> torch.Tensor:
    """``x`` is a float tensor ``[batch, seq, heads, head_dim]`` (or ``[tokens, heads, head_dim]``
    where ``dims`` allows 3) with a non-empty, even head_dim."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        shape = "[batch, seq, heads, head_dim]" + (" or [tokens, heads, head_dim]" if 3 in dims else "")
        raise ValueError(f"{name} must be {' or '.join(f'{d}-D' for d in dims)} {shape}, got shape {tuple(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.shape[-1] % 2:
        raise ValueError(f"{name} has odd head_dim {x.shape[-1]}: rotary rotates pairs of channels")
    return x


def check_qk(q: object, k: object) -> None:
    """``q [..., q_heads, D]`` and ``k [..., kv_heads, D]``: same rank, batch, sequence, head_dim,
    dtype and device."""
    check_x("q", q, dims=(3, 4))
    check_x("k", k, dims=(3, 4))
    if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"k's leading dims {tuple(k.shape[:-2])} must equal q's {tuple(q.shape[:-2])} "
                         f"(k {tuple(k.shape)}, q {tuple(q.shape)})")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's head_dim {k.shape[-1]} must equal q's {q.shape[-1]}")
    if k.dtype != q.dtype:
        raise TypeError(f"k's dtype {k.dtype} must equal q's {q.dtype}")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")


def check_freqs(freqs: object, x: torch.Tensor, seq: int, positions: object, x_name: str = "x"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``freqs = (cos, sin)``: float32 ``[max_pos, rotary_dim // 2]`` each, on ``x``'s device,
    ``rotary_dim <= head_dim``; without ``positions`` at least ``seq`` rows. Returns them."""
    if not isinstance(freqs, (tuple, list)) or len(freqs) != 2:
        raise TypeError(f"freqs must be a (cos, sin) pair of tensors, got {type(freqs).__name__}")
    cos, sin = freqs
    head_dim = x.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.dim() != 2 or 0 in t.shape:
            raise ValueError(f"{name} must be 2-D [max_pos, rotary_dim // 2] and non-empty, got shape {tuple(t.shape)}")
        if 2 * t.shape[1] > head_dim:
            raise ValueError(f"{name} has {t.shape[1]} columns: rotary_dim = {2 * t.shape[1]} exceeds "
                             f"{x_name}'s head_dim {head_dim}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")
        if positions is None and t.shape[0] < seq:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected [seq, head_dim // 2] = [{seq}, {t.shape[1]}] "
                             f"(rows for positions 0 .. seq-1; any [max_pos >= seq, rotary_dim // 2])")
    if sin.shape != cos.shape:
        raise ValueError(f"sin has shape {tuple(sin.shape)} but cos has {tuple(cos.shape)}: they must match")
    return cos, sin


def check_positions(positions: object, batch: int, seq: int, max_pos: int, device: torch.device) -> None:
    """``positions``: int32/int64 ``[seq]``, ``[batch, seq]`` or ``[1, seq]`` on ``device``, each in ``[0, max_pos)``."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor or None, got {type(positions).__name__}")
    if positions.dtype not in _POSITION_DTYPES:
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if tuple(positions.shape) not in ((seq,), (batch, seq), (1, seq)):
        raise ValueError(f"positions must have shape [seq] = [{seq}] or [batch, seq] = [{batch}, {seq}] "
                         f"(or [1, seq]), got {tuple(positions.shape)}")
    if positions.device != device:
        raise ValueError(f"positions is on {positions.device} but the rotated tensors are on {device}")
    if positions.device.type == "meta" or torch.compiler.is_compiling():
        return
    if positions.device.type == "cuda" and (not debug_checks() or torch.cuda.is_current_stream_capturing()):
        return
    low, high = positions.aminmax()
    if int(low) < 0 or int(high) >= max_pos:
        raise ValueError(f"positions must lie in [0, {max_pos}) (the rows of cos/sin), "
                         f"got values from {int(low)} to {int(high)}")


_debug_env = env_reader("ASTRAI_DEBUG")


def debug_checks() -> bool:
    """``ASTRAI_DEBUG=1``: checks that need a device sync run too."""
    return _debug_env() not in (None, "", "0")
