"""scikit-build-core metadata provider: the plugin version with its CUDA local tag.

``0.1.0`` built with nvcc 13.0 becomes ``0.1.0+cu130`` (PyTorch's convention), so one
index per CUDA version can serve the same release. In a plugin's pyproject.toml::

    [tool.scikit-build]
    experimental = true            # in-tree providers need it
    [tool.scikit-build.metadata.version]
    provider = "astrai_cuda_version"
    provider-path = "cuda-common/python"
    base = "0.1.0"

The toolkit is the nvcc CMake will pick: ``CUDACXX``, else ``nvcc`` on PATH, else
``$CUDA_HOME/bin/nvcc`` / ``$CUDA_PATH/bin/nvcc`` / ``/usr/local/cuda/bin/nvcc``.
AstraiPlugin.cmake checks that the tag matches the compiler it really uses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["dynamic_metadata", "find_nvcc", "cuda_version", "local_tag"]


def find_nvcc() -> str | None:
    explicit = os.environ.get("CUDACXX")
    if explicit:
        return explicit
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def cuda_version(nvcc: str) -> tuple[int, int]:
    """``(13, 0)`` from ``nvcc --version`` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    text = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
    match = re.search(r"release (\d+)\.(\d+)", text)
    if not match:
        raise RuntimeError(f"cannot read the CUDA version from `{nvcc} --version`:\n{text}")
    return int(match.group(1)), int(match.group(2))


def local_tag(version: tuple[int, int]) -> str:
    return f"cu{version[0]}{version[1]}"


def dynamic_metadata(field: str, settings: Mapping[str, Any] | None = None,
                     project: Mapping[str, Any] | None = None) -> str:
    if field != "version":
        raise RuntimeError(f"astrai_cuda_version only provides 'version', not {field!r}")
    settings = dict(settings or {})
    base = settings.pop("base", None)
    if not isinstance(base, str) or not base:
        raise RuntimeError("astrai_cuda_version needs a 'base' setting, e.g. base = \"0.1.0\"")
    if settings:
        raise RuntimeError(f"astrai_cuda_version: unknown settings {sorted(settings)}")
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("no CUDA compiler found (set CUDACXX or put nvcc on PATH); "
                           "AstrAI plugins need the CUDA toolkit to build")
    return f"{base}+{local_tag(cuda_version(nvcc))}"
