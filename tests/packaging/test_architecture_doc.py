"""docs/architecture.md's "Where each op lives" table against the tree and the manifests:
every path it names exists, and every op a plugin manifest declares has its row (and no
row names an op no manifest declares). The manifests come from each plugin's own
``manifest()``, given a made-up build record (nothing is compiled or installed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from build_helpers import declared_ops

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Where each op lives"


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


def test_every_declared_op_has_a_row():
    rows, declared = _rows(), declared_ops()
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
