"""The exact install commands the core prints when a plugin is missing or unusable.

Plugins live on one package index per CUDA version (``<index>/cu124``, ``<index>/cu130``);
the right one is the newest whose CUDA the driver can run.
"""

from __future__ import annotations

import os

DEFAULT_INDEX_URL = "https://astrai-kernels.github.io/whl"
# Nothing is published at the default index and channel yet: the commands naming them
# work once a release is, or against an index of your own (ASTRAI_INDEX_URL, ci/make-index).
PUBLISHED = False
# Published CUDA builds, newest first: (major, minor) -> index folder.
PUBLISHED_CUDA = ((13, 0), (12, 4))

PLUGIN_EXTRAS = {"astrai-attention": "attention", "astrai-elementwise": "rotary", "astrai-fp8": "fp8"}


def index_url() -> str:
    return os.environ.get("ASTRAI_INDEX_URL", DEFAULT_INDEX_URL).rstrip("/")


def index_is_published() -> bool:
    """False while the commands name the default index, which has no release yet."""
    return PUBLISHED or "ASTRAI_INDEX_URL" in os.environ


def unpublished_note() -> str:
    """What to add after a pip command naming an index that has no release yet."""
    if index_is_published():
        return ""
    return " (no release is published on that index yet: build it from source, docs/install.md)"


def cuda_index_tag(driver_cuda: tuple[int, int] | None) -> str | None:
    """'cu130' for a CUDA 13 driver, 'cu124' for 12.4..12.9, None when no build can run."""
    if driver_cuda is None:
        return None
    for major, minor in PUBLISHED_CUDA:
        if driver_cuda[0] == major and driver_cuda >= (major, minor):
            return f"cu{major}{minor}"
        if driver_cuda[0] > major:
            return f"cu{major}{minor}"
    return None


def pip_command(extra: str, driver_cuda: tuple[int, int] | None, version: str | None = None) -> str:
    """``pip install`` line for ``astrai[extra]`` from the index matching the driver."""
    target = f"astrai[{extra}]" if version is None else f"astrai[{extra}]=={version}"
    tag = cuda_index_tag(driver_cuda) or cuda_index_tag(PUBLISHED_CUDA[0])
    return f'pip install "{target}" --extra-index-url {index_url()}/{tag}'


def plugin_pip_command(plugin: str, driver_cuda: tuple[int, int] | None, version: str) -> str:
    """``pip install`` line for one plugin distribution at ``version``."""
    tag = cuda_index_tag(driver_cuda) or cuda_index_tag(PUBLISHED_CUDA[0])
    return f'pip install "{plugin}=={version}" --extra-index-url {index_url()}/{tag}'
