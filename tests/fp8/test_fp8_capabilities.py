"""The FP8 plugin's capabilities are stated once, in src/astrai_fp8/capabilities.py: the
manifest's op specs are built from it, csrc/capabilities.h (the argument checks, their error
messages and the module's doc strings) is generated from it and the CMake build passes its min
arch; the arch constants written by hand (cuda-common's kMinSmForFp8 / kMinSmForWgmma, the
mma.sync kernel's guard, the Hopper entry's device check) are checked against it. No build:
these tests read the sources, and fail where one of them states a capability on its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from build_helpers import FULL_BUILD_INFO, load_module, plugin_manifest_of
from capabilities_checks import (assert_nothing_restated, cmake_min_sms, cxx_code, dtype_comparison_chain,
                                 dtype_list_in_a_string, rules_matching)

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "packages" / "astrai-fp8"
CSRC = PLUGIN / "csrc"
DEVICE_H = REPO / "packages" / "cuda-common" / "include" / "astrai" / "device.cuh"
# generated from the statement or by gen_wgmma.py
GENERATED = {"capabilities.h", "wgmma_fp8.cuh"}


def _gen():
    return load_module("astrai_fp8_gen_capabilities", CSRC / "gen_capabilities.py")


@pytest.fixture(scope="module")
def caps():
    return _gen().load_statement()


def _manifest(sass_archs):
    return plugin_manifest_of(PLUGIN / "src" / "astrai_fp8", "_astrai_fp8_capabilities",
                              build_info={**FULL_BUILD_INFO, "sass_archs": sass_archs})


def test_the_header_is_generated_from_the_statement():
    assert (CSRC / "capabilities.h").read_text() == _gen().render(), "re-run gen_capabilities.py"


def test_the_manifest_states_the_capabilities(caps):
    want = {"fp8_quantize": caps.QUANTIZE_DTYPES, "fp8_gemm": caps.FP8_DTYPES,
            "fp8_scale_update": caps.SCALE_UPDATE_DTYPES, "fp8_weight_gemm": caps.ACTIVATION_DTYPES}
    wgmma = f"sm_{caps.WGMMA_SM}a"
    for sass_archs in ([wgmma], [f"sm_{caps.MIN_SM}"]):
        ops = _manifest(sass_archs)["ops"]
        assert {name: tuple(spec["dtypes"]) for name, spec in ops.items()} == want
        assert {spec["min_sm"] for spec in ops.values()} == {caps.MIN_SM}
        native = {*caps.MMA_SYNC_NATIVE_SM, *((caps.WGMMA_SM,) if wgmma in sass_archs else ())}
        assert ops["fp8_gemm"]["native_sm"] == sorted(native), sass_archs
        assert list(ops["fp8_gemm"]["prefer"] or {}) == ([str(caps.WGMMA_SM)] if wgmma in sass_archs else [])
    assert min(caps.MMA_SYNC_NATIVE_SM) == caps.MIN_SM


def test_the_build_passes_the_min_arch(caps):
    assert cmake_min_sms(PLUGIN / "CMakeLists.txt") == {"_fp8_ops": caps.MIN_SM}


def test_the_arch_constants_written_by_hand_agree(caps):
    device = cxx_code(DEVICE_H.read_text())
    assert re.search(rf"\bkMinSmForFp8 = {caps.MIN_SM};", device), "cuda-common device.cuh: kMinSmForFp8"
    assert re.search(rf"\bkMinSmForWgmma = {caps.WGMMA_SM};", device), "cuda-common device.cuh: kMinSmForWgmma"
    ops = cxx_code((CSRC / "ops.cu").read_text())
    assert re.search(r"facts\.sm >= kMinSmForFp8\b", ops), "ops.cu checks the device against kMinSmForFp8"
    guard = re.search(r"__CUDA_ARCH__ < (\d+)\s*__trap\(\);", cxx_code((CSRC / "gemm.cuh").read_text()))
    assert guard and int(guard.group(1)) == caps.MIN_SM * 10, "gemm.cuh: the mma.sync kernel's arch guard"
    entry = re.search(r"if \(major != (\d+) \|\| minor != (\d+)\)", cxx_code((CSRC / "gemm/sm90/entry.cu").read_text()))
    assert entry and 10 * int(entry.group(1)) + int(entry.group(2)) == caps.WGMMA_SM, "entry.cu: the sm_90 check"


def _sources() -> list[Path]:
    sources = [p for p in sorted(CSRC.rglob("*")) if p.suffix in (".h", ".cuh", ".cu")
               and p.name not in GENERATED and "tests" not in p.relative_to(CSRC).parts]
    assert len(sources) > 20
    return sources


def _restatements(caps) -> list[tuple[str, str]]:
    stated = tuple(dict.fromkeys((*caps.FP8_DTYPES, *caps.QUANTIZE_DTYPES, *caps.ACTIVATION_DTYPES)))
    rules = [dtype_list_in_a_string(stated), dtype_comparison_chain(stated)]
    for sm in dict.fromkeys((caps.MIN_SM, *caps.MMA_SYNC_NATIVE_SM)):
        rules.append((rf'"[^"\n]*\bsm_{sm}\b[^"\n]*"', f"the arch sm_{sm} in a string"))
    return rules


def test_no_source_states_a_capability_on_its_own(caps):
    assert_nothing_restated(_sources(), _restatements(caps), {})


def test_the_check_sees_a_restated_capability(caps):
    """The scan above is no formality: a hand-written check, message or arch would be caught."""
    rules = _restatements(caps)
    assert rules_matching(rules, 'ASTRAI_CHECK(x.dtype == DType::BFloat16 || x.dtype == DType::Float16,\n'
                                 '             "x: expected bfloat16 or float16, got ", n);  // "needs sm_89"\n'
                                 'm.doc() = "FP8 ops, sm_89+";') == {
        "a dtype comparison chain", "a dtype list in a string", "the arch sm_89 in a string"}
    assert not rules_matching(rules, 'bool e4 = t == DType::Float8E4M3;  // "float16 or bfloat16"')
