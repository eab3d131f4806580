"""ci/check-pip-install: "astrai[fp8]" and "astrai[all]" from the per-CUDA indexes, pip into fresh venvs.

* Real wheels, CUDA 13.0 (always): the builds the other tests share, cached per source tree
  by tests/helpers/wheel_cache.py: astrai-attention for sm_90a (no PTX), astrai-fp8 of
  tests/fp8/test_fp8_plugin.py (sm_89 + sm_90a + sm_120 + PTX) and astrai-elementwise of the
  packaging tests (sm_80 + sm_90a + PTX); the script indexes them, serves the index on
  127.0.0.1 and checks each venv with `astrai doctor --json` and ci/wheel-tests; the
  wheels are held to ci/wheel-budget.toml too.
* Real wheels, CUDA 12.4: the same with the Debian 12.4 toolkit, when asked for with
  ASTRAI_TEST_CUDA12=1 (it needs `ci/provision-cuda12` to have run: a 1 GB download, and
  three more plugin builds; CI does not provision it, so CI runs the CUDA 13.0 half).
* Stand-in wheels (pure Python: manifest, entry point, a build_info()) for what the script
  must refuse: a build of the wrong CUDA version published on an index.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from wheel_cache import ATTENTION_ARCHS, FP8_ARCHS, ROTARY_ARCHS, cuda_tag, plugin_wheel

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "ci" / "check-pip-install"
PLUGINS = ("attention", "elementwise", "fp8")
ONE_ARCH = "90a"  # CUDA 12.4: every plugin for one arch (the FP8 plugin needs sm_89+)

pytestmark = pytest.mark.slow


def _check(wheels: Path, work: Path, *cudas: str, extras: str = "fp8,all") -> tuple[subprocess.CompletedProcess, dict]:
    args = [sys.executable, str(CHECK), "--wheels", str(wheels), "--work", str(work), "--extras", extras]
    for cuda in cudas:
        args += ["--cuda", cuda]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    report = work / "pip-install-report.json"
    return proc, json.loads(report.read_text()) if report.exists() else {}


def _real_wheelhouse(cuda: str, folder: Path) -> Path:
    """folder/cu<ver>/ with the three plugin wheels of one CUDA version (no core: the script builds it)."""
    dest = folder / cuda_tag(cuda)
    dest.mkdir(parents=True)
    for plugin in PLUGINS:
        if cuda == "13.0":  # the builds the other tests make
            archs = {"attention": ATTENTION_ARCHS, "elementwise": ROTARY_ARCHS, "fp8": FP8_ARCHS}[plugin]
            wheel = plugin_wheel(plugin, cuda, archs, ptx=plugin != "attention")
        else:
            wheel = plugin_wheel(plugin, cuda, ONE_ARCH)
        shutil.copy2(wheel, dest / wheel.name)
    return folder


def _assert_within_budget(wheels: Path) -> None:
    """The same wheels against ci/wheel-budget.toml (tests/packaging/test_wheel_budget.py checks rotary only)."""
    found = sorted(wheels.glob("*/astrai_*.whl"))
    budget = subprocess.run([sys.executable, str(ROOT / "ci" / "check-wheel-size"), *map(str, found)],
                            capture_output=True, text=True)
    assert budget.returncode == 0, budget.stdout + budget.stderr
    assert budget.stdout.count(" ok\n") == len(PLUGINS), budget.stdout


def _assert_installs(proc: subprocess.CompletedProcess, report: dict, cuda: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    tag = cuda_tag(cuda)
    installs = {r["extra"]: r for r in report["installs"] if r["cuda"] == cuda}
    assert set(installs) == {"fp8", "all"}, out
    want = {"fp8": {"astrai-fp8"}, "all": {"astrai-attention", "astrai-elementwise", "astrai-fp8"}}
    for extra, plugins in want.items():
        result = installs[extra]
        assert result["problems"] == [], out
        assert result["installed"] == {"astrai": "0.1.0", **{p: f"0.1.0+{tag}" for p in plugins}}, out
        doctor = {row["name"]: row for row in result["doctor"]}
        assert set(doctor) == plugins
        for row in doctor.values():
            assert (row["version"], row["cuda"], row["usable"]) == (f"0.1.0+{tag}", cuda, False), row
            assert "no CUDA device" in row["reason"]
        assert result["wheel_tests"].split()[1] == "passed", result["wheel_tests"]
    for plugin in want["all"]:
        assert f"astrai doctor: {plugin} 0.1.0+{tag} CUDA {cuda} " in proc.stdout
    assert proc.stdout.rstrip().endswith("check-pip-install: ok (2 installs)")


def test_cuda13_wheels_install_per_extra(tmp_path):
    wheels = _real_wheelhouse("13.0", tmp_path / "wheels")
    _assert_within_budget(wheels)
    proc, report = _check(wheels, tmp_path / "work", "13.0")
    _assert_installs(proc, report, "13.0")
    fp8 = next(r for r in report["installs"] if r["extra"] == "fp8")
    assert fp8["doctor"][0]["sass_archs"] == ["sm_89", "sm_90a", "sm_120"]
    assert fp8["doctor"][0]["ptx_archs"] == ["compute_120"]


def _cuda12_requested() -> bool:
    return os.environ.get("ASTRAI_TEST_CUDA12") == "1"


@pytest.mark.skipif(not _cuda12_requested(), reason="CUDA 12.4 builds: set ASTRAI_TEST_CUDA12=1 "
                    "(needs ci/provision-cuda12; CI runs the CUDA 13.0 half)")
def test_cuda12_wheels_install_per_extra(tmp_path):
    found = subprocess.run([str(ROOT / "ci" / "provision-cuda12"), "--check"], capture_output=True, text=True)
    assert found.returncode == 0, "ASTRAI_TEST_CUDA12=1 but no CUDA 12.4 toolkit: run ci/provision-cuda12 first"
    wheels = _real_wheelhouse("12.4", tmp_path / "wheels")
    _assert_within_budget(wheels)
    proc, report = _check(wheels, tmp_path / "work", "12.4")
    _assert_installs(proc, report, "12.4")


# -- what the check must refuse (stand-in wheels, no build) ---------------------------------------


def _stand_in_wheel(folder: Path, plugin: str, cuda: str) -> Path:
    """A pure-Python plugin wheel: manifest, entry point, build_info() naming `cuda`."""
    version = f"0.1.0+{cuda_tag(cuda)}"
    package = f"astrai_{plugin}"
    manifest = {"api_version": 1, "name": f"astrai-{plugin}", "version": version, "core_requires": ">=0.1.0,<0.2.0",
                "cuda": cuda, "sass_archs": ["sm_90a"], "ptx_archs": ["compute_90"],
                "ops": {f"{plugin}_op": {"module": f"{package}._stand_in", "abi": 1, "dtypes": ["bfloat16"]}}}
    info = f"{package}-{version}.dist-info"
    files = {
        f"{package}/__init__.py": "import json\nfrom importlib.resources import files\n\n\ndef manifest():\n"
                                  "    return json.loads(files(__package__).joinpath('manifest.json').read_text())\n",
        f"{package}/manifest.json": json.dumps(manifest),
        f"{package}/_stand_in.py": f"def build_info():\n    return {{'cuda_version': '{cuda}'}}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: astrai-{plugin}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[astrai.kernels]\n{plugin} = {package}:manifest\n",
    }
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for name, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


def test_a_build_of_the_wrong_cuda_on_the_index_fails(tmp_path):
    """A +cu124 FP8 wheel published on the cu130 index: pip takes it (0.1.0 matches any local
    tag), the check does not."""
    folder = tmp_path / "wheels" / "cu130"
    _stand_in_wheel(folder, "attention", "13.0")
    _stand_in_wheel(folder, "elementwise", "13.0")
    _stand_in_wheel(folder, "fp8", "12.4")
    proc, report = _check(tmp_path / "wheels", tmp_path / "work", "13.0", extras="fp8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = "\n".join(report["installs"][0]["problems"])
    assert "astrai-fp8 0.1.0+cu124 installed, wanted 0.1.0+cu130" in problems
    assert "astrai doctor reports astrai-fp8 0.1.0+cu124 CUDA 12.4, wanted CUDA 13.0" in problems
    assert "ci/wheel-tests failed" in problems  # ASTRAI_EXPECT_CUDA=13.0
    assert proc.stdout.rstrip().endswith("check-pip-install: 1 of 1 FAILED (1 installs)")


def test_stand_ins_of_the_right_cuda_pass_and_fp8_brings_fp8_only(tmp_path):
    """The same index with the right FP8 build passes: the failure above is the CUDA tag's."""
    folder = tmp_path / "wheels" / "cu130"
    for plugin in PLUGINS:
        _stand_in_wheel(folder, plugin, "13.0")
    proc, report = _check(tmp_path / "wheels", tmp_path / "work", "13.0", extras="fp8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["installs"][0]["installed"] == {"astrai": "0.1.0", "astrai-fp8": "0.1.0+cu130"}
