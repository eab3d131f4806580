"""The rotary plugin's capabilities are stated once, in src/astrai_elementwise/capabilities.py: the
manifest's op specs are built from it, csrc/capabilities.h (the argument checks, their error
messages and KV_DTYPES) is generated from it and the CMake build passes its min arch. No
build: these tests read the sources, and fail where one of them states a capability on its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from build_helpers import FULL_BUILD_INFO, load_module, plugin_manifest_of
from capabilities_checks import (SHARED, assert_nothing_restated, cmake_min_sms, cxx_code, dtype_comparison_chain,
                                 dtype_list_in_a_string, rules_matching)

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "packages" / "astrai-elementwise"
CSRC = PLUGIN / "csrc"
OPS = ("rotary_emb", "rope_paged_append", "rms_norm", "fused_add_rms_norm", "silu_and_mul")
KV_OPS = ("rope_paged_append",)
# the C++ type each dtype's kernels are instantiated for
CXX_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


def _gen():
    return load_module("astrai_elementwise_gen_capabilities", CSRC / "gen_capabilities.py")


@pytest.fixture(scope="module")
def caps():
    return _gen().load_statement()


def test_the_header_is_generated_from_the_statement():
    assert (CSRC / "capabilities.h").read_text() == _gen().render(), "re-run gen_capabilities.py"


def test_the_manifest_states_the_capabilities(caps):
    manifest = plugin_manifest_of(PLUGIN / "src" / "astrai_elementwise", "_astrai_elementwise_capabilities",
                                  build_info=FULL_BUILD_INFO)
    assert sorted(manifest["ops"]) == sorted(OPS)
    for name, spec in manifest["ops"].items():
        assert spec["dtypes"] == list(caps.DTYPES), name
        assert spec["min_sm"] == caps.MIN_SM, name
        assert "head_dims" not in spec, name  # any even head_dim, any hidden size
        assert spec.get("kv_dtypes") == (list(caps.FP8_KV_DTYPES) if name in KV_OPS else None), name
    assert set(caps.FP8_KV_SOURCE_DTYPES) <= set(caps.DTYPES)


def test_the_build_passes_the_min_arch(caps):
    assert cmake_min_sms(PLUGIN / "CMakeLists.txt") == {"_rotary_emb": caps.MIN_SM}


def _sources() -> list[Path]:
    sources = [p for p in sorted(CSRC.iterdir()) if p.suffix in (".h", ".cuh", ".cu") and p.name != "capabilities.h"]
    assert len(sources) >= 6
    return sources


def test_every_dtype_switch_launches_every_dtype(caps):
    """The dispatch keeps its switches (a default branch, in their own order); each must reach a
    kernel of every stated dtype."""
    switches = []
    for path in _sources():
        switches += [(path.name, body) for body in
                     re.findall(r"switch\s*\(\s*[\w.>-]*dtype\s*\)\s*\{(.*?)\n\s*\}", cxx_code(path.read_text()), re.S)]
    assert len(switches) == 3, switches  # the rotary launch, rms_norm, silu_and_mul
    for name, body in switches:
        for dtype in caps.DTYPES:
            assert re.search(rf"<\s*{CXX_TYPES[dtype]}\s*[,>]", body), (name, dtype, body)


def _restatements(caps) -> list[tuple[str, str]]:
    stated = (*caps.DTYPES, *caps.FP8_KV_DTYPES)
    rules = [dtype_list_in_a_string(stated), dtype_comparison_chain(stated)]
    for name in caps.FP8_KV_DTYPES:
        enum = SHARED.DTYPE_ENUMERATORS[name]
        rules.append((rf'"{name}"', f"the page dtype name {name}"))
        rules.append((rf"==\s*DType::{enum}\b", f"a comparison with DType::{enum}"))
    return rules


# Sources that may still spell a stated list, and why: the paged append maps its page dtype to
# the kernel's fp8 format (Fp8Out), a second mapping of the page dtypes.
ALLOWED = {"rotary_emb.cu": ("a comparison with DType::Float8E4M3",)}


def test_no_source_states_a_capability_on_its_own(caps):
    assert_nothing_restated(_sources(), _restatements(caps), ALLOWED)


def test_the_check_sees_a_restated_dtype(caps):
    """The scan above is no formality: a hand-written check, message or name would be caught."""
    rules = _restatements(caps)
    assert rules_matching(rules, 'bool f(DType t) { return t == DType::Float32 || t == DType::Float16; }\n'
                                 'ASTRAI_CHECK(ok, "x: expected float16 or bfloat16, got ", n);  // "float8_e5m2"\n'
                                 'm.attr("KV_DTYPES") = py::make_tuple("float8_e4m3fn");') == {
        "a dtype comparison chain", "a dtype list in a string", "the page dtype name float8_e4m3fn"}
    assert not rules_matching(rules, 't.dtype == DType::Int32 || t.dtype == DType::Int64;  // "float16"')
