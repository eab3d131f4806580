"""docs/architecture.md's "Where each op lives" table against the tree and the manifests:
every path it names exists, and every op a plugin manifest declares has its row (and no
row names an op no manifest declares). The manifests come from each plugin's own
``manifest()``, given a made-up build record (nothing is compiled or installed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from build_helpers import plugin_manifest_of

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Where each op lives"
PLUGINS = ("attention", "rotary", "fp8")
# a build with every optional piece (the Hopper kernels, the mma kernels)
BUILD_INFO = {"version": "0.1.0+cu130", "cuda": "13.0", "nvcc_version": "13.0", "sass_archs": ["sm_90a"],
              "ptx_archs": ["compute_90"], "no_mma": False, "modules": {}}


def _rows() -> dict[str, str]:
    """op -> its table row."""
    text = DOC.read_text()
    assert SECTION in text, f"docs/architecture.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        found = re.match(r"\| `(\w+)` \|", line)
        if found:
            assert found.group(1) not in rows, f"two rows for {found.group(1)}"
            rows[found.group(1)] = line
    return rows


def _repo_path(written: str) -> Path:
    """The table's shorthand: extension/... is the core's, astrai-*/... a plugin package's."""
    if written.startswith("extension/"):
        return ROOT / "packages" / "astrai" / "src" / "astrai" / written
    if written.startswith(("astrai-", "cuda-common/")):
        return ROOT / "packages" / written
    return ROOT / written


def _declared_ops() -> dict[str, str]:
    """op -> the plugin whose manifest declares it."""
    ops = {}
    for plugin in PLUGINS:
        package = ROOT / "packages" / f"astrai-{plugin}" / "src" / f"astrai_{plugin}"
        manifest = plugin_manifest_of(package, f"_astrai_{plugin}_doc_check", build_info=BUILD_INFO)
        ops.update(dict.fromkeys(manifest["ops"], f"astrai-{plugin}"))
    return ops


def test_every_declared_op_has_a_row():
    rows, declared = _rows(), _declared_ops()
    missing = {op: plugin for op, plugin in declared.items() if op not in rows}
    assert not missing, f"ops without a row in docs/architecture.md ({SECTION!r}): {missing}"
    assert not set(rows) - set(declared), f"rows for ops no manifest declares: {sorted(set(rows) - set(declared))}"


@pytest.mark.parametrize("op", sorted(_rows()))
def test_every_path_in_the_row_exists(op):
    cells = _rows()[op].strip("|").split("|")
    assert len(cells) == 9, f"{op}: expected 9 columns, got {len(cells)}"
    for column, cell in enumerate(cells[1:], start=1):
        paths = [p for p in re.findall(r"`([^`]+)`", cell) if "/" in p]
        assert paths, f"{op}: column {column} names no file"
        missing = [p for p in paths if not _repo_path(p).is_file()]
        assert not missing, f"{op}: column {column} names files that do not exist: {missing}"
