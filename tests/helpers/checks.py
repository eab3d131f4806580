"""Element-wise checks of kernel results against float64 references, on any device.

Each bound is derived from the roundings the kernel is allowed to make, so a result that
is off by more than rounding fails. ``tests/core/test_gpu_checks.py`` feeds them deliberately
broken results on the CPU (what each check catches); the GPU tests call them on the
kernels' outputs.
"""

from __future__ import annotations

import torch

# Unit roundoff (half an ulp at 1) of the 16-bit storage formats: rounding to nearest
# changes a value x by at most UNIT_ROUNDOFF * |x|.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}

# fp32 work inside a kernel (accumulation over long K or many KV tiles, softmax rescales,
# split merges, exp2 approximations): ~1e-5 of the values' scale expected; 2^-10 leaves
# two orders of magnitude of room and is still far below every planted bug's error.
FP32_WORK = 2.0**-10

# An FP8 GEMM's accumulation: fp32 (mma.sync), or Hopper's wgmma, which adds with ~14-bit
# alignment inside each 128-wide block of K and is promoted to fp32 between blocks:
# ~1e-4 of the result's rms at K = 28672 even under a pessimistic model of that alignment.
GEMM_ACCUMULATION = 2.0**-9


def _worst(excess: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))


def gemm_mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why a bf16 GEMM result ``out`` does not match the float64 ``ref`` (None when it does).

    Every element: ``|out - ref| <= 2^-8 |ref| + 2^-9 rms(ref)``. The first term is the
    rounding of the result to bf16 (a bound, not an estimate); the second the accumulation
    (``GEMM_ACCUMULATION``)."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    got = out.to(torch.float64)
    ref = ref.to(got.device, torch.float64)
    if not torch.isfinite(got).all():
        return f"{int((~torch.isfinite(got)).sum())} non-finite elements (unwritten or NaN)"
    rms = ref.square().mean().sqrt()
    err = (got - ref).abs()
    excess = err - (UNIT_ROUNDOFF[torch.bfloat16] * ref.abs() + GEMM_ACCUMULATION * rms)
    bad = int((excess > 0).sum())
    if bad:
        at = _worst(excess)
        return (f"{bad} of {got.numel()} elements off by more than bf16 rounding; worst at {at}: "
                f"got {got[at].item():.6g}, expected {ref[at].item():.6g} (rms of the result {rms.item():.3g})")
    return None


def assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, what: str = "gemm") -> None:
    reason = gemm_mismatch(out, ref)
    assert reason is None, f"{what}: {reason}"


def attention_mismatch(got: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor,
                       dtype: torch.dtype) -> str | None:
    """Why an attention output ``got [..., D]`` (stored in ``dtype``) does not match the
    float64 reference ``ref`` (None when it does); ``magnitude`` is ``sum_j p_j |v_j|`` per
    element (``reference.attention_ref64``).

    Every element: ``|got - ref| <= u (|ref| + magnitude) + 2^-10 rms_row(magnitude)``,
    u the unit roundoff of ``dtype``. ``u |ref|`` is the rounding of the output;
    ``u * magnitude`` bounds rounding every probability to ``dtype`` before the P @ V
    product (each term ``p_j v_j`` off by at most ``u p_j |v_j|``); the last term is the
    fp32 work, per row (one query token and head). A row that keeps no key must be 0."""
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    got = got.to(torch.float64)
    ref, magnitude = ref.to(got.device, torch.float64), magnitude.to(got.device, torch.float64)
    if not torch.isfinite(got).all():
        return f"{int((~torch.isfinite(got)).sum())} non-finite elements (unwritten or NaN)"
    u = UNIT_ROUNDOFF[dtype]
    row_scale = magnitude.square().mean(dim=-1, keepdim=True).sqrt()
    allowed = u * (ref.abs() + magnitude) + FP32_WORK * row_scale
    excess = (got - ref).abs() - allowed
    bad = excess > 0
    if bad.any():
        at = _worst(excess)
        rows = int(bad.any(dim=-1).sum())
        return (f"{int(bad.sum())} elements in {rows} rows off by more than {dtype} rounding; worst at "
                f"{at}: got {got[at].item():.6g}, expected {ref[at].item():.6g} "
                f"(allowed +-{allowed[at].item():.3g})")
    return None


def assert_attention_close(got: torch.Tensor, ref, dtype: torch.dtype, what: str = "attention") -> None:
    """``ref``: the ``(out, magnitude)`` pair ``reference.attention_ref64`` returns."""
    reason = attention_mismatch(got, ref[0], ref[1], dtype)
    assert reason is None, f"{what}: {reason}"
