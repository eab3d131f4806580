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
    _, tests = quick_start_commands()
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [tests]


def test_layout_of_the_design():
    for path in ("README.md", "pixi.toml", "packages/astrai", "recipe", "ci", "docs", "tests", ".ci/run"):
        assert (ROOT / path).exists(), path
