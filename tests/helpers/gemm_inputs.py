"""Seeded operands for the FP8 GEMM tests, on any device."""

from __future__ import annotations

import math

import torch


def linear_operands(m: int, n: int, k: int, seed: int, device="cuda"):
    """``x [M, K]`` and a row-major weight ``w [N, K]`` in e4m3 (2 * N(0, 1) before the
    cast), ``bias [N]`` bf16 N(0, 1) and ``scale = 1 / sqrt(K)`` (a float32 tensor).

    The GEMM term ``scale * x @ w.t()`` has an rms of ~4, four times the bias, whatever K
    is: every output element depends mostly on the whole K sum, so a kernel that drops part
    of K or mis-scales moves it by far more than bf16 rounding."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(m, k, device=device, generator=g) * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device=device, generator=g) * 2).to(torch.float8_e4m3fn)
    bias = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
    return x, w, bias, torch.tensor(1.0 / math.sqrt(k), device=device)


def linear_reference(x: torch.Tensor, w: torch.Tensor, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 ``scale * x @ w.t() + bias`` on the operands' device."""
    out = (x.to(torch.float64) @ w.to(torch.float64).t()) * scale
    return out if bias is None else out + bias.to(torch.float64)
