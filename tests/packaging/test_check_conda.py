"""ci/check-conda end to end: conda packages from wheels, solved under __cuda, installed.

One real astrai-elementwise wheel (CUDA 13.0, sm_80 + sm_90a: CI-sized; tests/helpers/wheel_cache.py
builds it once per source tree). The other tests use small stand-in wheels (pure Python, the
plugin's manifest and entry point) to show the solver's choice per driver across two
CUDA versions, and ci/check-conda failing on a broken recipe.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from wheel_cache import PY, rotary_wheel_dir

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "ci" / "check-conda"


@pytest.fixture(scope="module")
def rotary_wheels() -> Path:
    return rotary_wheel_dir()


def _check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=900)


def _fake_plugin_wheel(folder: Path, cuda: str, name: str = "elementwise") -> Path:
    """A pure-Python stand-in of a plugin wheel: manifest, entry point, a build_info() module."""
    tag = "cu" + cuda.replace(".", "")
    version = f"0.1.0+{tag}"
    package = f"astrai_{name}"
    manifest = {"api_version": 1, "name": f"astrai-{name}", "version": version, "core_requires": ">=0.1.0,<0.2.0",
                "cuda": cuda, "sass_archs": ["sm_80", "sm_90a"], "ptx_archs": ["compute_90"],
                "ops": {"rotary_emb": {"module": f"{package}._stand_in", "abi": 1, "dtypes": ["bfloat16"]}}}
    path = folder / f"{package}-{version}-{PY}-{PY}-manylinux_2_28_x86_64.whl"
    info = f"{package}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{package}/__init__.py", "import json\nfrom importlib.resources import files\n\n\n"
                       "def manifest():\n    return json.loads(files(__package__).joinpath('manifest.json').read_text())\n")
        wheel.writestr(f"{package}/manifest.json", json.dumps(manifest))
        wheel.writestr(f"{package}/_stand_in.py", f"def build_info():\n    return {{'cuda_version': '{cuda}'}}\n")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: astrai-{name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {PY}-{PY}-x\n")
        wheel.writestr(f"{info}/entry_points.txt", f"[astrai.kernels]\n{name} = {package}:manifest\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_real_wheel_installs_from_the_channel_only_where_a_driver_runs_it(rotary_wheels, tmp_path):
    result = _check("--wheels", str(rotary_wheels), "--work", str(tmp_path))
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "astrai-elementwise 0.1.0 cu130_py" in out  # made from the wheel with the recipe's build string
    scenarios = out.split("\n[")
    cuda13 = next(s for s in scenarios if s.startswith("driver for CUDA 13.0"))
    assert "cu130_py" in cuda13 and "(expected CUDA 13.0)" in cuda13 and "passed" in cuda13
    assert "astrai doctor: astrai-elementwise 0.1.0+cu130 CUDA 13.0" in cuda13
    cuda12 = next(s for s in scenarios if s.startswith("driver for CUDA 12.6"))
    assert "no plugin build runs here" in cuda12 and "__cuda >=13" in cuda12
    no_driver = next(s for s in scenarios if s.startswith("no NVIDIA driver"))
    assert "no plugin build runs here" in no_driver and "core alone: astrai 0.1.0" in no_driver
    assert out.rstrip().endswith("check-conda: ok (3 scenarios)")
    installed = tmp_path / "prefix-cuda130" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert list((installed / "astrai_elementwise").glob("_rotary_emb*.so"))
    assert (tmp_path / "prefix-cuda130" / "conda-meta").is_dir()
    assert os.access(tmp_path / "prefix-cuda130" / "bin" / "astrai", os.X_OK)  # the doctor above ran through it


def test_each_driver_gets_the_newest_cuda_build_it_runs(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for cuda in ("12.4", "13.0"):
        _fake_plugin_wheel(wheels, cuda)
    result = _check("--wheels", str(wheels), "--work", str(tmp_path / "work"), "--solve-only")
    assert result.returncode == 0, result.stdout + result.stderr
    scenarios = {s.split("]")[0]: s for s in result.stdout.split("\n[")[1:]}
    assert "cu130_py" in scenarios["driver for CUDA 13.0"] and "cuda-version 13.0" in scenarios["driver for CUDA 13.0"]
    assert "cu124_py" in scenarios["driver for CUDA 12.6"] and "cuda-version 12.4" in scenarios["driver for CUDA 12.6"]
    assert "__cuda" in scenarios["no NVIDIA driver"]


def test_a_recipe_that_forgets_the_driver_constraint_fails_the_check(tmp_path):
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    shutil.copy(ROOT / "recipe" / "variants.yaml", recipe)
    lines = (ROOT / "recipe" / "recipe.yaml").read_text().splitlines(keepends=True)
    (recipe / "recipe.yaml").write_text("".join(
        line for line in lines if "- __cuda >=" not in line and "- cuda-version >=" not in line))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_plugin_wheel(wheels, "13.0")
    result = _check("--wheels", str(wheels), "--work", str(tmp_path / "work"), "--solve-only",
                    env={"ASTRAI_RECIPE_DIR": str(recipe)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "check-conda: FAILED" in result.stdout
    assert "no NVIDIA driver: picked {'astrai-elementwise': '13.0'}, expected {'astrai-elementwise': None}" in result.stdout


def test_a_wheel_the_recipe_does_not_build_is_refused(tmp_path):
    _fake_plugin_wheel(tmp_path, "11.8")
    result = _check("--wheels", str(tmp_path), "--work", str(tmp_path / "work"))
    assert result.returncode == 2
    assert "the recipe builds astrai-elementwise for (CUDA, Python) in" in result.stderr
    assert "add it to recipe/variants.yaml" in result.stderr


def test_no_wheels_is_a_clear_error(tmp_path):
    result = _check("--wheels", str(tmp_path), "--work", str(tmp_path / "work"))
    assert result.returncode == 2
    assert "no plugin wheel" in result.stderr and "ci/build-wheels" in result.stderr


def _core_like_wheel(folder: Path) -> Path:
    """A pure wheel with a console script and a .data/ script, as the core's build makes them."""
    info = "astrai-0.1.0.dist-info"
    path = folder / "astrai-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("astrai/__init__.py", "")
        wheel.writestr("astrai-0.1.0.data/scripts/astrai-env", "#!python\nprint('env')\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: astrai\nVersion: 0.1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/entry_points.txt", "[console_scripts]\nastrai = astrai.cli.main:main\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.parametrize("noarch", ["python", None])
def test_a_wheel_is_staged_with_its_console_scripts(tmp_path, noarch):
    # the zipfile unpacking this replaced left astrai-0.1.0.data/ in site-packages and wrote no bin/astrai
    sys.path.insert(0, str(ROOT / "ci"))
    from conda_channel import Output, WheelInfo, _stage_wheel

    wheel = WheelInfo(_core_like_wheel(tmp_path), "astrai", "0.1.0", None, "3.12", "any")
    output = Output("astrai", "0.1.0", "0", noarch, (), {}, "", "", "")
    staging = tmp_path / "staging"
    _stage_wheel(wheel, output, staging)
    site, scripts = ("site-packages", "python-scripts") if noarch else ("lib/python3.12/site-packages", "bin")
    script = staging / scripts / "astrai"
    assert script.read_text().startswith("#!/usr/bin/env python\n")  # the activated environment's
    assert "from astrai.cli.main import main" in script.read_text() and os.access(script, os.X_OK)
    assert (staging / scripts / "astrai-env").read_text() == "#!/usr/bin/env python\nprint('env')\n"
    assert (staging / site / "astrai" / "__init__.py").is_file() and not list((staging / site).glob("*.data"))
    assert (staging / site / "astrai-0.1.0.dist-info" / "INSTALLER").read_text() == "conda\n"
