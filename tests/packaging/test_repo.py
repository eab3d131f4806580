"""The repository's promises: README quick start, CI entry point, layout."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", readme, re.S)[1]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_starts_with_exactly_two_commands():
    main_job, tests = quick_start_commands()
    assert "astrai doctor" in main_job and "astrai generate --preset tiny" in main_job
    assert "pytest tests" in tests


def test_ci_runs_the_readme_test_command():
    """First, verbatim, and failing the run (set -e); the vLLM group (its own venv) may follow."""
    _, tests = quick_start_commands()
    text = (ROOT / ".ci/run").read_text()
    ci = [line for line in text.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci[0] == tests and "set -euo pipefail" in text
    assert all(line.strip() in ("else", "fi") or "vllm" in line for line in ci[1:])  # only the vLLM step after it


def test_layout_of_the_design():
    for path in ("README.md", "pixi.toml", "packages/astrai", "recipe", "ci", "docs", "tests", ".ci/run", "bench",
                 "tests/helpers", "tests/gpu"):
        assert (ROOT / path).exists(), path
    # tests by op family: no test module left at the top of tests/ or tests/gpu/
    assert not list((ROOT / "tests").glob("test_*.py")) and not list((ROOT / "tests" / "gpu").glob("test_*.py"))
    # benchmarks, profilers and sanitizer drivers live in bench/, not among the tests
    assert not [p for p in (ROOT / "tests").rglob("*.py") if p.name.startswith(("bench_", "profile_", "sanitize"))]
