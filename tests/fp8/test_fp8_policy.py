"""Which FP8 implementation the policy picks per device and plugin manifest, and why."""

from __future__ import annotations

import pytest
import torch

from astrai.extension.backend import fp8 as backend
from astrai.extension.device import CPU, DeviceInfo
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.resolver import BackendUnavailableError
from astrai.extension.runtime import Runtime, use_runtime
from fakes import A100_OLD_DRIVER, H200, L20, FakeEntryPoint, entry_points, manifest

# Distinct indices: the registry caches per device key ("cuda:N").
RTX_5090 = DeviceInfo(type="cuda", index=2, name="RTX 5090", capability=(12, 0), driver_cuda=(13, 0))
B200 = DeviceInfo(type="cuda", index=3, name="B200", capability=(10, 0), driver_cuda=(13, 0))
A100 = DeviceInfo(type="cuda", index=4, name="A100", capability=(8, 0), driver_cuda=(13, 0))

FP8_OPS = {
    "fp8_quantize": {"module": "fake_fp8_ops", "abi": 1, "min_sm": 89,
                     "dtypes": ["float32", "float16", "bfloat16"]},
    "fp8_gemm": {"module": "fake_fp8_ops", "abi": 1, "min_sm": 89, "native_sm": [89, 120],
                 "dtypes": ["float8_e4m3fn", "float8_e5m2"]},
}


def _runtime(*eps) -> Runtime:
    return Runtime(Registry(entry_points(*eps), importer=lambda name: pytest.fail(f"imported {name}")))


@pytest.fixture
def with_plugin() -> Runtime:
    return _runtime(FakeEntryPoint("fp8", manifest("astrai-fp8", ops=FP8_OPS), dist="astrai-fp8"))


def _decision(runtime: Runtime, op: str):
    (decision,) = runtime.explain(op)
    return decision


def test_sm90_takes_cublaslt_and_says_why(with_plugin):
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=with_plugin) == "scaled_mm"
    decision = _decision(with_plugin, "fp8_gemm")
    plugin = decision.trace[0]
    assert plugin.candidate == "plugin" and not plugin.accepted
    assert "emulated on sm_90" in plugin.reason and "sm_89, sm_120" in plugin.reason
    assert decision.trace[1].candidate == "scaled_mm" and decision.trace[1].accepted


@pytest.mark.parametrize("device", [L20, RTX_5090], ids=["sm_89", "sm_120"])
def test_native_archs_take_the_plugin(with_plugin, device):
    assert backend.choose_gemm(device, "e4m3", "e4m3", runtime=with_plugin) == "plugin"
    assert backend.choose_gemm(device, "e5m2", "e4m3", runtime=with_plugin) == "plugin"


def test_sm100_is_not_native_for_mma_sync(with_plugin):
    assert backend.choose_gemm(B200, "e4m3", "e4m3", runtime=with_plugin) == "scaled_mm"


def test_cpu_emulates(with_plugin):
    assert backend.choose_gemm(CPU, "e4m3", "e4m3", runtime=with_plugin) == "emulated"
    assert backend.choose_quantize(CPU, torch.bfloat16, "e4m3", runtime=with_plugin) == "torch"
    trace = _decision(with_plugin, "fp8_gemm").trace
    assert [e.accepted for e in trace] == [False, False, True]


def test_pre_ada_emulates(with_plugin):
    assert backend.choose_gemm(A100, "e4m3", "e4m3", runtime=with_plugin) == "emulated"
    reasons = [e.reason for e in _decision(with_plugin, "fp8_gemm").trace]
    assert "needs sm_89+" in reasons[0] and "needs sm_89+" in reasons[1]


def test_e5m2_pair_on_sm90_is_emulated(with_plugin):
    assert backend.choose_gemm(H200, "e5m2", "e5m2", runtime=with_plugin) == "emulated"
    assert "e5m2 x e5m2" in _decision(with_plugin, "fp8_gemm").trace[1].reason


def test_no_plugin_installed():
    runtime = _runtime()
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime) == "scaled_mm"
    assert backend.choose_gemm(L20, "e4m3", "e4m3", runtime=runtime) == "scaled_mm"
    assert all("no installed plugin" in d.trace[0].reason for d in runtime.explain("fp8_gemm"))


def test_quantize_kernel_is_used_wherever_it_is_usable(with_plugin):
    # quantization has no emulated form on sm_90: the cvt instructions are native there
    assert backend.choose_quantize(H200, torch.bfloat16, "e4m3", runtime=with_plugin) == "plugin"
    assert backend.choose_quantize(A100, torch.bfloat16, "e4m3", runtime=with_plugin) == "torch"


