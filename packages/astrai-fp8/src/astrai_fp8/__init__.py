"""AstrAI FP8 plugin: the manifest of its compiled module, and nothing compiled.

The core's registry calls :func:`manifest` through the entry point ``astrai.kernels: fp8``;
the compiled module ``astrai_fp8._fp8_ops`` (quantize + GEMM, sm_89+) is imported by the
core only when an op first runs. What the binary really holds (CUDA version, SASS and
PTX archs) comes from ``build_info.json``, written by the build next to the module.

``native_sm`` tells the core where the GEMM runs on native FP8 tensor-core instructions:
the ``mma.sync`` m16n8k32 mainloop is native on sm_89 and sm_120 and an fp16 emulation on
sm_90 / sm_100, where the core prefers cuBLASLt. A Hopper ``wgmma`` mainloop, once built
in, adds 90 here (see ``_gemm_native_sm``).
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

__all__ = ["build_info", "manifest"]

API_VERSION = 1
CORE_REQUIRES = ">=0.1.0,<0.2.0"
MODULE = "astrai_fp8._fp8_ops"

# Archs whose mma.sync e4m3/e5m2 is a native QMMA (checked in the SASS by the tests).
MMA_SYNC_NATIVE_SM = (89, 120)


def build_info() -> dict[str, Any]:
    """The build's record: version, cuda, nvcc_version, sass_archs, ptx_archs, no_mma, modules."""
    return json.loads(files(__name__).joinpath("build_info.json").read_text(encoding="utf-8"))


def _gemm_native_sm(info: dict[str, Any]) -> list[int]:
    """Where fp8_gemm is native. The wgmma mainloop (sm_90a) extends this list."""
    return list(MMA_SYNC_NATIVE_SM)


def manifest() -> dict[str, Any]:
    info = build_info()
    return {
        "api_version": API_VERSION,
        "name": "astrai-fp8",
        "version": info["version"],
        "core_requires": CORE_REQUIRES,
        "cuda": info["cuda"],
        "sass_archs": list(info["sass_archs"]),
        "ptx_archs": list(info["ptx_archs"]),
        "ops": {
            "fp8_quantize": {
                "module": MODULE,
                "abi": 1,
                "dtypes": ["float32", "float16", "bfloat16"],
                "min_sm": 89,
            },
            "fp8_gemm": {
                "module": MODULE,
                "abi": 1,
                "dtypes": ["float8_e4m3fn", "float8_e5m2"],
                "min_sm": 89,
                "native_sm": _gemm_native_sm(info),
            },
        },
    }
