import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def rotary_build():
    """The one astrai-rotary +cu130 build (sm_80 + sm_90a + PTX) every rotary packaging test
    shares: the ci/build-wheels output folder, cached on disk per source tree by
    tests/wheel_cache.py (read-only: copy it before writing an index into it)."""
    from wheel_cache import plugin_build, ROTARY_ARCHS

    return plugin_build("rotary", "13.0", ROTARY_ARCHS)
