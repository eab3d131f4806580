"""What the CPU tests of the compiled plugins share: finding the CUDA binary tools and
loading a built module, or a plugin package's manifest, from a path."""

from __future__ import annotations

import glob
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


def plugin_manifest_of(package_dir: Path, name: str) -> dict[str, Any]:
    """manifest() of an unpacked plugin package, imported under a temporary name."""
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # importlib.resources.files(__name__) looks it up there
    try:
        spec.loader.exec_module(module)
        return module.manifest()
    finally:
        del sys.modules[spec.name]


def build_host_module(name: str, source: Path, include_dirs: list[Path], out_dir: Path) -> ModuleType | None:
    """Compile a host-only (no CUDA) pybind11 module with the C++ compiler and load it; None
    when no C++ compiler is on PATH."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return None
    import pybind11

    target = out_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = [cxx, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{pybind11.get_include()}",
           f"-I{sysconfig.get_paths()['include']}", *(f"-I{d}" for d in include_dirs), str(source), "-o", str(target)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"building {name} failed:\n{res.stderr[-3000:]}")
    return load_module(name, target)
