"""FP8 weights with per-channel scales (astrai.extension.fp8_weight_linear, quantize_weight) on
the CPU: the quantization's bound, the linear against a float64 reference of the dequantized
weights, bad input named, and the plugin's kernel chosen exactly where it can take the call
(a fake plugin, the kernel computed by the torch path)."""

from __future__ import annotations

import pytest
import torch
from fakes import H200, L20, FakeEntryPoint, entry_points, fake_module, manifest

from astrai.extension import explain, fp8_weight_linear, quantize_weight
from astrai.extension.backend import fp8_weights, rotary
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize(("fp8", "rel"), [(E4M3, 2**-4), (E5M2, 2**-3)])
def test_quantize_weight_scales_each_row_to_the_formats_largest_value(fp8, rel):
    weight = rand(48, 256, scale=0.05)
    weight[3] = 0.0  # a zero row: scale 1, zeros
    weight[7] *= 1000.0  # rows of very different ranges keep their own scale
    w, w_scale = quantize_weight(weight, fp8)
    assert w.dtype == fp8 and w.shape == weight.shape and w_scale.dtype == torch.float32 and w_scale.shape == (48,)
    assert w_scale[3] == 1.0 and torch.all(w[3].float() == 0)
    back = w.float() * w_scale[:, None]
    amax = weight.abs().amax(dim=1)
    torch.testing.assert_close(w.float().abs().amax(dim=1)[amax > 0], torch.full((47,), torch.finfo(fp8).max))
    # round to nearest: half a unit in the last place (2^-4 of the value for e4m3), or of the subnormals
    tiny = w_scale[:, None] * torch.finfo(fp8).tiny
    assert torch.all((back - weight).abs() <= rel * weight.abs() + tiny)


def test_quantize_weight_refuses_what_it_cannot_scale():
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        quantize_weight([1.0])
    with pytest.raises(ValueError, match=r"weight must be a 2-D \[N, K\] floating tensor"):
        quantize_weight(rand(4))
    with pytest.raises(ValueError, match="dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        quantize_weight(rand(4, 4), torch.bfloat16)
    bad = rand(4, 4)
    bad[1, 2] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_weight(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 512), (3, 5, 256), (70, 768)])
def test_the_linear_is_the_dequantized_weights_linear(dtype, shape):
    w, w_scale = quantize_weight(rand(96, shape[-1], seed=1, scale=0.02))
    x = rand(*shape, seed=2).to(dtype)
    bias = rand(96, seed=3)
    y = fp8_weight_linear(x, w, w_scale, bias.to(dtype))
    want = x.double() @ (w.double() * w_scale.double()[:, None]).t()
    assert y.dtype == dtype and y.shape == (*shape[:-1], 96)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(y.double(), want + bias.to(dtype).double(), rtol=tol, atol=tol * want.abs().max())


def test_bad_input_names_the_argument():
    w, w_scale = quantize_weight(rand(8, 256))
    x = rand(2, 256, dtype=torch.bfloat16)
    cases = [
        (dict(x="x"), TypeError, "x must be a torch.Tensor"),
        (dict(x=x.int()), TypeError, "x must be a bfloat16, float16 or float32 tensor"),
        (dict(w=w.float()), TypeError, "w must be a float8_e4m3fn or float8_e5m2"),
        (dict(x=rand(2, 128, dtype=torch.bfloat16)), ValueError, r"w has shape \(8, 256\): expected \[N, 128\]"),
        (dict(w_scale=w_scale[:4]), ValueError, r"w_scale must be float32 \[8\]"),
        (dict(w_scale=w_scale.double()), ValueError, r"w_scale must be float32 \[8\]"),
        (dict(bias=torch.zeros(9)), ValueError, r"bias must be None or a \[8\] tensor"),
    ]
    for override, error, match in cases:
        args = dict(x=x, w=w, w_scale=w_scale, bias=None) | override
        with pytest.raises(error, match=match):
            fp8_weight_linear(**args)


# -- dispatch ------------------------------------------------------------------------------

