"""The stable public API of the design: names, and the ops' errors without plugins."""

import pytest
import torch

import astrai.extension as ext
import astrai.extension.ops as ops
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

PUBLIC = {"attention", "attn_backend", "ATTN_BACKEND", "apply_rotary_emb", "fp8_autocast", "DelayedScaling",
          "DynamicScaling", "Format", "PagedKVCache", "BatchPlan", "explain"}
OPS = {"attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill", "rotary_emb", "fp8_quantize",
       "fp8_gemm", "quantize", "mm_fp8", "rms_norm", "fused_add_rms_norm", "silu_and_mul"}


def test_public_names():
    assert PUBLIC <= set(ext.__all__)
    assert {b.name for b in ext.ATTN_BACKEND} == {"CUDA", "FLASH", "TORCH_NATIVE"}
    for name in PUBLIC:
        assert getattr(ext, name) is not None


def test_ops_names():
    assert set(ops.__all__) == OPS


def test_importing_astrai_imports_no_plugin_binary():
    import subprocess
    import sys

    code = ("import sys, astrai, astrai.extension, astrai.extension.ops; "
            "print(sorted(m for m in sys.modules if m.startswith('astrai_')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_ops_reject_cpu_tensors_with_a_clear_error():
    with pytest.raises((ValueError, RuntimeError), match="CUDA|cuda|plugin"):
        ops.rotary_emb(torch.randn(1, 2, 2, 8, dtype=torch.bfloat16), torch.ones(2, 4), torch.ones(2, 4))


def test_require_without_plugin_names_plugin_and_install_command():
    from astrai.extension.ops._plugin import require

    for op, plugin, extra in (("attn_paged_decode", "astrai-attention", "attention"),
                              ("rotary_emb", "astrai-elementwise", "rotary"), ("fp8_gemm", "astrai-fp8", "fp8")):
        with use_runtime(Runtime(Registry(lambda: []))), pytest.raises(RuntimeError) as err:
            require(op, "cpu")
        assert plugin in str(err.value) and f'astrai[{extra}]' in str(err.value) and "pip install" in str(err.value)