def test_plugin_missing_a_dtype():
    ops = {"fp8_gemm": dict(FP8_OPS["fp8_gemm"], dtypes=["float8_e4m3fn"])}
    runtime = _runtime(FakeEntryPoint("fp8", manifest("astrai-fp8", ops=ops), dist="astrai-fp8"))
    assert backend.choose_gemm(L20, "e5m2", "e4m3", runtime=runtime) == "scaled_mm"
    assert "float8_e5m2" in _decision(runtime, "fp8_gemm").trace[0].reason


def test_manifest_without_native_sm_counts_as_native():
    ops = {"fp8_gemm": {k: v for k, v in FP8_OPS["fp8_gemm"].items() if k != "native_sm"}}
    runtime = _runtime(FakeEntryPoint("fp8", manifest("astrai-fp8", ops=ops), dist="astrai-fp8"))
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime) == "plugin"


def test_rejected_plugin_falls_back_with_its_reason():
    raw = manifest("astrai-fp8", ops=FP8_OPS)
    runtime = _runtime(FakeEntryPoint("fp8", raw, dist="astrai-fp8"))
    with pytest.warns(PluginRejectedWarning, match="driver supports CUDA 12.4"):
        chosen = backend.choose_gemm(A100_OLD_DRIVER, "e4m3", "e4m3", runtime=runtime)
    assert chosen == "emulated"
    assert "driver supports CUDA 12.4" in _decision(runtime, "fp8_gemm").trace[0].reason


def test_explicit_backend_is_strict(with_plugin):
    with pytest.raises(BackendUnavailableError, match="emulated on sm_90"):
        backend.choose_gemm(H200, "e4m3", "e4m3", runtime=with_plugin, backend="plugin")
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=with_plugin, backend="emulated") == "emulated"


def test_decisions_are_cached_per_device_and_format(with_plugin):
    for _ in range(3):
        backend.choose_gemm(H200, "e4m3", "e4m3", runtime=with_plugin)
        backend.choose_gemm(L20, "e4m3", "e4m3", runtime=with_plugin)
    keys = sorted(str(d.key) for d in with_plugin.explain("fp8_gemm"))
    assert len(keys) == 2


def test_calls_on_cpu_tensors_run_the_emulation_and_are_explained(with_plugin):
    a = torch.randn(8, 32).to(torch.float8_e4m3fn)
    b = torch.randn(32, 16).to(torch.float8_e4m3fn)
    with use_runtime(with_plugin):
        out = backend.gemm(a, b, torch.tensor(2.0))
        q, _, _ = backend.quantize(torch.randn(8, 32), torch.tensor(1.0))
    assert out.dtype == torch.bfloat16 and q.dtype == torch.float8_e4m3fn
    assert _decision(with_plugin, "fp8_gemm").chosen == "emulated"
    assert _decision(with_plugin, "fp8_quantize").chosen == "torch"


def _with_native_90() -> Runtime:
    ops = {"fp8_gemm": dict(FP8_OPS["fp8_gemm"], native_sm=[89, 90, 120])}
    return _runtime(FakeEntryPoint("fp8", manifest("astrai-fp8", ops=ops), dist="astrai-fp8"))


def test_wants_k_major(with_plugin):
    assert backend.wants_k_major(H200, "e4m3", "e4m3", runtime=with_plugin)  # cuBLASLt
    assert not backend.wants_k_major(L20, "e4m3", "e4m3", runtime=with_plugin)  # mma.sync: any layout
    assert not backend.wants_k_major(CPU, "e4m3", "e4m3", runtime=with_plugin)
    assert backend.wants_k_major(H200, "e5m2", "e4m3", runtime=_with_native_90())  # wgmma


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_sm90_plugin_gets_k_major_operands(monkeypatch, a_t, b_t):
    """A plugin native on sm_90 (wgmma) is handed a row-major a and a column-major b."""
    from astrai.extension.ops import fp8 as ops_fp8

    seen = []

    def fake_mm_fp8(a, b, scale, bias=None):
        seen.append((a.is_contiguous(), b.t().is_contiguous()))
        return (scale * (a.float() @ b.float())).to(torch.bfloat16)

    monkeypatch.setattr(ops_fp8, "mm_fp8", fake_mm_fp8)
    monkeypatch.setattr(backend, "probe_device", lambda device: H200)
    a = torch.randn(24, 48).to(torch.float8_e4m3fn)
    b = torch.randn(48, 40).to(torch.float8_e4m3fn)
    a_in = a.t().contiguous().t() if a_t else a
    b_in = b.t().contiguous().t() if b_t else b
    out = backend.gemm(a_in, b_in, torch.tensor(0.5), runtime=_with_native_90())
    assert seen == [(True, True)]
    torch.testing.assert_close(out, (0.5 * (a.float() @ b.float())).to(torch.bfloat16))
