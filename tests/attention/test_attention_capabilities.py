"""The attention plugin's capabilities are stated once, in src/astrai_attention/capabilities.py:
the manifest's op specs are built from it, csrc/capabilities.h (the C++ dispatch switches,
static_asserts, argument checks, error messages, KV_DTYPES and VARIANTS) is generated from it,
gen_wgmma.py takes its P.V widths from it and the CMake build passes its min arch. No build:
these tests read the sources, and fail where one of them states a capability on its own."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from build_helpers import load_module

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "packages" / "astrai-attention"
CSRC = PLUGIN / "csrc"
OPS = ("attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill")
PAGED_OPS = ("attn_paged_decode", "attn_paged_prefill")


def _gen(name: str):
    return load_module(f"astrai_attn_{name}", CSRC / f"{name}.py")


@pytest.fixture(scope="module")
def caps():
    return _gen("gen_capabilities").load_statement()


def _plugin_package():
    """The plugin's Python package from the source tree (its manifest code, nothing compiled)."""
    import importlib.util

    package = PLUGIN / "src" / "astrai_attention"
    spec = importlib.util.spec_from_file_location("astrai_attention", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    plugin = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("astrai_attention", plugin)
    spec.loader.exec_module(plugin)
    return plugin


def test_the_header_is_generated_from_the_statement():
    assert (CSRC / "capabilities.h").read_text() == _gen("gen_capabilities").render(), "re-run gen_capabilities.py"


def test_the_manifest_states_the_capabilities(caps):
    plugin = _plugin_package()
    for no_mma in (False, True):
        ops = plugin._ops({"sass_archs": [], "no_mma": no_mma})
        assert sorted(ops) == sorted(OPS)
        for name, spec in ops.items():
            assert spec["dtypes"] == list(caps.DTYPES), name
            assert spec["head_dims"] == list(caps.HEAD_DIMS), name
            assert spec["variants"] == list(caps.VARIANTS), name
            assert spec["min_sm"] == caps.MIN_SM, name
            want_kv = list(caps.FP8_KV_DTYPES) if name in PAGED_OPS and not no_mma else None
            assert spec.get("kv_dtypes") == want_kv, (name, no_mma)


def test_the_build_passes_the_min_arch(caps):
    cmake = re.sub(r"#.*", "", (PLUGIN / "CMakeLists.txt").read_text())
    modules = re.findall(r"astrai_add_kernel_module\(([^)]*)\)", cmake)
    assert modules, "no astrai_add_kernel_module call"
    for args in modules:
        m = re.search(r"\bMIN_SM\s+(\d+)", args)
        assert m and int(m.group(1)) == caps.MIN_SM, f"astrai_add_kernel_module({args}): MIN_SM {caps.MIN_SM}"


def test_the_wgmma_widths_are_the_head_dims(caps):
    assert tuple(_gen("gen_wgmma").RS_WIDTHS) == tuple(caps.HEAD_DIMS)
    ops = (CSRC / "wgmma_ops.cuh").read_text()
    assert sorted(int(n) for n in re.findall(r"struct WgmmaRS<__nv_bfloat16, (\d+)>", ops)) == sorted(caps.HEAD_DIMS)


def _code(text: str) -> str:
    """C++ without its comments (string literals kept)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _restatements(caps) -> list[tuple[str, str]]:
    """(regex, what) of the ways a C++ source spells a stated list on its own: any head dim,
    stated or not, in a head_dim switch, comparison chain, launch or message."""
    found = [
        (r"switch\s*\(\s*(?:head_dim|D_?|d)\s*\)\s*\{[^}]*?\bcase\s+\d+\s*:", "a head-dim case label"),
        (r"\b(?:head_dim|D_?|d)\s*==\s*\d+\s*\|\|\s*\w+\s*==\s*\d+", "a head-dim comparison chain"),
        (r"\blaunch_(?:decode|prefill)_d<\s*\w+\s*,\s*\d+", "a launch at a literal head dim"),
        (r'"[^"\n]*\b\d+(?:, \d+)* or \d+\b[^"\n]*"', "a head-dim list in a string"),
        (r'"[^"\n]*\b(?:' + "|".join(caps.DTYPES) + r') or \w+[^"\n]*"', "a dtype list in a string"),
    ]
    gen = _gen("gen_capabilities")
    for name in caps.FP8_KV_DTYPES:
        found.append((rf'"{name}"', f"the page dtype name {name}"))
        enum = gen.CXX_KV_DTYPES[name][0]
        found.append((rf"==\s*DType::{enum}\b", f"a comparison with DType::{enum}"))
    return found


# Sources that may still spell a stated list, and why (the KV append quantizes into either fp8
# format through cuda_fp8.h's interpretation, a second mapping of the page dtypes).
ALLOWED = {"kv_append.cuh": ("a comparison with DType::Float8E4M3", "a dtype list in a string")}


def test_no_source_states_a_capability_on_its_own(caps):
    generated = {"capabilities.h", "wgmma_ops.cuh"}
    sources = [p for p in sorted(CSRC.iterdir()) if p.suffix in (".h", ".cuh", ".cu") and p.name not in generated]
    assert len(sources) > 10
    problems = []
    for path in sources:
        code = _code(path.read_text())
        for pattern, what in _restatements(caps):
            if what in ALLOWED.get(path.name, ()):
                continue
            for m in re.finditer(pattern, code):
                problems.append(f"{path.name}: {what}: {m.group(0)!r}")
    assert not problems, "state it in capabilities.py and use capabilities.h:\n" + "\n".join(problems)


def test_the_check_sees_a_restated_head_dim(caps):
    """The scan above is no formality: a hand-written switch or assert would be caught."""
    code = _code('switch (head_dim) {\n ASTRAI_ATTN_HEAD_DIMS(X)\n case 96: return launch_decode_d<T, 96, KV>(p);\n}\n'
                 'static_assert(D == 64 || D == 96, "head_dim must be 64 or 96");  // case 80:')
    hits = {what for pattern, what in _restatements(caps) if re.search(pattern, code)}
    assert hits == {"a head-dim case label", "a head-dim comparison chain", "a launch at a literal head dim",
                    "a head-dim list in a string"}
    assert not any(re.search(pattern, _code("switch (bytes) { case 16: break; }  // KvBytes == 1 || KvBytes == 2"))
                   for pattern, _ in _restatements(caps))
