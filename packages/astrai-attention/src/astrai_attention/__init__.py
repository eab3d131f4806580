"""AstrAI attention plugin: the manifest of its compiled modules, and nothing compiled.

The core's registry calls :func:`manifest` through the entry point ``astrai.kernels:
attention``; the compiled modules ``astrai_attention._attn_*`` are imported by the core
only when an op first runs. What the binaries hold (CUDA version, SASS and PTX archs)
comes from ``build_info.json``, written by the build next to the modules. The launch
heuristics live in one place, ``csrc/heuristics.h``; the compiled modules expose them
(``decode_plan``, ``prefill_plan``, ``Q_TILE_ROWS``, ``MAX_SPLITS``). What the kernels
serve (dtypes, head dims, page dtypes, variants, min arch) is stated once, in
:mod:`astrai_attention.capabilities`; the ops' specs below and the C++ read it.
"""

from __future__ import annotations

import copy
import json
from importlib.resources import files
from typing import Any

from . import capabilities, prefill_table

__all__ = ["build_info", "manifest"]

API_VERSION = 1
CORE_REQUIRES = ">=0.1.0,<0.2.0"
# the manifest keys copied from the build's record (build_info.json)
FROM_BUILD = ("version", "cuda", "sass_archs", "ptx_archs")

_COMMON: dict[str, Any] = {
    "abi": 1,
    "dtypes": list(capabilities.DTYPES),
    "head_dims": list(capabilities.HEAD_DIMS),
    "min_sm": capabilities.MIN_SM,
    "variants": list(capabilities.VARIANTS),
}

FP8_KV_DTYPES = capabilities.FP8_KV_DTYPES

_OPS: dict[str, dict[str, Any]] = {
    op: {"module": f"astrai_attention._{op}", **_COMMON}
    for op in ("attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill")
}


def build_info() -> dict[str, Any]:
    """The build's record: version, cuda, nvcc_version, sass_archs, ptx_archs, no_mma, modules."""
    return json.loads(files(__name__).joinpath("build_info.json").read_text(encoding="utf-8"))


def _ops(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The op specs; with sm_90a code, dense prefill carries its measured table against torch
    SDPA (manifest key ``prefer``: the core runs it only where the table says it is faster)."""
    ops = {name: dict(spec) for name, spec in _OPS.items()}
    if not info.get("no_mma"):  # the paged mma kernels read FP8 pages (their modules' KV_DTYPES)
        ops["attn_paged_decode"]["kv_dtypes"] = list(FP8_KV_DTYPES)
        ops["attn_paged_prefill"]["kv_dtypes"] = list(FP8_KV_DTYPES)
    table = prefill_table.load() if "sm_90a" in info["sass_archs"] else None
    if table is not None:
        ops["attn_prefill"]["prefer"] = {"90": table}
    return ops


def manifest() -> dict[str, Any]:
    info = build_info()
    return {"api_version": API_VERSION, "name": "astrai-attention", "core_requires": CORE_REQUIRES,
            **{key: copy.copy(info[key]) for key in FROM_BUILD}, "ops": _ops(info)}
