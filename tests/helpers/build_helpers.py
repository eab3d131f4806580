"""What the CPU tests of the compiled plugins share: finding the CUDA binary tools and
loading a built module, or a plugin package's manifest, from a path."""

from __future__ import annotations

import glob
import os
import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any


def find_tool(name: str) -> str | None:
    """A CUDA tool (cuobjdump, nvdisasm) on PATH, else from the nvidia-* wheels of this venv."""
    wheels = Path(sys.executable).parent.parent / "lib" / "python3*" / "site-packages" / "nvidia" / "*" / "bin" / name
    return shutil.which(name) or next(iter(glob.glob(str(wheels))), None)


def load_module(name: str, path: Path, *, register: bool = False) -> ModuleType:
    """The module in `path` (a .py or a compiled extension) under `name`; `register` puts it in
    sys.modules first (dataclasses look their module up there while the class is built)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def plugin_manifest_of(package_dir: Path, name: str, build_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """manifest() of an unpacked plugin package, imported under a temporary name; with
    `build_info`, of a source package too (that record stands in for the build's)."""
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # importlib.resources.files(__name__) looks it up there
    try:
        spec.loader.exec_module(module)
        if build_info is not None:
            module.build_info = lambda: build_info
        return module.manifest()
    finally:
        del sys.modules[spec.name]


# A build record with every optional piece (the Hopper kernels, the mma kernels), for
# manifests read from the source tree.
FULL_BUILD_INFO = {"version": "0.1.0+cu130", "cuda": "13.0", "nvcc_version": "13.0", "sass_archs": ["sm_90a"],
                   "ptx_archs": ["compute_90"], "no_mma": False, "modules": {}}


def declared_ops() -> dict[str, str]:
    """op -> the plugin package ("astrai-attention", ...) whose source manifest declares it,
    under FULL_BUILD_INFO."""
    root = Path(__file__).resolve().parents[2]
    ops = {}
    for plugin in ("attention", "elementwise", "fp8"):
        package = root / "packages" / f"astrai-{plugin}" / "src" / f"astrai_{plugin}"
        manifest = plugin_manifest_of(package, f"_astrai_{plugin}_declared_ops", build_info=FULL_BUILD_INFO)
        ops.update(dict.fromkeys(manifest["ops"], f"astrai-{plugin}"))
    return ops


def _build_wheels() -> ModuleType:
    """ci/build-wheels as a module (loaded once)."""
    script = Path(__file__).resolve().parents[2] / "ci" / "build-wheels"
    loader = importlib.machinery.SourceFileLoader("_build_wheels_under_test", str(script))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    build_wheels = sys.modules.get(loader.name)
    if build_wheels is None:
        build_wheels = importlib.util.module_from_spec(spec)
        sys.modules[loader.name] = build_wheels  # its dataclasses look their module up there
        loader.exec_module(build_wheels)
    return build_wheels


def local_cuda() -> str | None:
    """The CUDA version (MAJOR.MINOR) of the nvcc in CUDACXX or on PATH, as ci/build-wheels
    reads it; None where there is none."""
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    return _build_wheels().nvcc_version(Path(nvcc)) if nvcc else None


def require_toolkit(cuda: str = "13.0") -> None:
    """Skip the calling test (or fixture) unless ci/build-wheels can build CUDA ``cuda``
    plugins here: a local nvcc of that version (CUDACXX or PATH) or a provisioned toolkit.
    The reason is the one ci/build-wheels itself gives."""
    import pytest

    try:
        _build_wheels().select_toolkit(cuda, provision=False)
    except SystemExit as exc:
        pytest.skip(f"needs a CUDA {cuda} toolkit: {str(exc).removeprefix('build-wheels: ')}")


def require_nvcc() -> None:
    """Skip the calling test unless a CUDA compiler (any version) is in CUDACXX or on PATH."""
    import os

    import pytest

    if not (os.environ.get("CUDACXX") or shutil.which("nvcc")):
        pytest.skip("needs a CUDA toolkit: no nvcc on PATH (or CUDACXX)")


def host_module(name: str, source: Path, depends: list[Path], include_dirs: tuple[Path, ...] = ()) -> ModuleType:
    """The pybind11 module ``name`` built from one C++ ``source`` with the host compiler (no
    nvcc; headers found next to it or in ``include_dirs``), cached under build/host-modules/
    by the hash of ``source`` and ``depends``; skips the caller when there is no C++ compiler."""
    import hashlib
    import subprocess
    import sysconfig

    import pybind11
    import pytest

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler", allow_module_level=True)
    digest = hashlib.sha256()
    for path in (source, *depends):
        digest.update(path.read_bytes())
    folder = Path(__file__).resolve().parents[2] / "build" / "host-modules" / f"{name}-{digest.hexdigest()[:16]}"
    target = folder / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        staging = folder / f".{target.name}.{os.getpid()}"
        includes = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                    *(f"-I{d}" for d in include_dirs)]
        built = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", *includes, str(source), "-o",
                                str(staging)], capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"building {name} from {source} failed:\n{built.stderr[-4000:]}")
        staging.rename(target)  # atomic: a concurrent builder finds a whole module or none
    return load_module(name, target, register=True)


def sm90_planner() -> ModuleType:
    """The Hopper GEMM planner (csrc/gemm/sm90/planning.h) bound for Python, host-only."""
    sm90 = Path(__file__).resolve().parents[2] / "packages" / "astrai-fp8" / "csrc" / "gemm" / "sm90"
    return host_module("_sm90_planning", sm90 / "tests" / "planning_module.cpp",
                       [sm90 / "planning.h", sm90 / "planning_bind.h", sm90 / "plan_cache.h"])
