"""ci/reliability-report turns pytest's JUnit XML into the table of docs/reliability.md."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "reliability-report"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
  <testcase classname="tests.test_faults" name="test_kernel_image_failure_at_first_launch_falls_back_with_one_warning[no kernel image]" time="0.1"/>
  <testcase classname="tests.test_faults" name="test_kernel_image_failure_at_first_launch_falls_back_with_one_warning[invalid device function]" time="0.1"/>
  <testcase classname="tests.test_input_sweep" name="test_rotary_float_view_at_an_odd_storage_offset[dtype0]" time="0.1">
    <skipped type="pytest.xfail" message="backend/rotary.py:109 ..."/></testcase>
  <testcase classname="tests.test_input_sweep" name="test_attention_matches_reference" time="2.0">
    <failure message="AssertionError">boom</failure></testcase>
  <testcase classname="tests.gpu.test_graphs_compile_gpu" name="test_op_under_cuda_graph_capture[rotary_emb]" time="0">
    <skipped type="pytest.skip" message="needs a CUDA device"/></testcase>
  <testcase classname="tests.test_new" name="test_something_new" time="0"/>
</testsuite></testsuites>
"""


def load_script():
    loader = importlib.machinery.SourceFileLoader("reliability_report", str(SCRIPT))
    spec = importlib.util.spec_from_loader("reliability_report", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_regenerates_the_table_between_the_markers(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text(JUNIT)
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\nbefore\n\n<!-- reliability-table:start -->\nstale\n<!-- reliability-table:end -->\n\nafter\n")
    run = subprocess.run([sys.executable, str(SCRIPT), str(junit), "--doc", str(doc)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "5 test functions, 3 cases passed, 1 xfail, 1 failed" in run.stdout
    text = doc.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith("\nafter\n") and "stale" not in text
    rows = {re.search(r"`[\w.]+::(\w+)`", line)[1]: [c.strip() for c in line.split("|")[1:-1]]
            for line in text.splitlines() if line.startswith("| ") and "`" in line}
    image = rows["test_kernel_image_failure_at_first_launch_falls_back_with_one_warning"]
    assert image[0] == "faults" and image[3:8] == ["2", "2", "0", "0", "0"] and "one warning" in image[8]
    assert rows["test_rotary_float_view_at_an_odd_storage_offset"][8].startswith("known bug, xfail")
    assert rows["test_attention_matches_reference"][8].startswith("**FAILING**")
    assert rows["test_op_under_cuda_graph_capture"][8] == "not run here"
    assert rows["test_something_new"][:2] == ["other", "something new"]
    # --check: the document is now current; a different result makes it stale
    ok = subprocess.run([sys.executable, str(SCRIPT), str(junit), "--doc", str(doc), "--check"])
    assert ok.returncode == 0
    junit.write_text(JUNIT.replace('<failure message="AssertionError">boom</failure>', ""))
    stale = subprocess.run([sys.executable, str(SCRIPT), str(junit), "--doc", str(doc), "--check"], capture_output=True)
    assert stale.returncode == 1


def test_document_has_the_markers_and_the_catalogue_names_real_tests():
    script = load_script()
    doc = (ROOT / "docs" / "reliability.md").read_text()
    assert doc.count(script.START) == 1 and doc.count(script.END) == 1
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    missing = [name for name in script.CATALOGUE if f"def {name}(" not in sources]
    assert not missing, f"catalogue entries without a test: {missing}"
