"""Torch implementations of the FP8 primitives: the fallbacks behind ``backend.fp8``.

Both functions compute the same function as the plugin kernels (``ops.fp8``):

* :func:`quantize` — ``q = saturate(float32(x) * multiplier)`` rounded to nearest even,
  ``amax = max|x|`` in the *input* domain (before the multiplier is applied).
  Saturation is explicit (clamp to the format's largest finite value), so ``±inf`` and
  overflowing values become ``±max`` in both formats; NaN stays NaN.
* :func:`emulated_gemm` — ``bf16(scale * (float32(op(a)) @ float32(op(b))) + bias)``.
  Products of two FP8 values are exact in float32, so the only difference from the
  tensor-core kernel is the order of the float32 accumulation.
* :func:`scaled_mm_gemm` — the same contract through cuBLASLt (``torch._scaled_mm``), with
  the layout and alignment it needs arranged here (copies of one byte per element).

No policy lives here; ``backend.fp8`` decides which implementation runs.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_FORMATS = {dtype: name for name, dtype in FP8_DTYPES.items()}
FP8_MAX = {name: float(torch.finfo(dtype).max) for name, dtype in FP8_DTYPES.items()}
QUANTIZE_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# cuBLASLt FP8 GEMMs need every dimension it reads contiguously a multiple of 16 bytes.
_SCALED_MM_ALIGN = 16


def quantize(x: torch.Tensor, multiplier: torch.Tensor, fmt: str = "e4m3",
             out_layout: int = 0, amax_out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating FP8 cast of ``x * multiplier``; returns ``(q, q_t, amax)``.

    ``out_layout`` 0: ``q`` only, 1: ``q_t`` (``[K, M]`` contiguous) only, 2: both; the
    output not asked for is an empty tensor (the ``fp8_quantize`` op contract). ``amax``
    is written into ``amax_out`` when given (a 0-d float32 tensor).
    Arguments are assumed validated (``backend.fp8.check_quantize_args``).
    """
    dtype = FP8_DTYPES[fmt]
    limit = FP8_MAX[fmt]
    if x.requires_grad and torch.is_grad_enabled():
        x = x.detach()
    # max|x| in one read (exact in any dtype: it is one of the elements); NaN propagates
    if amax_out is None:
        amax = torch.linalg.vector_norm(x, float("inf")).to(torch.float32)
    else:
        amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32, out=amax_out)
    # a 1-element *1-D* multiplier takes part in type promotion, so a bf16/fp16 x is
    # multiplied in float32 inside one kernel (a 0-d one would compute in x's dtype)
    scaled = x * multiplier.to(device=x.device, dtype=torch.float32).reshape(1)
    q = scaled.clamp_(-limit, limit).to(dtype)
    empty = torch.empty(0, dtype=dtype, device=x.device)
    q_rows = q if out_layout in (0, 2) else empty
    q_cols = q.t().contiguous() if out_layout in (1, 2) else empty
    return q_rows, q_cols, amax


def emulated_gemm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``scale * (a @ b) + bias`` with FP8 operands dequantized to float32; any strides."""
    acc = a.to(torch.float32) @ b.to(torch.float32)
    acc = acc * scale.to(device=acc.device, dtype=torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad an FP8 matrix to ``[rows, cols]`` (the byte 0 is +0.0 in both formats)."""
    if t.shape == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=torch.uint8, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return out.view(t.dtype)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with strides exactly ``(cols, 1)``: also for size-1 dimensions, whose strides
    ``is_contiguous`` ignores but a BLAS leading dimension does not."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) == cols:
        return t
    out = torch.empty((rows, cols), dtype=torch.uint8, device=t.device)
    out.copy_(t.view(torch.uint8))
    return out.view(t.dtype)


