"""The plugin wheel size budget (ci/wheel-budget.toml) holds, and ci/check-wheel-size enforces it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from wheel_cache import rotary_wheel_dir

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "ci" / "check-wheel-size"


@pytest.fixture(scope="module")
def rotary_wheel() -> Path:
    return next(rotary_wheel_dir().glob("astrai_elementwise-*.whl"))


def _check(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *map(str, args)], capture_output=True, text=True)


def test_the_built_wheel_is_within_budget(rotary_wheel):
    result = _check(rotary_wheel)
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if rotary_wheel.name in line)
    assert row.split()[1:3] == ["13.0", "2"] and row.endswith("ok")  # sm_80 + sm_90a


def test_a_wheel_over_budget_fails(rotary_wheel, tmp_path):
    budget = tmp_path / "budget.toml"
    budget.write_text("[astrai-elementwise]\nbase_mb = 0.1\nper_sass_arch_mb = 0.05\n")
    result = _check("--budget", budget, rotary_wheel)
    assert result.returncode == 1
    assert "OVER BUDGET" in result.stdout


def test_a_plugin_without_a_budget_fails(rotary_wheel, tmp_path):
    budget = tmp_path / "budget.toml"
    budget.write_text("[astrai-fp8]\nbase_mb = 9\nper_sass_arch_mb = 1\n")
    result = _check("--budget", budget, rotary_wheel)
    assert result.returncode == 1 and "NO BUDGET for astrai-elementwise" in result.stdout


def test_every_plugin_has_a_budget():
    import tomllib

    budgets = tomllib.loads((ROOT / "ci" / "wheel-budget.toml").read_text())
    plugins = {p.name for p in (ROOT / "packages").glob("astrai-*") if (p / "pyproject.toml").exists()}
    assert plugins and plugins <= set(budgets)
    for name, budget in budgets.items():
        assert budget["base_mb"] > 0 and budget["per_sass_arch_mb"] > 0, name
