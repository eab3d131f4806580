"""AstrAI FP8 plugin: the manifest of its compiled module, and nothing compiled.

The core's registry calls :func:`manifest` through the entry point ``astrai.kernels: fp8``;
the compiled module ``astrai_fp8._fp8_ops`` (quantize, GEMM and the delayed-scaling update,
sm_89+) is imported by the core only when an op first runs. What the binary really holds (CUDA version, SASS and
PTX archs) comes from ``build_info.json``, written by the build next to the module.

``native_sm`` tells the core where the GEMM runs on native FP8 tensor-core instructions:
the ``mma.sync`` m16n8k32 mainloop is native on sm_89 and sm_120 and an fp16 emulation on
sm_90 / sm_100. A build with ``sm_90a`` code holds the Hopper ``wgmma`` mainloop, which
makes 90 native too (``_gemm_native_sm``); such a manifest also carries ``prefer`` for 90,
the measured table of ``sm90_table.json`` (``astrai_fp8.sm90_table``), so that the core
runs the plugin's GEMM on sm_90 only for the shape classes where it beats cuBLASLt.

What the kernels serve (dtypes, fp8 formats, min arch, the native archs) is stated once, in
:mod:`astrai_fp8.capabilities`; the ops' specs below and the C++ read it.
"""

from __future__ import annotations

import copy
import json
from importlib.resources import files
from typing import Any

from . import capabilities, sm90_table

__all__ = ["build_info", "manifest"]

API_VERSION = 1
CORE_REQUIRES = ">=0.1.0,<0.2.0"
MODULE = "astrai_fp8._fp8_ops"
MIN_SM = capabilities.MIN_SM
# the manifest keys copied from the build's record (build_info.json)
FROM_BUILD = ("version", "cuda", "sass_archs", "ptx_archs")

# The ops of MODULE (all ABI 1, sm_89+) and the dtypes each takes.
OP_DTYPES = {
    "fp8_quantize": capabilities.QUANTIZE_DTYPES,
    "fp8_gemm": capabilities.FP8_DTYPES,
    # delayed scaling's end of step: history roll + scale / scale_inv, one kernel
    "fp8_scale_update": capabilities.SCALE_UPDATE_DTYPES,
    # decode-size x . (FP8 weights * per-channel scales)^T
    "fp8_weight_gemm": capabilities.ACTIVATION_DTYPES,
}

# Archs whose mma.sync e4m3/e5m2 is a native QMMA (checked in the SASS by the tests).
MMA_SYNC_NATIVE_SM = capabilities.MMA_SYNC_NATIVE_SM
# The Hopper wgmma + TMA mainloop (csrc/gemm/sm90) is compiled only for this target.
WGMMA_SASS = f"sm_{capabilities.WGMMA_SM}a"


def build_info() -> dict[str, Any]:
    """The build's record: version, cuda, nvcc_version, sass_archs, ptx_archs, no_mma, modules."""
    return json.loads(files(__name__).joinpath("build_info.json").read_text(encoding="utf-8"))


def _has_wgmma(info: dict[str, Any]) -> bool:
    """The GEMM module holds sm_90a machine code, hence the wgmma mainloop."""
    module = info.get("modules", {}).get(MODULE.rsplit(".", 1)[-1], {})
    return WGMMA_SASS in module.get("sass_archs", info["sass_archs"])


def _gemm_native_sm(info: dict[str, Any]) -> list[int]:
    """Where fp8_gemm is native: the mma.sync archs, plus 90 with the wgmma mainloop."""
    return sorted({*MMA_SYNC_NATIVE_SM, *((capabilities.WGMMA_SM,) if _has_wgmma(info) else ())})


def _gemm_prefer(info: dict[str, Any]) -> dict[str, Any] | None:
    """The measured tables per arch (manifest key ``prefer``): sm_90's, with the wgmma build."""
    return {str(capabilities.WGMMA_SM): sm90_table.load()} if _has_wgmma(info) else None


def _ops(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    ops = {op: {"module": MODULE, "abi": 1, "dtypes": list(dtypes), "min_sm": MIN_SM}
           for op, dtypes in OP_DTYPES.items()}
    ops["fp8_gemm"].update(native_sm=_gemm_native_sm(info), prefer=_gemm_prefer(info))
    return ops


def manifest() -> dict[str, Any]:
    info = build_info()
    return {"api_version": API_VERSION, "name": "astrai-fp8", "core_requires": CORE_REQUIRES,
            **{key: copy.copy(info[key]) for key in FROM_BUILD}, "ops": _ops(info)}
