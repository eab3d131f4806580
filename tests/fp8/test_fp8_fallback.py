"""The torch FP8 fallbacks (backend.fp8 on the CPU) against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from astrai.extension.backend import fp8 as backend
from astrai.extension.backend import fp8_torch
from fp8_reference import FP8, gemm_reference, quantize_reference, random_fp8

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bytes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 128), (130, 17)])
@pytest.mark.parametrize("headroom", [0.37, 3.0])  # 3.0: the largest values saturate
def test_quantize_matches_reference_bytes(fmt, dtype, shape, headroom):
    x = (torch.randn(shape) * torch.logspace(-3, 2, shape[1])).to(dtype)
    multiplier = headroom * FMAX[fmt] / float(x.float().abs().max())
    q, q_t, amax = backend.quantize(x, torch.tensor(multiplier), fmt)
    ref_bytes, ref_amax = quantize_reference(x, multiplier, fmt)
    assert q.dtype == FP8[fmt] and q.shape == shape
    np.testing.assert_array_equal(_bytes(q), ref_bytes)
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert float(amax) == ref_amax
    assert q_t.numel() == 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_saturates_and_keeps_nan(fmt):
    x = torch.tensor([[1e6, -1e6, float("inf"), float("-inf"), 3.0, -0.0, 1e-30, float("nan")]])
    q, _, amax = backend.quantize(x, torch.tensor(2.0), fmt)
    values = q.to(torch.float32)[0]
    assert values[:4].tolist() == [FMAX[fmt], -FMAX[fmt], FMAX[fmt], -FMAX[fmt]]
    assert values[4].item() == 6.0
    assert values[5].item() == 0.0 and values[6].item() == 0.0
    assert torch.isnan(values[7])
    assert torch.isnan(amax)  # NaN in the input is reported, not hidden


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_overflow_just_past_max_saturates(fmt):
    # 1.5 * max is past the largest binade: a non-saturating cast would give inf / NaN.
    x = torch.tensor([[FMAX[fmt] * 1.5, -FMAX[fmt] * 1.01, FMAX[fmt] * 0.999]])
    q, _, _ = backend.quantize(x, torch.tensor(1.0), fmt)
    ref, _ = quantize_reference(x, 1.0, fmt)
    np.testing.assert_array_equal(_bytes(q), ref)
    assert torch.isfinite(q.to(torch.float32)).all()


@pytest.mark.parametrize("multiplier", [1 / 64, 1.0, 1000.0])
def test_quantize_amax_is_in_the_input_domain(multiplier):
    x = torch.randn(33, 65, dtype=torch.bfloat16)
    _, _, amax = backend.quantize(x, torch.tensor(multiplier), "e4m3")
    assert float(amax) == float(x.float().abs().max())


def test_quantize_scale_is_a_multiplier():
    x = torch.randn(16, 16)
    scale = torch.tensor(4.0)
    q, _, _ = backend.quantize(x, scale, "e4m3")
    # dequantize with the reciprocal: q / 4 ~ x
    err = (q.to(torch.float32) / 4.0 - x).abs().max()
    assert err <= float(x.abs().max()) * 2**-4


@pytest.mark.parametrize("layout", [0, 1, 2])
def test_quantize_out_layouts(layout):
    x = torch.randn(37, 70)
    q, q_t, _ = backend.quantize(x, torch.tensor(3.0), "e5m2", layout)
    ref, _ = quantize_reference(x, 3.0, "e5m2")
    if layout in (0, 2):
        np.testing.assert_array_equal(_bytes(q), ref)
    else:
        assert q.numel() == 0
    if layout in (1, 2):
        assert q_t.shape == (70, 37) and q_t.is_contiguous()
        np.testing.assert_array_equal(_bytes(q_t), ref.T)
    else:
        assert q_t.numel() == 0


def _layouts(a: torch.Tensor, b: torch.Tensor, a_col: bool, b_col: bool):
    """Same values, other storage: a column-major a is a transposed view of a [K, M] tensor."""
    return (_col_major(a) if a_col else a), (_col_major(b) if b_col else b)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    rows, cols = t.shape
    out = torch.empty_strided((rows, cols), (1, rows), dtype=torch.uint8)
    out.copy_(t.view(torch.uint8))
    return out.view(t.dtype)


@pytest.mark.parametrize("a_col", [False, True], ids=["a_row", "a_col"])
@pytest.mark.parametrize("b_col", [False, True], ids=["b_row", "b_col"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e5m2", "e5m2")])
@pytest.mark.parametrize("mnk", [(1, 16, 32), (17, 33, 65), (128, 64, 256)])
def test_emulated_gemm_matches_float64(a_col, b_col, with_bias, fmts, mnk):
    m, n, k = mnk
    a, b = random_fp8((m, k), fmts[0]), random_fp8((k, n), fmts[1])
    a, b = _layouts(a, b, a_col, b_col)
    bias = torch.randn(n) * 10 if with_bias else None
    scale = torch.tensor(0.0123)
    out = backend.gemm(a, b, scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = gemm_reference(a, b, 0.0123, bias)
    # float32 accumulation of exact products, then one bf16 rounding (2^-9 relative)
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=2**-8, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("a_col", [False, True], ids=["a_row", "a_col"])
@pytest.mark.parametrize("b_col", [False, True], ids=["b_row", "b_col"])
@pytest.mark.parametrize("mnk", [(5, 48, 32), (19, 30, 40), (64, 17, 3)])
def test_scaled_mm_layout_and_padding_logic(a_col, b_col, mnk):
    """The cuBLASLt path's copies and zero padding (run here through torch's CPU _scaled_mm)."""
    m, n, k = mnk
    a, b = _layouts(random_fp8((m, k), "e4m3"), random_fp8((k, n), "e4m3"), a_col, b_col)
    bias = torch.randn(n)
    out = fp8_torch.scaled_mm_gemm(a, b, torch.tensor(0.5), bias.to(torch.bfloat16))
    ref = gemm_reference(a, b, 0.5, bias)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=2**-7, atol=1e-3 * float(ref.abs().max()))


def test_emulated_gemm_bias_is_read_as_bf16():
    a, b = random_fp8((4, 32), "e4m3"), random_fp8((32, 8), "e4m3")
    bias = torch.full((8,), 1.0 + 2**-12)  # rounds to 1.0 in bf16
    out = backend.gemm(a, b, torch.tensor(1e-9), bias)
    assert torch.all(out.to(torch.float32) == 1.0)


# -- argument checks ---------------------------------------------------------------------


def _scale():
    return torch.tensor(1.0)


@pytest.mark.parametrize(("args", "error", "match"), [
    ((torch.randn(4, 4).double(), _scale()), TypeError, "x must be float32"),
    ((torch.randn(4, 4).to(torch.int32), _scale()), TypeError, "x must be"),
    ((torch.randn(4), _scale()), ValueError, "x must be 2-D"),
    ((torch.randn(0, 4), _scale()), ValueError, "zero-size"),
    ((torch.randn(4, 4), 2.0), TypeError, "scale must be a float32 tensor"),
    ((torch.randn(4, 4), torch.tensor(2.0, dtype=torch.float64)), TypeError, "scale must be a float32"),
    ((torch.randn(4, 4), torch.ones(2)), TypeError, "one element"),
    ((torch.randn(4, 4), _scale(), "e3m4"), ValueError, "fmt must be"),
    ((torch.randn(4, 4), _scale(), "e4m3", 3), ValueError, "out_layout"),
])
def test_quantize_rejects_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        backend.quantize(*args)


def test_gemm_rejects_bad_arguments():
    a, b = random_fp8((8, 32), "e4m3"), random_fp8((32, 16), "e4m3")
    s = _scale()
    with pytest.raises(TypeError, match="a must be float8"):
        backend.gemm(a.to(torch.bfloat16), b, s)
    with pytest.raises(TypeError, match="b must be float8"):
        backend.gemm(a, b.to(torch.float32), s)
    with pytest.raises(ValueError, match="inner dimensions"):
        backend.gemm(a, random_fp8((31, 16), "e4m3"), s)
    with pytest.raises(ValueError, match="b must be 2-D"):
        backend.gemm(a, random_fp8((32,), "e4m3"), s)
    with pytest.raises(ValueError, match="a has a zero-size"):
        backend.gemm(random_fp8((0, 32), "e4m3"), b, s)
    with pytest.raises(ValueError, match="zero-size"):
        backend.gemm(random_fp8((8, 0), "e4m3"), random_fp8((0, 16), "e4m3"), s)
    with pytest.raises(TypeError, match="scale must be"):
        backend.gemm(a, b, 1.0)
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        backend.gemm(a, b, s, torch.randn(8))
    with pytest.raises(TypeError, match="bias must be bfloat16"):
        backend.gemm(a, b, s, torch.randn(16).double())
    with pytest.raises(TypeError, match="a must be a tensor"):
        backend.gemm(np.zeros((8, 32)), b, s)


@pytest.mark.parametrize("shape", [(1, 32), (32, 1), (7, 9)])
def test_k_major_gives_dense_strides(shape):
    a = random_fp8(shape, "e4m3")
    for view in (a, _col_major(a)):
        a2, b2 = fp8_torch.k_major(view, view.t())
        assert a2.stride() == (shape[1], 1) and b2.t().stride() == (shape[1], 1)
        assert torch.equal(a2.view(torch.uint8), a.view(torch.uint8))
        assert torch.equal(b2.view(torch.uint8), a.t().view(torch.uint8))