OPS = {"fp8_weight_gemm": {"module": "fake_fp8_module", "abi": 1, "dtypes": ["bfloat16", "float16"], "min_sm": 89}}


def fp8_runtime():
    registry = Registry(entry_points(FakeEntryPoint("fp8", manifest(name="astrai-fp8", ops=OPS))),
                        importer=lambda name: fake_module(name))
    return Runtime(registry)


def test_the_kernel_runs_where_it_can_take_the_call(monkeypatch):
    calls = []

    def kernel(x2, w, w_scale):
        calls.append(tuple(x2.shape))
        return fp8_weights._torch_path(x2, w, w_scale)

    monkeypatch.setattr(rotary, "probe_device", lambda device: L20)  # pretend tensors live on an L20 (no W8A8)
    monkeypatch.setattr(fp8_weights, "probe_device", lambda device: L20)
    monkeypatch.setattr(fp8_weights.ops_fp8_weights, "fp8_weight_gemm_unchecked", kernel)
    w, w_scale = quantize_weight(rand(32, 512))
    with use_runtime(fp8_runtime()):
        fp8_weight_linear(rand(1, 512, dtype=torch.bfloat16), w, w_scale)
        fp8_weight_linear(rand(4, 16, 512, dtype=torch.float16), w, w_scale)  # 64 rows: still the kernel
        assert calls == [(1, 512), (64, 512)]
        x = rand(2, 100, 512, dtype=torch.bfloat16)  # 200 rows: launches of 64 rows, stitched in order
        torch.testing.assert_close(fp8_weight_linear(x, w, w_scale), fp8_weights._torch_path(x.view(200, 512), w,
                                   w_scale).view(2, 100, 32), rtol=0, atol=0)
        assert calls[2:] == [(64, 512), (64, 512), (64, 512), (8, 512)]
        del calls[2:]
        fp8_weight_linear(rand(257, 512, dtype=torch.bfloat16), w, w_scale)  # more rows than the kernel serves
        fp8_weight_linear(rand(2, 512), w, w_scale)  # float32 x
        w2, s2 = quantize_weight(rand(32, 320))
        fp8_weight_linear(rand(2, 320, dtype=torch.bfloat16), w2, s2)  # K not a multiple of 256
        fp8_weight_linear(rand(2, 512, dtype=torch.bfloat16).requires_grad_(), w, w_scale)  # a gradient wanted
        assert calls == [(1, 512), (64, 512)]
        (decision, *_) = [d for d in explain("fp8_weight_gemm") if d.chosen == "cuda"]
    assert decision.key.dtype in (torch.bfloat16, torch.float16)


def test_fakes_give_the_output_shape():
    import astrai.extension.ops.fp8_weights  # noqa: F401  (registers torch.ops.astrai.fp8_weight_gemm)

    x = torch.empty(5, 512, dtype=torch.bfloat16, device="meta")
    w = torch.empty(96, 512, dtype=E4M3, device="meta")
    y = torch.ops.astrai.fp8_weight_gemm(x, w, torch.empty(96, device="meta"))
    assert y.shape == (5, 96) and y.dtype == torch.bfloat16


# -- the route table: the weight-only kernel for few rows, W8A8 above --------------------------

def test_quantize_per_token_scales_each_row_to_e4m3s_largest_value():
    x = rand(6, 256, scale=3.0).to(torch.bfloat16)
    x[2] = 0.0
    xq, scale = fp8_weights.quantize_per_token(x)
    assert xq.dtype == E4M3 and scale.shape == (6, 1) and scale.dtype == torch.float32 and scale[2] == 1.0
    nonzero = torch.arange(6) != 2
    torch.testing.assert_close(xq.float().abs().amax(dim=1)[nonzero], torch.full((5,), 448.0))
    back = xq.float() * scale
    tiny = scale * torch.finfo(E4M3).tiny
    assert torch.all((back - x.float()).abs() <= 2**-4 * x.float().abs() + tiny)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_is_the_product_of_the_quantized_operands(dtype):
    w, w_scale = quantize_weight(rand(64, 512, seed=1, scale=0.02))
    x = rand(48, 512, seed=2).to(dtype)
    y = fp8_weights._w8a8(x, w, w_scale)
    xq, x_scale = fp8_weights.quantize_per_token(x)
    want = (xq.double() * x_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()
    assert y.dtype == dtype and y.shape == (48, 64)
    tol = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * want.abs().max())
    exact = x.double() @ (w.double() * w_scale.double()[:, None]).t()  # e4m3 activations: 2^-4 a value
    assert float((y.double() - exact).norm() / exact.norm()) < 2**-4


