"""The packaging scripts run from any Python: started with an interpreter that lacks the
build tools, they say so and continue under the project venv, never with a raw
ModuleNotFoundError."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"


def _lacks(python: Path, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is not None)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


@pytest.fixture
def bare_python() -> Path:
    if not BASE_PYTHON.exists() or Path(sys.prefix) == Path(sys.base_prefix):
        pytest.skip("needs the tests to run in a venv over a base interpreter")
    if not _lacks(BASE_PYTHON, "hatchling"):
        pytest.skip(f"{BASE_PYTHON} has the build tools itself")
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("the scripts fall back to the project venv, which is not the one running the tests")
    return BASE_PYTHON


def _run(python: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "ASTRAI_CI_REEXEC")}
    return subprocess.run([str(python), *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_build_wheels_continues_under_the_project_venv(bare_python):
    result = _run(bare_python, "ci/build-wheels", "--cuda", "13.0", "--plugins", "no-such-plugin")
    assert "Traceback" not in result.stderr and "ModuleNotFoundError" not in result.stderr, result.stderr
    assert "lacks build, hatchling" in result.stderr
    assert f"running under {ROOT / '.venv' / 'bin' / 'python'}" in result.stderr
    assert result.returncode != 0 and "no plugin package for ['no-such-plugin']" in result.stderr


def test_check_conda_continues_under_the_project_venv(bare_python):
    result = _run(bare_python, "ci/check-conda", "--help")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "running under" in result.stderr
    assert "usage:" in result.stdout


def test_build_wheels_documents_python():
    result = subprocess.run([sys.executable, "ci/build-wheels", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--python PYTHON" in result.stdout and "no matching wheel" in result.stdout


def test_python_tag_of_another_interpreter():
    spec = importlib.util.spec_from_file_location("project_python", ROOT / "ci" / "project_python.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.python_tag() == "cp%d%d" % sys.version_info[:2]
    assert module.python_tag(str(BASE_PYTHON)) == "cp%d%d" % sys.version_info[:2]  # the venv's base
