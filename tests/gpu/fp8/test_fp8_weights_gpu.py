"""fp8_weight_linear on the GPU: the astrai-fp8 kernel (op fp8_weight_gemm) against a float64
reference of the dequantized weights, at decode token counts and Llama-3-8B projection shapes
(split K included), both formats and 16-bit dtypes; its split workspace stays zero; it records
into a CUDA graph; and it is what the call ran (explain)."""

from __future__ import annotations

import pytest
import torch

from astrai.extension import explain, fp8_weight_linear, quantize_weight
from astrai.extension.backend import fp8_weights
from astrai.extension.ops import fp8_weights as ops_fp8_weights

pytestmark = pytest.mark.gpu

SHAPES = [(1, 6144, 4096), (1, 4096, 14336), (16, 28672, 4096), (64, 4096, 4096), (33, 1000, 512), (5, 16, 256),
          (200, 4096, 4096)]  # 200 rows: four launches of <= 64


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_kernel_is_the_dequantized_linear(m, n, k, dtype, fp8, monkeypatch):
    monkeypatch.setattr(fp8_weights, "W8A8_MIN_ROWS", 10**9)  # the weight-only kernel at every row count
    w, w_scale = quantize_weight(rand(n, k, seed=1, scale=0.02), fp8)
    x = rand(m, k, seed=2, dtype=dtype)
    x[0, 0] = 2000.0  # one large activation: the power-of-two staging keeps the rest exact
    y = fp8_weight_linear(x, w, w_scale)
    want = x.double() @ (w.double() * w_scale.double()[:, None]).t()
    mag = x.double().abs() @ (w.double().abs() * w_scale.double()[:, None]).t()
    rel = 2**-10 if dtype == torch.float16 else 2**-7
    err = (y.double() - want).abs()
    assert torch.all(err <= rel * want.abs() + 1e-4 * mag), float((err - rel * want.abs()).max())
    workspaces = list(ops_fp8_weights._WORKSPACES.values())
    assert all(not ws.any() for ws in workspaces)  # the splits left their workspace zero
    assert any(d.chosen == "cuda" for d in explain("fp8_weight_gemm"))


def test_it_records_into_a_cuda_graph():
    w, w_scale = quantize_weight(rand(4096, 4096, seed=3, scale=0.02))
    x = rand(4, 4096, seed=4, dtype=torch.bfloat16)
    eager = fp8_weight_linear(x, w, w_scale)  # workspace and plan made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_weight_linear(x, w, w_scale)
    x.copy_(rand(4, 4096, seed=5, dtype=torch.bfloat16))
    graph.replay()
    # the split-K partials add in any order: equal to a rounding of bfloat16
    torch.testing.assert_close(out.float(), fp8_weight_linear(x, w, w_scale).float(), rtol=2**-7, atol=1e-3)
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(33, 6144, 4096), (64, 28672, 4096), (256, 4096, 14336)])
def test_the_w8a8_route_is_the_product_of_the_quantized_operands(m, n, k, dtype):
    """From W8A8_MIN_ROWS rows on Hopper: per-token e4m3 activations through torch._scaled_mm,
    against the float64 product of the same quantized operands; in a CUDA graph too."""
    w, w_scale = quantize_weight(rand(n, k, seed=6, scale=0.02))
    x = rand(m, k, seed=7, dtype=dtype)
    assert fp8_weights.fp8_weight_route(x, w, w_scale) == "w8a8"
    y = fp8_weight_linear(x, w, w_scale)
    xq, x_scale = fp8_weights.quantize_per_token(x)
    want = (xq.double() * x_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()
    rel = 2**-10 if dtype == torch.float16 else 2**-7
    torch.testing.assert_close(y.double(), want, rtol=rel, atol=rel * float(want.abs().max()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_weight_linear(x, w, w_scale)
    x.copy_(rand(m, k, seed=8, dtype=dtype))
    graph.replay()
    torch.testing.assert_close(out, fp8_weight_linear(x, w, w_scale), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (64, 14336), (256, 4096), (7, 8)])
def test_the_plugins_per_token_quantize_gives_torchs_bytes(m, k, dtype):
    """One launch (op fp8_quantize_rows) against quantize_per_token's torch expression: the same
    e4m3 bytes and scales, on rows of every magnitude, a zero row and a strided view."""
    assert ops_fp8_weights.has_quantize_rows(torch.device("cuda"))
    wide = rand(m, k + 8, seed=9, dtype=dtype) * torch.logspace(-6, 4, m, device="cuda", dtype=dtype)[:, None]
    x = wide[:, :k]  # rows 16 bytes apart, not contiguous
    x[m // 2] = 0.0
    got_q, got_scale = ops_fp8_weights.fp8_quantize_rows_unchecked(x)
    want_q, want_scale = fp8_weights.quantize_per_token(x)
    assert got_q.shape == (m, k) and got_scale.shape == (m, 1)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_the_w8a8_route_quantizes_in_one_launch(monkeypatch):
    calls = []
    real = ops_fp8_weights.fp8_quantize_rows_unchecked
    monkeypatch.setattr(ops_fp8_weights, "fp8_quantize_rows_unchecked", lambda x: calls.append(x.shape) or real(x))
    w, w_scale = quantize_weight(rand(4096, 4096, seed=10, scale=0.02))
    fp8_weight_linear(rand(64, 4096, seed=11, dtype=torch.bfloat16), w, w_scale)
    assert calls == [(64, 4096)]
