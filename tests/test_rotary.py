"""apply_rotary_emb: the torch path against the float64 reference, its gradient, the dispatch."""

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest
from reference import rotary_ref, rotary_tables, tolerance

from astrai.extension.backend import rotary
from astrai.extension.backend.rotary import RotaryCall, apply_rotary_emb
from astrai.extension.device import CPU
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.runtime import Runtime, use_runtime


def inputs(b, l, h, d, dtype=torch.float32, seed=0, offset=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, d, generator=g).to(dtype)
    cos, sin = rotary_tables(l, d, offset=offset)
    return x, cos, sin


@pytest.mark.parametrize("head_dim", [2, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_matches_reference(head_dim, dtype):
    x, cos, sin = inputs(2, 13, 3, head_dim, dtype, seed=head_dim, offset=1000)
    out = apply_rotary_emb(x, (cos, sin))
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(dtype))


def test_random_angles_and_strided_input():
    """Arbitrary (not table-shaped) cos/sin, and x given as a permuted [B, H, L, D] view."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 9, 32, generator=g).transpose(1, 2)
    angles = torch.rand(9, 16, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    assert not x.is_contiguous()
    torch.testing.assert_close(apply_rotary_emb(x, (cos, sin)).double(), rotary_ref(x, cos, sin), **tolerance(torch.float32))


def test_rotation_preserves_pair_norms():
    x, cos, sin = inputs(1, 6, 2, 16, torch.float64, seed=5)
    out = apply_rotary_emb(x, (cos, sin))
    norms = lambda t: t.view(*t.shape[:-1], -1, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norms(out), norms(x))


def test_gradcheck_float64():
    x, cos, sin = inputs(2, 5, 2, 8, torch.float64, seed=9)
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, (cos, sin)), (x,))


def test_gradient_is_the_inverse_rotation():
    x, cos, sin = inputs(1, 4, 2, 8, torch.float32, seed=2)
    x.requires_grad_()
    g = torch.randn_like(x)
    apply_rotary_emb(x, (cos, sin)).backward(g)
    torch.testing.assert_close(x.grad.double(), rotary_ref(g, cos, -sin), **tolerance(torch.float32))


# -- dispatch ---------------------------------------------------------------------------


def rotary_runtime(importer=None):
    registry = Registry(entry_points(FakeEntryPoint("rotary", manifest())),
                        importer=importer or (lambda name: fake_module(name)))
    return Runtime(registry)


def test_cpu_resolves_to_torch_with_reason():
    runtime = rotary_runtime()
    with use_runtime(runtime):
        x, cos, sin = inputs(1, 3, 2, 8, torch.bfloat16)
        apply_rotary_emb(x, (cos, sin))
    (decision,) = runtime.explain("rotary_emb")
    assert decision.chosen == "torch"
    assert "CUDA" in decision.trace[0].reason and not decision.trace[0].accepted


@pytest.mark.parametrize(
    "call, verdict",
    [
        (RotaryCall(H200, torch.bfloat16, 128, needs_grad=False), None),
        (RotaryCall(H200, torch.bfloat16, 128, needs_grad=True), "requires grad"),
        (RotaryCall(H200, torch.float16, 128, needs_grad=False), "takes bfloat16"),
        (RotaryCall(CPU, torch.bfloat16, 128, needs_grad=False), "CUDA"),
    ],
)
def test_kernel_capability(call, verdict):
    reason = rotary._Kernel(rotary_runtime()).check(call)
    assert reason is None if verdict is None else verdict in reason


def test_no_plugin_means_torch():
    runtime = Runtime(Registry(entry_points()))
    reason = rotary._Kernel(runtime).check(RotaryCall(H200, torch.bfloat16, 64, False))
    assert reason == "no installed plugin provides it"


def kernel_stand_in(calls):
    def rotary_emb(x, cos, sin):
        calls.append((x.shape, x.dtype))
        return rotary.rotary_torch(x, cos, sin)

    return rotary_emb


def test_inference_bf16_on_cuda_takes_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)  # pretend x lives on an H200
    monkeypatch.setattr(rotary.ops_rotary, "rotary_emb", kernel_stand_in(calls))
    x, cos, sin = inputs(2, 7, 4, 64, torch.bfloat16, seed=1)
    with use_runtime(rotary_runtime()):
        with torch.no_grad():
            out = apply_rotary_emb(x, (cos, sin))
        assert calls == [(x.shape, torch.bfloat16)]
        apply_rotary_emb(x, (cos, sin))  # grad enabled but x does not require grad: kernel
        assert len(calls) == 2
        xg = x.clone().requires_grad_()
        apply_rotary_emb(xg, (cos, sin)).float().sum().backward()  # training: torch path
        assert len(calls) == 2 and xg.grad is not None
        apply_rotary_emb(x.float(), (cos, sin))  # float32: torch path
        assert len(calls) == 2
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(torch.bfloat16))


def test_kernel_that_fails_to_import_falls_back(monkeypatch):
    def broken(name):
        raise ImportError("undefined symbol: cudaLaunchKernelExC")

    runtime = rotary_runtime(importer=broken)
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(rotary.ops_rotary, "rotary_emb", lambda x, c, s: runtime.registry.load("rotary_emb", H200))
    x, cos, sin = inputs(1, 5, 2, 32, torch.bfloat16, seed=4)
    with use_runtime(runtime), torch.no_grad():
        with pytest.warns(PluginRejectedWarning, match="undefined symbol"):
            out = apply_rotary_emb(x, (cos, sin))
        torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(torch.bfloat16))
        apply_rotary_emb(x, (cos, sin))
    (decision,) = runtime.explain("rotary_emb")
    assert decision.chosen == "torch" and "undefined symbol" in decision.trace[0].reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_view_at_an_odd_storage_offset(dtype):
    x, cos, sin = inputs(1, 4, 2, 8, dtype, seed=6)
    shifted = torch.cat([torch.zeros(1, dtype=dtype), x.flatten()])[1:].view(x.shape)
    assert shifted.storage_offset() == 1 and shifted.is_contiguous()
    torch.testing.assert_close(apply_rotary_emb(shifted, (cos, sin)).double(), rotary_ref(x, cos, sin), **tolerance(dtype))
