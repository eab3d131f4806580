"""Capabilities stated once: the CUDA attention backend and the ops read the plugin
manifest's op spec (dtypes, head dims; archs through the registry) instead of constants of
their own; the fallback decision reads the plugin error's CUDA code, not its text."""

from __future__ import annotations

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, manifest

from astrai.extension.backend.attention import cuda as cuda_backend
from astrai.extension.backend.attention.base import AttentionCall
from astrai.extension.ops import _plugin
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

OPS = ("attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill")


def attention_plugin(dtypes, head_dims, min_sm=80):
    spec = {"abi": 1, "dtypes": dtypes, "head_dims": head_dims, "min_sm": min_sm}
    ops = {op: {"module": f"fake_{op}", **spec} for op in OPS}
    return FakeEntryPoint("attention", manifest(name="astrai-attention", ops=ops), dist="astrai-attention")


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(cuda_backend, "probe_device", lambda device=None: H200)
    monkeypatch.setattr(_plugin, "probe_device", lambda device=None: H200)


def call(dtype, head_dim, mode="decode"):
    return AttentionCall(torch.device("cuda", 0), dtype, head_dim, 32, 8, mode, None, True, 0, True, 16, False)


@pytest.mark.parametrize("dtypes, head_dims, dtype, head_dim, reason", [
    (["bfloat16", "float16"], [64, 128, 256], torch.bfloat16, 128, None),
    (["bfloat16"], [64, 128, 256], torch.float16, 128, "attn_paged_decode takes bfloat16, got float16"),
    (["bfloat16", "float16"], [128], torch.bfloat16, 64, "attn_paged_decode supports head_dim 128, got 64"),
    (["bfloat16", "float16"], [64, 128, 256, 96], torch.bfloat16, 96, None),  # a plugin that adds d96
    (["bfloat16", "float16", "float32"], [64], torch.float32, 64, None),
])
def test_cuda_backend_decides_by_the_manifest(on_h200, dtypes, head_dims, dtype, head_dim, reason):
    with use_runtime(Runtime(Registry(entry_points(attention_plugin(dtypes, head_dims))))):
        assert cuda_backend.CudaBackend().check(call(dtype, head_dim)) == reason
        prefill = cuda_backend.CudaBackend().check(call(dtype, head_dim, "prefill"))
        assert prefill == (None if reason is None else reason.replace("attn_paged_decode", "attn_paged_prefill"))


def test_arch_limits_come_from_the_manifest_too(on_h200):
    with use_runtime(Runtime(Registry(entry_points(attention_plugin(["bfloat16"], [128], min_sm=100))))):
        reason = cuda_backend.CudaBackend().check(call(torch.bfloat16, 128))
    assert "needs sm_100+, device is sm_90" in reason


def test_ops_read_the_same_statement(on_h200):
    with use_runtime(Runtime(Registry(entry_points(attention_plugin(["bfloat16"], [128]))))):
        spec = _plugin.op_spec("attn_decode", "cuda")
        assert spec.unsupported("float16") == "attn_decode takes bfloat16, got float16"
        assert spec.unsupported("bfloat16", 128) is None
    with use_runtime(Runtime(Registry(entry_points()))):
        assert _plugin.op_spec("attn_decode", "cuda") is None  # no plugin: require() says why


def coded(code, text):
    exc = RuntimeError(text)
    exc.cuda_error = code
    return exc


def test_image_errors_are_decided_by_their_cuda_code():
    assert _plugin.is_image_error(coded(209, "launch failed"))  # cudaErrorNoKernelImageForDevice
    assert _plugin.is_image_error(coded(35, "driver too old"))  # cudaErrorInsufficientDriver
    # the code wins over words in the message: an illegal address is never an image error
    assert not _plugin.is_image_error(coded(700, "no kernel image is available (but really 700)"))
    # no code (an older binary, a third-party plugin): the CUDA error it names decides
    assert _plugin.is_image_error(RuntimeError("CUDA error cudaErrorNoKernelImageForDevice: ..."))
    assert not _plugin.is_image_error(ValueError("no kernel image is available"))