def k_major(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [M, K]`` row-major and ``b [K, N]`` column-major, copying only what isn't."""
    return _dense_rows(a), _dense_rows(b.t()).t()


_ONES: dict[torch.device, torch.Tensor] = {}


def capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on ``device``'s current stream: kernels
    are recorded then, not run, so nothing made there may outlive the capture."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _one(device: torch.device) -> torch.Tensor:
    """A float32 1 on ``device`` (the unit ``scale_b``), made once per device rather than
    once per call (a fill kernel each time); made fresh while torch.compile traces or a
    CUDA graph captures (its fill would run only on replay)."""
    if torch.compiler.is_compiling() or capturing(device):
        return torch.ones((), dtype=torch.float32, device=device)
    one = _ONES.get(device)
    if one is None:
        one = _ONES.setdefault(device, torch.ones((), dtype=torch.float32, device=device))
    return one


def scaled_mm_runner(k: int, otherwise):
    """``run(a, b, scale_a, scale_b, bias) -> bf16(scale_a * scale_b * (a @ b) + bias)``
    through cuBLASLt for operands already in its form (``a`` row-major ``[M, k]``, ``b``
    column-major ``[k, N]``, dense; the caller checked that K and N are multiples of 16),
    ``otherwise(...)`` for any other layout: one Python call per GEMM. cuBLASLt takes
    scale pointers only 16-byte aligned (``CUBLAS_STATUS_NOT_SUPPORTED`` otherwise): an
    unaligned pair goes as its product."""
    a_strides, b_strides = (k, 1), (1, k)
    bf16 = torch.bfloat16

    def run(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
        if a.stride() != a_strides or b.stride() != b_strides:
            return otherwise(a, b, scale_a, scale_b, bias)
        if bias is not None and bias.dtype != bf16:
            bias = bias.to(bf16)
        if scale_a.data_ptr() % 16 or scale_b.data_ptr() % 16:
            scale_a, scale_b = scale_a * scale_b, _one(a.device)
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=bf16)

    return run


def scaled_mm_gemm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``scale * (a @ b) + bias`` through ``torch._scaled_mm`` (CUDA sm_89+).

    cuBLASLt wants ``a`` row-major and ``b`` column-major with K and N multiples of 16:
    other layouts are copied into that form, K is zero-padded (exact: the padded
    products are zero) and N is padded and sliced off the result.
    """
    m, k = a.shape
    n = b.shape[1]
    k_pad, n_pad = _round_up(k, _SCALED_MM_ALIGN), _round_up(n, _SCALED_MM_ALIGN)
    a2, b2 = k_major(a, b)
    if k_pad != k:
        a2 = _pad_to(a2, m, k_pad)
    if k_pad != k or n_pad != n:
        b2 = _pad_to(b2.t(), n_pad, k_pad).t()
    one = _one(a.device)
    scale_a = scale.to(device=a.device, dtype=torch.float32)
    if scale_a.dim() != 0:
        scale_a = scale_a.reshape(())
    bias2 = None
    if bias is not None:
        bias2 = bias.to(out_dtype)
        if n_pad != n:
            bias2 = torch.cat([bias2, bias2.new_zeros(n_pad - n)])
    out = torch._scaled_mm(a2, b2, scale_a=scale_a, scale_b=one, bias=bias2, out_dtype=out_dtype)
    return out[:, :n] if n_pad != n else out


def scale_update(hist: torch.Tensor, pending: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                 factor: float, most_recent: bool) -> None:
    """Delayed scaling's end of step, in place, for histories stacked along the leading
    dimensions (``hist [..., L]``, newest first) and the step's amaxes (``pending``, shaped
    like ``scale``). The history gains the step as its newest slot and drops its oldest;
    ``amax`` is the new history's max (NaN if any slot is NaN) or, ``most_recent``, the
    step's own; ``scale`` becomes ``amax * factor`` unless the amax is zero or not finite
    (then it keeps its value), ``scale_inv`` its reciprocal; ``pending`` is zeroed. Every
    op is elementwise or a max, so stacking more rows changes no value."""
    full = torch.cat((pending.unsqueeze(-1), hist[..., :-1]), -1)
    amax = pending if most_recent else full.amax(-1)
    usable = amax.nan_to_num(0.0, 0.0)  # zero where amax is zero, inf or NaN (never negative)
    torch.where(usable > 0, usable * factor, scale, out=scale)
    torch.reciprocal(scale, out=scale_inv)
    hist.copy_(full)
    pending.zero_()
