"""AstrAI rotary plugin: the manifest of its compiled module, and nothing compiled.

The core's registry calls :func:`manifest` through the entry point ``astrai.kernels:
rotary``; the compiled module ``astrai_rotary._rotary_emb`` is imported by the core
only when the op first runs. What the binary really holds (CUDA version, SASS and PTX
archs) comes from ``build_info.json``, written by the build next to the module.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

__all__ = ["build_info", "manifest"]

API_VERSION = 1
CORE_REQUIRES = ">=0.1.0,<0.2.0"

# What the kernels serve, stated once: the core's policies read these dtypes. The rotary ops
# take both pair layouts (interleaved and NeoX), partial rotary and any even head_dim; the
# norm ops any hidden size (in registers up to 32768 bf16/fp16 or 16384 fp32 channels).
_DTYPES = ["float16", "bfloat16", "float32"]

_OPS: dict[str, dict[str, Any]] = {
    "rotary_emb": {  # rotary(...): one or two tensors, forward and inverse, positions
        "module": "astrai_rotary._rotary_emb",
        "abi": 1,
        "dtypes": _DTYPES,
        "min_sm": 80,
    },
    "rope_paged_append": {  # q rotated, k rotated + v written into paged KV cache, one launch
        "module": "astrai_rotary._rotary_emb",
        "abi": 1,
        "dtypes": _DTYPES,
        "kv_dtypes": ["float8_e4m3fn", "float8_e5m2"],  # fp8 pages, quantized (the module's KV_DTYPES)
        "min_sm": 80,
    },
    "rms_norm": {  # transformers' LlamaRMSNorm, one block per row
        "module": "astrai_rotary._rotary_emb",
        "abi": 1,
        "dtypes": _DTYPES,
        "min_sm": 80,
    },
    "fused_add_rms_norm": {  # residual += x, then x = rms_norm(residual), in place, one launch
        "module": "astrai_rotary._rotary_emb",
        "abi": 1,
        "dtypes": _DTYPES,
        "min_sm": 80,
    },
    "silu_and_mul": {  # silu(gate) * up of a fused gate/up projection
        "module": "astrai_rotary._rotary_emb",
        "abi": 1,
        "dtypes": _DTYPES,
        "min_sm": 80,
    },
}


def build_info() -> dict[str, Any]:
    """The build's record: version, cuda, nvcc_version, sass_archs, ptx_archs, no_mma, modules."""
    return json.loads(files(__name__).joinpath("build_info.json").read_text(encoding="utf-8"))


def manifest() -> dict[str, Any]:
    info = build_info()
    return {
        "api_version": API_VERSION,
        "name": "astrai-rotary",
        "version": info["version"],
        "core_requires": CORE_REQUIRES,
        "cuda": info["cuda"],
        "sass_archs": list(info["sass_archs"]),
        "ptx_archs": list(info["ptx_archs"]),
        "ops": {name: dict(spec) for name, spec in _OPS.items()},
    }
