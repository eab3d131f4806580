"""The install command ``astrai doctor`` prints, per installer, for the driver it finds.

Pure functions of the driver's CUDA version (``(13, 0)``, or None without a driver) and
the installer kind; the index choice itself is ``extension.install.cuda_index_tag``.
Package names match what ``recipe/recipe.yaml`` builds: ``astrai`` (the core),
``astrai-attention`` / ``astrai-elementwise`` / ``astrai-fp8``, and ``astrai-kernels`` (all).

>>> install_command((13, 0), "pip", "fp8")
'pip install "astrai[fp8]" --extra-index-url https://astrai-kernels.github.io/whl/cu130'
>>> install_command((12, 6), "conda")
'conda install -c https://astrai-kernels.github.io/conda -c conda-forge astrai-kernels "cuda-version=12"'
>>> install_command(None, "pip")
'pip install astrai'
>>> install_command((13, 0), "pip", "attention,fp8")
'pip install "astrai[attention,fp8]" --extra-index-url https://astrai-kernels.github.io/whl/cu130'
"""

from __future__ import annotations

import os

from ..extension.install import PLUGIN_EXTRAS, cuda_index_tag, pip_command

INSTALLERS = ("pip", "conda", "pixi")
EXTRAS = ("all", *PLUGIN_EXTRAS.values())
DEFAULT_CONDA_CHANNEL = "https://astrai-kernels.github.io/conda"


def extra_of(plugins: set[str]) -> str | None:
    """The extra that installs these plugin extras (``{"fp8", "rotary"}``): "all" for
    every one, "rotary,fp8" for some (in ``EXTRAS`` order), None for none."""
    chosen = [extra for extra in EXTRAS[1:] if extra in plugins]
    if not chosen:
        return None
    return "all" if len(chosen) == len(EXTRAS) - 1 else ",".join(chosen)


def conda_channel() -> str:
    return os.environ.get("ASTRAI_CONDA_CHANNEL", DEFAULT_CONDA_CHANNEL).rstrip("/")


def conda_package(extra: str) -> str:
    """The conda package(s) that provide ``astrai[extra]``: ``astrai-fp8``, ``astrai-kernels``
    for all, ``astrai-elementwise astrai-fp8`` for "rotary,fp8"."""
    packages = {name: package for package, name in PLUGIN_EXTRAS.items()}
    return "astrai-kernels" if extra == "all" else " ".join(packages[part] for part in extra.split(","))


def install_command(driver_cuda: tuple[int, int] | None, installer: str, extra: str = "all") -> str:
    """The one-line command that installs ``astrai[extra]`` with ``installer`` on this machine.

    Without a driver that runs a published CUDA build, the command installs the core only
    (the torch fallbacks serve every op).
    """
    if installer not in INSTALLERS:
        raise ValueError(f"installer must be one of {', '.join(INSTALLERS)}, got {installer!r}")
    if extra not in EXTRAS and not (isinstance(extra, str) and set(extra.split(",")) <= set(EXTRAS[1:])):
        raise ValueError(f"extra must be one of {', '.join(EXTRAS)} or several plugin extras joined by "
                         f"commas, got {extra!r}")
    if driver_cuda is not None and (
        len(driver_cuda) != 2 or not all(isinstance(part, int) and part >= 0 for part in driver_cuda)
    ):
        raise ValueError(f"driver_cuda must be (major, minor) or None, got {driver_cuda!r}")
    tag = cuda_index_tag(driver_cuda)
    channel = conda_channel()
    if tag is None:
        return {
            "pip": "pip install astrai",
            "conda": f"conda install -c {channel} -c conda-forge astrai",
            "pixi": f"pixi workspace channel add {channel} && pixi add astrai",
        }[installer]
    major = int(tag[2:-1])  # "cu130" -> 13: the CUDA major of the build the driver gets
    package = conda_package(extra)
    if installer == "pip":
        return pip_command(extra, driver_cuda)
    if installer == "conda":
        return f'conda install -c {channel} -c conda-forge {package} "cuda-version={major}"'
    driver = "%d.%d" % driver_cuda
    return (f"pixi workspace channel add {channel} && pixi workspace system-requirements add cuda {driver}"
            f' && pixi add {package} "cuda-version={major}.*"')
