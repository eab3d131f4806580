"""The norm ops on the torch path and their dispatch: rms_norm, fused_add_rms_norm and
silu_and_mul against transformers' own modules to the bit (the engine's CPU results),
against float64 references, in place, with gradients, traced by torch.compile, bad input
named, the ops wrappers' checks, and the kernel chosen where a (fake) plugin can run it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest

from astrai.extension import explain, fused_add_rms_norm, rms_norm, silu_and_mul
from astrai.extension import ops
from astrai.extension.backend import norm, rotary
from astrai.extension.backend.norm_torch import fused_add_rms_norm_torch, rms_norm_torch, silu_and_mul_torch
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.runtime import Runtime, use_runtime

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def hf_norm(hidden: int, weight: torch.Tensor, eps: float):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(hidden, eps=eps).to(weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


# -- the torch path: transformers' math, to the bit --------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 128), (96,)])
def test_rms_norm_is_transformers_llama_rms_norm(dtype, shape):
    x, w = rand(*shape, dtype=dtype, scale=3.0), rand(shape[-1], dtype=dtype, seed=1)
    with torch.no_grad():
        want = hf_norm(shape[-1], w, EPS)(x)
    got = rms_norm(x, w, EPS)
    assert got.dtype == dtype and torch.equal(got, want)
    ref = (x.double() * (x.double().pow(2).mean(-1, keepdim=True) + EPS).rsqrt()) * w.double()
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_adds_then_normalizes_in_place(dtype):
    x, residual = rand(4, 3, 64, dtype=dtype), rand(4, 3, 64, dtype=dtype, seed=2, scale=4.0)
    w = rand(64, dtype=dtype, seed=3)
    want_sum = residual + x
    with torch.no_grad():
        want = hf_norm(64, w, EPS)(want_sum)
    xi, ri = x.clone(), residual.clone()
    out, res = fused_add_rms_norm(xi, ri, w, EPS)
    assert out is xi and res is ri
    assert torch.equal(ri, want_sum) and torch.equal(xi, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_silu_of_the_first_half_times_the_second(dtype):
    gate_up = rand(3, 5, 2 * 48, dtype=dtype, scale=4.0)
    gate, up = gate_up[..., :48], gate_up[..., 48:]
    got = silu_and_mul(gate_up)
    assert got.shape == (3, 5, 48) and torch.equal(got, F.silu(gate) * up)
    ref = gate.double() * torch.sigmoid(gate.double()) * up.double()
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


def test_the_paths_are_the_torch_functions_on_the_cpu():
    x, w = rand(5, 32), rand(32, seed=1)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_torch(x, w, EPS))
    assert torch.equal(silu_and_mul(x), silu_and_mul_torch(x))
    r = rand(5, 32, seed=4)
    a, b = fused_add_rms_norm_torch(x.clone(), r.clone(), w, EPS)
    c, d = fused_add_rms_norm(x.clone(), r.clone(), w, EPS)
    assert torch.equal(a, c) and torch.equal(b, d)
    (decision,) = explain("rms_norm")[-1:]
    assert decision.chosen == "torch" and "CUDA" in decision.trace[0].reason


def test_gradients_match_transformers():
    x, w = rand(6, 32, scale=2.0).requires_grad_(), rand(32, seed=1).requires_grad_()
    module = hf_norm(32, w.detach(), EPS)
    x2 = x.detach().clone().requires_grad_()
    g = rand(6, 32, seed=5)
    rms_norm(x, w, EPS).backward(g)
    module(x2).backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, module.weight.grad)
    gu = rand(4, 16, seed=6).requires_grad_()
    silu_and_mul(gu).sum().backward()
    gu2 = gu.detach().clone().requires_grad_()
    (F.silu(gu2[:, :8]) * gu2[:, 8:]).sum().backward()
    torch.testing.assert_close(gu.grad, gu2.grad)


def test_compiles_fullgraph():
    def step(x, residual, w, gate_up):
        h, residual = fused_add_rms_norm(x, residual, w, EPS)
        return rms_norm(h, w, EPS), residual, silu_and_mul(gate_up)

    args = rand(3, 32), rand(3, 32, seed=1), rand(32, seed=2), rand(3, 64, seed=3)
    want = step(*(a.clone() for a in args))
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*(a.clone() for a in args))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fakes_give_the_output_shapes():
    x, w = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16), torch.empty(64, device="meta",
                                                                                    dtype=torch.bfloat16)
    assert ops.norm.rms_norm_unchecked.op(x, w, EPS).shape == (2, 3, 64)
    assert ops.norm.fused_add_rms_norm_unchecked.op(x, x.clone(), w, EPS) is None
    assert ops.norm.silu_and_mul_unchecked.op(x).shape == (2, 3, 32)


# -- bad input -----------------------------------------------------------------------------


BAD = {
    "x not a tensor": (lambda x, r, w: rms_norm([1.0], w, EPS), TypeError, "x must be a torch.Tensor"),
    "x int": (lambda x, r, w: rms_norm(x.long(), w, EPS), TypeError, "x must be float16"),
    "x 0-D": (lambda x, r, w: rms_norm(x[0, 0], w, EPS), ValueError, "x must have a last dim"),
    "x no channels": (lambda x, r, w: rms_norm(x[:, :0], w[:0], EPS), ValueError, "x has no channels"),
    "weight shape": (lambda x, r, w: rms_norm(x, w[:-1], EPS), ValueError, r"weight must have shape \[hidden\] = \[32\]"),
    "weight not a tensor": (lambda x, r, w: rms_norm(x, 1.0, EPS), TypeError, "weight must be a torch.Tensor"),
    "eps negative": (lambda x, r, w: rms_norm(x, w, -1.0), ValueError, "eps must be a finite number >= 0"),
    "eps bool": (lambda x, r, w: rms_norm(x, w, True), ValueError, "eps must be a finite number"),
    "eps nan": (lambda x, r, w: rms_norm(x, w, float("nan")), ValueError, "eps must be a finite number"),
    "residual shape": (lambda x, r, w: fused_add_rms_norm(x, r[:2], w, EPS), ValueError, "residual has shape"),
    "residual dtype": (lambda x, r, w: fused_add_rms_norm(x, r.double(), w, EPS), TypeError, "residual's dtype"),
    "residual missing": (lambda x, r, w: fused_add_rms_norm(x, None, w, EPS), TypeError, "residual must be a torch"),
    "gate_up odd": (lambda x, r, w: silu_and_mul(x[:, :31]), ValueError, "gate_up's last dim must hold gate and up"),
    "gate_up int": (lambda x, r, w: silu_and_mul(x.int()), TypeError, "gate_up must be float16"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_argument(case):
    call, error, match = BAD[case]
    with pytest.raises(error, match=match):
        call(rand(4, 32), rand(4, 32, seed=1), rand(32, seed=2))


@pytest.mark.parametrize("call", [
    lambda x, w: ops.rms_norm(x, w, EPS),
    lambda x, w: ops.fused_add_rms_norm(x, x, w, EPS),
    lambda x, w: ops.silu_and_mul(x),
], ids=["rms_norm", "fused_add_rms_norm", "silu_and_mul"])
def test_ops_wrappers_take_cuda_tensors_only(call):
    with pytest.raises(ValueError, match="must be a CUDA tensor, got one on cpu"):
        call(rand(2, 16, dtype=torch.bfloat16), rand(16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        call("x", rand(16))


# -- dispatch ------------------------------------------------------------------------------

OPS = {op: {"module": "fake_norm_module", "abi": 1, "dtypes": ["float16", "bfloat16", "float32"]}
       for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul")}


def norm_runtime(importer=None):
    registry = Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=OPS))),
                        importer=importer or (lambda name: fake_module(name)))
    return Runtime(registry)


class StandIn:
    """The ops layer's kernels, computed by the torch path, recording each launch."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(rotary, "probe_device", lambda device: H200)  # pretend tensors live on an H200
        monkeypatch.setattr(norm.ops_norm, "rms_norm_unchecked", self.rms_norm)
        monkeypatch.setattr(norm.ops_norm, "fused_add_rms_norm_unchecked", self.fused)
        monkeypatch.setattr(norm.ops_norm, "silu_and_mul_unchecked", self.silu)

    def rms_norm(self, x, w, eps):
        self.calls.append("rms_norm")
        return rms_norm_torch(x, w, eps)

    def fused(self, x, r, w, eps):
        self.calls.append("fused_add_rms_norm")
        fused_add_rms_norm_torch(x, r, w, eps)

    def silu(self, gate_up):
        self.calls.append("silu_and_mul")
        return silu_and_mul_torch(gate_up)