def test_the_route_table_by_rows(monkeypatch):
    routed = []
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights.ops_fp8_weights, "fp8_weight_gemm_unchecked",
                        lambda x2, w, s: routed.append(("weight", x2.shape[0])) or fp8_weights._torch_path(x2, w, s))
    real_w8a8 = fp8_weights._w8a8
    monkeypatch.setattr(fp8_weights, "_w8a8", lambda x2, w, s: routed.append(("w8a8", x2.shape[0])) or real_w8a8(x2, w, s))
    w, w_scale = quantize_weight(rand(32, 512))
    w5, s5 = quantize_weight(rand(32, 512), E5M2)
    low = fp8_weights.W8A8_MIN_ROWS
    with use_runtime(fp8_runtime()):
        for rows in (1, low - 1, low, 64, 256, 257):
            x = rand(rows, 512, dtype=torch.bfloat16, seed=rows)
            y = fp8_weight_linear(x, w, w_scale)
            want = x.double() @ (w.double() * w_scale.double()[:, None]).t()
            assert float((y.double() - want).norm() / want.norm()) < 2**-4  # every route is the same linear
        fp8_weight_linear(rand(64, 512, dtype=torch.bfloat16), w5, s5)  # e5m2 weights: the kernel
    assert routed == [("weight", 1), ("weight", low - 1), ("w8a8", low), ("w8a8", 64), ("w8a8", 256),
                      ("weight", 64)]  # 257 rows: the torch path
    monkeypatch.setattr(fp8_weights, "probe_device", lambda device: L20)  # before Hopper: the kernel
    x = rand(64, 512, dtype=torch.bfloat16)
    with use_runtime(fp8_runtime()):
        assert fp8_weights.fp8_weight_route(x, w, w_scale) == "weight"
    assert fp8_weights.fp8_weight_route(x.float(), w, w_scale) == "torch"


def test_the_w8a8_route_quantizes_with_the_plugin_where_it_can(monkeypatch):
    """A plugin with quantize_rows quantizes the activations (one launch); one built before it,
    or a call it cannot take (K not a multiple of 8), quantizes in torch: the same bytes."""
    quantized = []
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights.ops_fp8_weights, "fp8_quantize_rows_unchecked",
                        lambda x: quantized.append(x.shape) or fp8_weights.quantize_per_token(x))
    w, w_scale = quantize_weight(rand(32, 512))
    x = rand(64, 512, dtype=torch.bfloat16)
    with use_runtime(fp8_runtime()):
        fp8_weight_linear(x, w, w_scale)  # the fake plugin has no quantize_rows
        assert quantized == []
        monkeypatch.setattr(fp8_weights.ops_fp8_weights, "has_quantize_rows", lambda device: True)
        y = fp8_weight_linear(x, w, w_scale)
        assert quantized == [(64, 512)]
    xq, x_scale = fp8_weights.quantize_per_token(x)
    want = (xq.double() * x_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()
    torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))


