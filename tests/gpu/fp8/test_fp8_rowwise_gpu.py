"""The plugin's row-wise scaled FP8 GEMM (``gemm_rowwise``, the W8A8 route's GEMM up to 64 rows) on
an sm_90 GPU: against a float64 product of the dequantized operands at decode token counts and
Llama-3-8B's decoder shapes (K split over clusters of 2, 3 and 4 CTAs, and not split), ragged N
and K, both formats of the weights; outputs poisoned first; deterministic; it records into a CUDA
graph with no workspace; the W8A8 linear runs it (and equals torch._scaled_mm's product)."""

from __future__ import annotations

import pytest
import torch

from astrai.extension.abi import launch, tensor_arg
from astrai.extension.backend import fp8_weights
from astrai.extension.ops import _plugin
from astrai.extension.ops import fp8_weights as ops_fp8_weights
from astrai.extension.op_names import FP8_WEIGHT_GEMM

pytestmark = pytest.mark.gpu

# (M, N, K): split 4 (o, down), 2 (qkv), 3 (5 k-blocks), 2 of one k-block each; not split (gate_up,
# 224 tiles); ragged N with a K tail; square tiles past 64 rows
SHAPES = [(64, 4096, 4096), (1, 4096, 14336), (40, 6144, 4096), (17, 4096, 640), (5, 4096, 256),
          (64, 28672, 4096), (33, 1000, 1008), (16, 8192, 8192), (128, 1000, 512)]


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the row-wise GEMM is sm_90a code")


def _module():
    _sm90()
    if not ops_fp8_weights.has_rowwise_gemm(torch.device("cuda")):
        pytest.fail("the installed astrai-fp8 has no gemm_rowwise")
    return _plugin.require(FP8_WEIGHT_GEMM, torch.device("cuda"))


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda") * scale


def operands(m, n, k, fmt=torch.float8_e4m3fn, seed=0):
    xq, x_scale = fp8_weights.quantize_per_token(rand(m, k, seed=seed).to(torch.bfloat16))
    w, w_scale = fp8_weights.quantize_weight(rand(n, k, seed=seed + 1, scale=0.02), fmt)
    return xq, x_scale, w, w_scale


def reference(xq, x_scale, w, w_scale):
    return (xq.double() * x_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()


def check(y, want, xq, x_scale, w, w_scale):
    mag = (xq.double().abs() * x_scale.double()) @ (w.double().abs() * w_scale.double()[:, None]).t()
    err = (y.double() - want).abs()
    # bfloat16's rounding of the output, plus the sums over K: the tensor cores' own accumulation
    # within each 128 of K (about 14 bits), promoted into float32 between them
    assert torch.all(err <= 2**-8 * want.abs() + 2**-12 * mag), float((err - 2**-8 * want.abs()).max())
    assert float((y.double() - want).norm() / want.norm()) < 4e-3


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_product_of_the_scaled_operands(m, n, k, fmt):
    _module()
    xq, x_scale, w, w_scale = operands(m, n, k, fmt)
    y = ops_fp8_weights.fp8_rowwise_gemm_unchecked(xq, x_scale, w, w_scale)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    check(y, reference(xq, x_scale, w, w_scale), xq, x_scale, w, w_scale)


@pytest.mark.parametrize(("m", "n", "k"), [(64, 4096, 4096), (3, 4096, 14336)])
def test_it_writes_every_element_and_is_deterministic(m, n, k):
    module = _module()
    xq, x_scale, w, w_scale = operands(m, n, k, seed=7)
    outs = []
    for poison in (float("nan"), 1e30, float("nan")):
        out = torch.full((m, n), poison, dtype=torch.bfloat16, device="cuda")
        launch(xq.device, module.gemm_rowwise, tensor_arg(xq), tensor_arg(w), tensor_arg(x_scale.view(-1)),
               tensor_arg(w_scale), tensor_arg(out))
        outs.append(out)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # partials add in rank order


def test_the_swap_ab_split_plans_are_the_ones_tested():
    module = _module()
    props = torch.cuda.get_device_properties(0)
    d = module.sm90.DeviceLimits(9, 0, props.multi_processor_count, 232448)
    splits = {(m, n, k): module.sm90.plan(module.sm90.ProblemShape(m, n, k), d, "promote").split
              for m, n, k in SHAPES}
    assert {s for s in splits.values()} >= {1, 2, 4}, splits


def test_it_records_into_a_cuda_graph():
    _module()
    xq, x_scale, w, w_scale = operands(64, 4096, 4096, seed=3)
    eager = ops_fp8_weights.fp8_rowwise_gemm_unchecked(xq, x_scale, w, w_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops_fp8_weights.fp8_rowwise_gemm_unchecked(xq, x_scale, w, w_scale)
    fresh = operands(64, 4096, 4096, seed=9)
    for mine, theirs in zip((xq, x_scale, w, w_scale), fresh):
        mine.copy_(theirs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops_fp8_weights.fp8_rowwise_gemm_unchecked(xq, x_scale, w, w_scale))
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("m", [1, 33, 64, 65])
def test_the_w8a8_linear_runs_it_up_to_64_rows(m):
    _module()
    xq, x_scale, w, w_scale = operands(m, 6144, 4096, seed=m)
    bias = rand(6144, seed=11).to(torch.bfloat16)
    got = fp8_weights.fp8_input_linear(xq, x_scale, w, w_scale, bias, torch.bfloat16)
    assert fp8_weights._plugin_multiplies(xq, x_scale, w, w_scale, torch.bfloat16) == (m <= 64)
    cublas = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)
    torch.testing.assert_close(got, cublas + bias, rtol=2**-7, atol=2**-7 * float(cublas.abs().max()))