def test_the_kernels_run_where_the_plugin_can(monkeypatch):
    kernel = StandIn(monkeypatch)
    x, r, w = rand(4, 64, dtype=torch.bfloat16), rand(4, 64, dtype=torch.bfloat16, seed=1), rand(64, seed=2)
    w16 = w.to(torch.bfloat16)
    with use_runtime(norm_runtime()):
        rms_norm(x, w16, EPS)
        fused_add_rms_norm(x.clone(), r.clone(), w16, EPS)
        silu_and_mul(x)
        assert kernel.calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul"]
        rms_norm(x, w, EPS)  # a float32 weight: the torch path (the kernel takes one dtype)
        rms_norm(x.double(), w.double(), EPS)  # float64: not in the manifest
        fused_add_rms_norm(x.clone()[:, ::2], r.clone()[:, ::2], w16[::2], EPS)  # no rows to write in place
        rms_norm(x.clone().requires_grad_(), w16, EPS)  # the kernels have no backward
        with torch.no_grad():
            rms_norm(x.clone().requires_grad_(), w16, EPS)
        assert kernel.calls[3:] == ["rms_norm"]


def test_a_kernel_that_fails_to_import_falls_back(monkeypatch):
    def broken(name):
        raise ImportError("undefined symbol: cudaLaunchKernelExC")

    runtime = norm_runtime(importer=broken)
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(norm.ops_norm, "rms_norm_unchecked", lambda *args: runtime.registry.load("rms_norm", H200))
    x, w = rand(3, 32, dtype=torch.bfloat16), rand(32, dtype=torch.bfloat16, seed=1)
    with use_runtime(runtime):
        with pytest.warns(PluginRejectedWarning, match="undefined symbol"):
            out = rms_norm(x, w, EPS)
        assert torch.equal(out, rms_norm_torch(x, w, EPS))
        rms_norm(x, w, EPS)  # decided again, now without the plugin
        (decision,) = runtime.explain("rms_norm")
    assert decision.chosen == "torch" and "undefined symbol" in decision.trace[0].reason