def test_w8a8_multiplies_on_the_plugin_up_to_its_rows(monkeypatch):
    """The W8A8 GEMM runs on the plugin's row-wise kernel where it takes the call (bfloat16 out,
    at most ROWWISE_MAX_ROWS rows, sm_90, a plugin that has it), torch._scaled_mm elsewhere; the
    result is the same product either way, and the call counts as W8A8."""
    multiplied = []

    def rowwise(xq, x_scale, w, w_scale):
        multiplied.append(tuple(xq.shape))
        assert x_scale.shape == (xq.shape[0], 1) and w_scale.shape == (w.shape[0],)
        return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)

    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights.ops_fp8_weights, "fp8_rowwise_gemm_unchecked", rowwise)
    w, w_scale = quantize_weight(rand(32, 512))
    top = fp8_weights.ops_fp8_weights.ROWWISE_MAX_ROWS
    xq, x_scale = fp8_weights.quantize_per_token(rand(top, 512, dtype=torch.bfloat16))
    fp8_weights.fp8_input_linear(xq, x_scale, w, w_scale, None, torch.bfloat16)
    assert multiplied == []  # the fake plugin has no gemm_rowwise
    monkeypatch.setattr(fp8_weights.ops_fp8_weights, "has_rowwise_gemm", lambda device: True)
    with fp8_weights.decided_routes() as counts:
        y = fp8_weights.fp8_input_linear(xq, x_scale, w, w_scale, None, torch.bfloat16)
        fp8_weights.fp8_input_linear(xq[:1], x_scale[:1], w, w_scale, None, torch.bfloat16)
    assert multiplied == [(top, 512), (1, 512)] and counts == {"w8a8": 2}
    want = (xq.double() * x_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()
    torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))
    more, more_scale = fp8_weights.quantize_per_token(rand(top + 1, 512, dtype=torch.bfloat16))
    fp8_weights.fp8_input_linear(more, more_scale, w, w_scale, None, torch.bfloat16)  # past its tiles
    fp8_weights.fp8_input_linear(xq, x_scale, w, w_scale, None, torch.float16)  # its output is bfloat16
    odd = torch.empty(top, 512 + 16, dtype=torch.float8_e4m3fn)[:, 8:520]  # rows 16 bytes apart, start not
    odd.view(torch.uint8).copy_(xq.view(torch.uint8))
    fp8_weights.fp8_input_linear(odd, x_scale, w, w_scale, None, torch.bfloat16)
    monkeypatch.setattr(fp8_weights, "probe_device", lambda device: L20)
    fp8_weights.fp8_input_linear(xq, x_scale, w, w_scale, None, torch.bfloat16)  # not sm_90
    assert multiplied == [(top, 512), (1, 512)]


def test_decided_routes_counts_and_forces_each_route(monkeypatch):
    """A route forced within decided_routes wherever it can take the call (the weight-only kernel
    at 64 rows, W8A8 at one), the calls counted by the route they ran; e5m2 weights have no
    W8A8 route, and a float32 call no kernel at all."""
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights, "probe_device", lambda device: H200)
    monkeypatch.setattr(fp8_weights.ops_fp8_weights, "fp8_weight_gemm_unchecked",
                        lambda x2, w, s: fp8_weights._torch_path(x2, w, s))
    w, w_scale = quantize_weight(rand(32, 512))
    w5, s5 = quantize_weight(rand(32, 512), E5M2)
    few, many = rand(1, 512, dtype=torch.bfloat16), rand(64, 512, dtype=torch.bfloat16, seed=1)
    with use_runtime(fp8_runtime()):
        with fp8_weights.decided_routes() as counts:
            for x in (few, many, many.float()):
                fp8_weight_linear(x, w, w_scale)
        assert counts == {"weight": 1, "w8a8": 1, "torch": 1}
        with fp8_weights.decided_routes("weight") as counts:
            fp8_weight_linear(many, w, w_scale)
        assert counts == {"weight": 1}
        with fp8_weights.decided_routes("w8a8") as counts:
            fp8_weight_linear(few, w, w_scale)
            fp8_weight_linear(few, w5, s5)
            fp8_weight_linear(few.float(), w, w_scale)
        assert counts == {"w8a8": 1, "weight": 1, "torch": 1}
    assert not fp8_weights._DECIDING
    with pytest.raises(ValueError, match="force must be None, 'weight' or 'w8a8'"):
        with fp8_weights.decided_routes("fast"):
            pass
