"""AstrAI element-wise plugin (rotary embedding, the RMSNorms, SiLU-and-mul): the manifest of its
compiled module, and nothing compiled.

The core's registry calls :func:`manifest` through the entry point ``astrai.kernels:
elementwise``; the compiled module ``astrai_elementwise._rotary_emb`` is imported by the core
only when the op first runs. What the binary really holds (CUDA version, SASS and PTX
archs) comes from ``build_info.json``, written by the build next to the module. What the
kernels serve (dtypes, page dtypes, min arch) is stated once, in
:mod:`astrai_elementwise.capabilities`; the ops' specs below and the C++ read it.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

from . import capabilities

__all__ = ["build_info", "manifest"]

API_VERSION = 1
CORE_REQUIRES = ">=0.1.0,<0.2.0"

_COMMON: dict[str, Any] = {
    "module": "astrai_elementwise._rotary_emb",
    "abi": 1,
    "dtypes": list(capabilities.DTYPES),
    "min_sm": capabilities.MIN_SM,
}

_OPS: dict[str, dict[str, Any]] = {
    # rotary(...): one or two tensors, forward and inverse, positions
    "rotary_emb": dict(_COMMON),
    # q rotated, k rotated + v written into paged KV cache, one launch; fp8 pages quantized
    "rope_paged_append": {**_COMMON, "kv_dtypes": list(capabilities.FP8_KV_DTYPES)},
    # transformers' LlamaRMSNorm, one block per row
    "rms_norm": dict(_COMMON),
    # residual += x, then x = rms_norm(residual), in place, one launch
    "fused_add_rms_norm": dict(_COMMON),
    # silu(gate) * up of a fused gate/up projection
    "silu_and_mul": dict(_COMMON),
}


def build_info() -> dict[str, Any]:
    """The build's record: version, cuda, nvcc_version, sass_archs, ptx_archs, no_mma, modules."""
    return json.loads(files(__name__).joinpath("build_info.json").read_text(encoding="utf-8"))


def manifest() -> dict[str, Any]:
    info = build_info()
    return {
        "api_version": API_VERSION,
        "name": "astrai-elementwise",
        "version": info["version"],
        "core_requires": CORE_REQUIRES,
        "cuda": info["cuda"],
        "sass_archs": list(info["sass_archs"]),
        "ptx_archs": list(info["ptx_archs"]),
        "ops": {name: dict(spec) for name, spec in _OPS.items()},
    }
