"""The norms and SiLU-and-mul into per-token e4m3 rows (backend.norm_fp8), on the CPU: the bytes
of the 16-bit op then the W8A8 quantize, against float64 references within e4m3's rounding, the
residual stream updated in place, the kernel chosen where a (fake) plugin has it and the two
launches it replaces where it has not, the fakes' shapes, and bad input named."""

from __future__ import annotations

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest

from astrai.extension import ops
from astrai.extension.backend import fp8_weights, norm, norm_fp8, rotary
from astrai.extension.backend.fp8_weights import quantize_per_token
from astrai.extension.backend.norm_torch import rms_norm_torch, silu_and_mul_torch
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

E4M3 = torch.float8_e4m3fn
EPS = 1e-5


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def assert_per_token_e4m3(q, scale, want64):
    """``q * scale`` is ``want64`` to e4m3's rounding: each row's scale its amax / 448 (the 16-bit
    row's, so within the dtype's rounding of the float64 amax), each value within 2^-4 of itself
    plus the subnormal step, beside the dtype's own rounding."""
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (q.shape[0], 1)
    amax = want64.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale.double(), amax / 448, rtol=2**-7, atol=0)
    back = q.double() * scale.double()
    bound = 2**-4 * want64.abs() + 2**-7 * amax + scale.double() * 2**-9
    assert torch.all((back - want64).abs() <= bound), float(((back - want64).abs() - bound).max())


