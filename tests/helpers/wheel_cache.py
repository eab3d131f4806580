"""Real plugin wheels for the packaging tests, each built once per source tree.

`plugin_build(plugin, cuda, archs, ptx=True)` runs ci/build-wheels (that plugin only, no core,
ASTRAI_CUDA_ARCHS=archs, ASTRAI_CUDA_PTX=0 unless ptx) into
build/test-wheels/<plugin>-cu<ver>-<archs>[-noptx]-<hash>/, where
the hash covers everything the wheel is built from (the plugin's package, the shared CUDA
files, ci/build-wheels). A later run on the same tree, another test module or another
pytest process reuses it (a lock file serializes concurrent builders); a source change
replaces it.

The rotary wheel every rotary test shares (tests/conftest.py's `rotary_build` session
fixture and `rotary_wheel_dir`) is CUDA 13.0 with sm_80 + sm_90a + PTX: two SASS archs
for the multi-arch checks of tests/packaging/test_plugin_build.py, still CI-sized. The FP8 build of
tests/fp8/test_fp8_plugin.py (FP8_ARCHS) is the one tests/packaging/test_pip_install.py installs, and the
attention wheel there is sm_90a without PTX (ATTENTION_ARCHS), the build whose binaries and
ptxas report tests/attention/test_attention_plugin.py inspects: one build of each per tree.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from build_helpers import require_toolkit
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "test-wheels"
PY = "cp%d%d" % sys.version_info[:2]
ROTARY_ARCHS = "80;90a"
# sm_86 must be skipped (FP8 needs sm_89+); sm_89 / sm_120 native QMMA, sm_90a emulated + wgmma
FP8_ARCHS = "86;89;90a;120"
ATTENTION_ARCHS = "90a"  # the slowest build: one arch, no PTX


def cuda_tag(cuda: str) -> str:
    major, minor = cuda.split(".")
    return f"cu{major}{minor}"


def _source_hash(plugin: str) -> str:
    digest = hashlib.sha256()
    sources = [ROOT / "ci" / "build-wheels"]
    for folder in (ROOT / "packages" / f"astrai-{plugin}", ROOT / "packages" / "cuda-common"):
        sources += sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in sources:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def plugin_build(plugin: str, cuda: str = "13.0", archs: str = "90a", *, ptx: bool = True) -> Path:
    """The ci/build-wheels output folder of one astrai-<plugin> build for this Python:
    cu<ver>/ (the wheel), sdist-cu<ver>/, logs-cu<ver>/, build-report-cu<ver>.json."""
    tag = cuda_tag(cuda)
    prefix = f"{plugin}-{tag}-{re.sub(r'[^0-9a-z]+', '_', archs.lower())}-{'' if ptx else 'noptx-'}"
    folder = CACHE / f"{prefix}{_source_hash(plugin)}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(CACHE / f".{prefix}lock"):
        if list((folder / tag).glob(f"astrai_{plugin}-*-{PY}-*.whl")):
            return folder
        for stale in [*CACHE.glob(f"{prefix}*"), *CACHE.glob(f".{prefix}*")]:
            if stale.is_dir():  # older sources, or a build that was killed
                shutil.rmtree(stale, ignore_errors=True)
        require_toolkit(cuda)
        staging = Path(tempfile.mkdtemp(prefix=f".{prefix}", dir=CACHE))
        env = dict(os.environ, ASTRAI_CUDA_ARCHS=archs, ASTRAI_CUDA_PTX="1" if ptx else "0",
                   CMAKE_BUILD_PARALLEL_LEVEL="2")
        build = subprocess.run([sys.executable, str(ROOT / "ci" / "build-wheels"), "--cuda", cuda, "--plugins",
                                plugin, "--no-core", "--out", str(staging)], env=env, capture_output=True, text=True)
        if build.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"ci/build-wheels --cuda {cuda} --plugins {plugin} failed:\n"
                               + build.stdout[-3000:] + build.stderr[-3000:])
        staging.rename(folder)
    return folder


def plugin_wheel(plugin: str, cuda: str = "13.0", archs: str = "90a", *, ptx: bool = True) -> Path:
    """The wheel of `plugin_build(...)`."""
    tag = cuda_tag(cuda)
    wheels = sorted((plugin_build(plugin, cuda, archs, ptx=ptx) / tag).glob(f"astrai_{plugin}-*-{PY}-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one astrai_{plugin} wheel for {PY}, found {wheels}")
    return wheels[0]


def rotary_wheel_dir() -> Path:
    """The folder holding the shared astrai-elementwise +cu130 wheel (sm_80 + sm_90a + PTX)."""
    return plugin_build("elementwise", "13.0", ROTARY_ARCHS) / "cu130"


def core_wheel(dest: Path) -> Path:
    """The core's pure-Python wheel, built into `dest` (seconds: it is never cached)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(dest), str(ROOT / "packages" / "astrai")],
                   check=True, capture_output=True)
    return next(dest.glob("astrai-*-py3-none-any.whl"))
