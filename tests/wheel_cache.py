"""One real astrai-rotary wheel for the packaging tests, built once per source tree.

ci/build-wheels for CUDA 13.0 and sm_90a only (CI-sized) into build/test-wheels/,
under a hash of everything the wheel is built from; a later run on the same tree, or
another test module, reuses it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = "cp%d%d" % sys.version_info[:2]


def _source_hash() -> str:
    digest = hashlib.sha256()
    sources = [ROOT / "ci" / "build-wheels"]
    for folder in (ROOT / "packages" / "astrai-rotary", ROOT / "packages" / "cuda-common"):
        sources += sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in sources:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def rotary_wheel_dir() -> Path:
    """A folder holding one astrai-rotary +cu130 wheel (sm_90a + PTX) for this Python."""
    cache = ROOT / "build" / "test-wheels" / f"rotary-cu130-90a-{_source_hash()}"
    wheels = cache / "cu130"
    if not list(wheels.glob(f"astrai_rotary-*-{PY}-*.whl")):
        for stale in cache.parent.glob("rotary-cu130-90a-*"):
            shutil.rmtree(stale, ignore_errors=True)
        env = dict(os.environ, ASTRAI_CUDA_ARCHS="90a", CMAKE_BUILD_PARALLEL_LEVEL="2")
        build = subprocess.run([sys.executable, str(ROOT / "ci" / "build-wheels"), "--cuda", "13.0", "--plugins",
                                "rotary", "--no-core", "--out", str(cache)], env=env, capture_output=True, text=True)
        if build.returncode != 0:
            raise RuntimeError("ci/build-wheels failed:\n" + build.stdout[-3000:] + build.stderr[-3000:])
    return wheels