def rms_norm64(x, w):
    x = x.double()
    return x * (x.pow(2).mean(-1, keepdim=True) + EPS).rsqrt() * w.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_fp8_is_the_norm_then_the_per_token_quantize(dtype):
    x, w = rand(9, 256, dtype=dtype, scale=3.0), rand(256, dtype=dtype, seed=1)
    x[4] = 0.0  # a zero row: scale 1, zero bytes
    q, scale, residual = norm_fp8.add_rms_norm_fp8(x, None, w, EPS)
    assert residual is x
    want_q, want_scale = quantize_per_token(rms_norm_torch(x, w, EPS))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert scale[4] == 1.0 and not q[4].float().any()
    keep = torch.arange(9) != 4
    assert_per_token_e4m3(q[keep], scale[keep], rms_norm64(x, w)[keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_add_updates_the_residual_and_leaves_x(dtype):
    x, r = rand(5, 128, dtype=dtype, seed=2), rand(5, 128, dtype=dtype, seed=3, scale=4.0)
    w = rand(128, dtype=dtype, seed=4)
    x0, want_sum = x.clone(), r + x
    q, scale, residual = norm_fp8.add_rms_norm_fp8(x, r, w, EPS)
    assert residual is r and torch.equal(r, want_sum) and torch.equal(x, x0)
    want_q, want_scale = quantize_per_token(rms_norm_torch(want_sum, w, EPS))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert_per_token_e4m3(q, scale, rms_norm64(want_sum, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_fp8_is_silu_and_mul_then_the_per_token_quantize(dtype):
    gate_up = rand(7, 2 * 96, dtype=dtype, seed=5, scale=2.0)
    q, scale = norm_fp8.silu_and_mul_fp8(gate_up)
    want_q, want_scale = quantize_per_token(silu_and_mul_torch(gate_up))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    g, u = gate_up.double().chunk(2, dim=-1)
    assert_per_token_e4m3(q, scale, g * torch.sigmoid(g) * u)


def test_a_nan_row_gets_scale_one_and_keeps_its_nan():
    x, w = rand(3, 64, dtype=torch.bfloat16), rand(64, dtype=torch.bfloat16, seed=1)
    x[1, 7] = float("nan")
    q, scale, _ = norm_fp8.add_rms_norm_fp8(x, None, w, EPS)
    assert scale[1] == 1.0 and q[1].float().isnan().all()  # the row's norm is NaN throughout
    assert not q[[0, 2]].float().isnan().any()


BAD = {
    "x 3-D": (lambda x, r, w: norm_fp8.add_rms_norm_fp8(x[None], None, w, 1e-5), ValueError,
              r"x must be a \[rows, channels\] tensor"),
    "x strided": (lambda x, r, w: norm_fp8.add_rms_norm_fp8(x[:, ::2], None, w[::2], 1e-5), ValueError,
                  r"x must be a \[rows, channels\] tensor with a contiguous last dim"),
    "weight shape": (lambda x, r, w: norm_fp8.add_rms_norm_fp8(x, None, w[:-1], 1e-5), ValueError,
                     r"weight must have shape \[hidden\]"),
    "residual shape": (lambda x, r, w: norm_fp8.add_rms_norm_fp8(x, r[:2], w, 1e-5), ValueError, "residual has shape"),
    "eps": (lambda x, r, w: norm_fp8.add_rms_norm_fp8(x, None, w, -1.0), ValueError, "eps must be"),
    "gate_up odd": (lambda x, r, w: norm_fp8.silu_and_mul_fp8(x[:, :31]), ValueError, "gate_up's last dim"),
    "gate_up 3-D": (lambda x, r, w: norm_fp8.silu_and_mul_fp8(x[None]), ValueError, r"gate_up must be a \[rows"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_argument(case):
    call, error, match = BAD[case]
    with pytest.raises(error, match=match):
        call(rand(4, 32), rand(4, 32, seed=1), rand(32, seed=2))


def test_fakes_give_the_output_shapes():
    x = torch.empty(6, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    for q, scale, channels in (ops.norm_fp8.rms_norm_fp8_unchecked.op(x, w, EPS) + (64,),
                               ops.norm_fp8.fused_add_rms_norm_fp8_unchecked.op(x, x.clone(), w, EPS) + (64,),
                               ops.norm_fp8.silu_and_mul_fp8_unchecked.op(x) + (32,)):
        assert q.shape == (6, channels) and q.dtype == E4M3 and scale.shape == (6, 1) and scale.dtype == torch.float32


# -- dispatch ------------------------------------------------------------------------------

OPS = {op: {"module": "fake_norm_module", "abi": 1, "dtypes": ["float16", "bfloat16", "float32"]}
       for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul")}


def norm_runtime(**entries):
    module = fake_module("fake_norm_module", **entries)
    return Runtime(Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=OPS))), importer=lambda name: module))


class StandIn:
    """The kernels computed by the torch path, each launch recorded."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
        monkeypatch.setattr(ops._plugin, "probe_device", lambda device: H200)  # has_fp8_rows asks the registry
        monkeypatch.setattr(norm_fp8.ops_norm_fp8, "rms_norm_fp8_unchecked", self.rms_norm_fp8)
        monkeypatch.setattr(norm_fp8.ops_norm_fp8, "fused_add_rms_norm_fp8_unchecked", self.fused_fp8)
        monkeypatch.setattr(norm_fp8.ops_norm_fp8, "silu_and_mul_fp8_unchecked", self.silu_fp8)
        monkeypatch.setattr(norm.ops_norm, "rms_norm_unchecked", self.record("rms_norm", rms_norm_torch))
        monkeypatch.setattr(norm.ops_norm, "silu_and_mul_unchecked", self.record("silu_and_mul", silu_and_mul_torch))
        monkeypatch.setattr(fp8_weights, "quantize_activations", self.record("quantize", quantize_per_token))
        monkeypatch.setattr(norm_fp8, "quantize_activations", self.record("quantize", quantize_per_token))

    def record(self, name, fn):
        return lambda *args: self.calls.append(name) or fn(*args)

    def rms_norm_fp8(self, x, w, eps):
        self.calls.append("rms_norm_fp8")
        return quantize_per_token(rms_norm_torch(x, w, eps))

    def fused_fp8(self, x, r, w, eps):
        self.calls.append("fused_add_rms_norm_fp8")
        r.add_(x)
        return quantize_per_token(rms_norm_torch(r, w, eps))

    def silu_fp8(self, gate_up):
        self.calls.append("silu_and_mul_fp8")
        return quantize_per_token(silu_and_mul_torch(gate_up))


def test_the_core_makes_e4m3_rows_in_the_kernel_from_the_dtypes_the_plugin_states():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "packages/astrai-elementwise/src/astrai_elementwise/capabilities.py"
    spec = importlib.util.spec_from_file_location("elementwise_capabilities", path)
    caps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(caps)
    assert tuple(str(t).removeprefix("torch.") for t in norm_fp8.ROW_SOURCE_DTYPES) == caps.FP8_ROW_SOURCE_DTYPES


def test_one_launch_where_the_plugin_has_the_fp8_rows_two_where_it_has_not(monkeypatch):
    kernel = StandIn(monkeypatch)
    x, r = rand(4, 64, dtype=torch.bfloat16), rand(4, 64, dtype=torch.bfloat16, seed=1)
    w = rand(64, dtype=torch.bfloat16, seed=2)
    fused = {"rms_norm_fp8": lambda *a: None, "silu_and_mul_fp8": lambda *a: None}
    results = []
    for entries, want in ((fused, ["rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8"]),
                          ({}, ["rms_norm", "quantize", "rms_norm", "quantize", "silu_and_mul", "quantize"])):
        kernel.calls.clear()
        ops._plugin._ENTRIES.clear()
        with use_runtime(norm_runtime(**entries)):
            rr = r.clone()
            results.append((norm_fp8.add_rms_norm_fp8(x, None, w, EPS)[:2], norm_fp8.add_rms_norm_fp8(x, rr, w, EPS)[:2],
                            norm_fp8.silu_and_mul_fp8(x), rr))
        assert kernel.calls == want
    kernel.calls.clear()
    with use_runtime(norm_runtime(**fused)):
        norm_fp8.add_rms_norm_fp8(x.float(), None, w.float(), EPS)  # float32: no e4m3 rows in the kernel
    assert kernel.calls == ["rms_norm", "quantize"]
    for fused_result, unfused_result in zip(*results):  # the same bytes either way
        for a, b in zip(fused_result if isinstance(fused_result, tuple) else (fused_result,),
                        unfused_result if isinstance(unfused_result, tuple) else (unfused_result,)):
            assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a, b.view(torch.uint8) if b.dtype == E4M3 else b)
