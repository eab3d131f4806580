"""Independent references for the FP8 tests: encoding by table search, GEMM in float64."""

from __future__ import annotations

import numpy as np
import torch

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _decode_table(fmt: str) -> np.ndarray:
    """float64 value of every byte 0..255 (decoding is a plain table lookup)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8[fmt]).to(torch.float64).numpy()


def encode(values: np.ndarray, fmt: str) -> np.ndarray:
    """Bytes of round-to-nearest-even, saturating FP8 encoding of float64 ``values``.

    Nearest finite code by search over the decoded table; a tie goes to the code with an
    even last bit; magnitudes past the largest finite value saturate to it; NaN -> NaN.
    """
    table = _decode_table(fmt)
    codes = np.arange(128)  # non-negative codes
    finite = np.isfinite(table[:128])
    pos_vals, pos_codes = table[:128][finite], codes[finite]
    order = np.argsort(pos_vals, kind="stable")
    pos_vals, pos_codes = pos_vals[order], pos_codes[order]
    mag = np.abs(values)
    nan = np.isnan(values)
    mag = np.where(nan, 0.0, np.minimum(mag, pos_vals[-1]))
    hi = np.clip(np.searchsorted(pos_vals, mag, side="left"), 0, len(pos_vals) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = mag - pos_vals[lo], pos_vals[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (pos_codes[hi] % 2 == 0))
    out = np.where(pick_hi, pos_codes[hi], pos_codes[lo]).astype(np.uint8)
    out = np.where(np.signbit(values), out | 0x80, out).astype(np.uint8)
    return np.where(nan, 0x7F, out).astype(np.uint8)  # 0x7F is a NaN in both formats


def quantize_reference(x: torch.Tensor, multiplier: float, fmt: str) -> tuple[np.ndarray, float]:
    """(bytes, amax): the product is formed in float32, as the kernel does."""
    scaled = x.to(torch.float32).numpy() * np.float32(multiplier)
    amax = float(np.abs(x.to(torch.float64).numpy()).max())
    return encode(scaled.astype(np.float64), fmt), amax


def gemm_reference(a: torch.Tensor, b: torch.Tensor, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 ``scale * a @ b + bf16(bias)``."""
    out = scale * (a.to(torch.float64) @ b.to(torch.float64))
    if bias is not None:
        out = out + bias.to(torch.bfloat16).to(torch.float64)
    return out


def random_fp8(shape, fmt: str, spread: float = 4.0) -> torch.Tensor:
    """Random FP8 tensor with values over a few binades (never all zeros)."""
    return (torch.randn(shape) * spread).to(FP8[fmt])
