import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def runtime():
    """A fresh runtime (empty decision cache, no plugins) for the test; files with a runtime
    of their own define this fixture themselves."""
    from fakes import entry_points

    from astrai.extension.registry import Registry
    from astrai.extension.runtime import Runtime, use_runtime

    rt = Runtime(Registry(entry_points()))
    with use_runtime(rt):
        yield rt


@pytest.fixture
def require_plugin():
    """``require_plugin(op)``: the op's registry status on this CUDA device, or a failure
    (never a skip) with the reason ``astrai doctor`` prints. On a CUDA machine the GPU
    tests exist to run the kernels: a plugin that is missing or rejected there is a bug
    of the build or the install, not a reason to pass."""

    def require(op: str):
        from astrai.extension.device import probe_device
        from astrai.extension.runtime import current_runtime

        status = current_runtime().registry.op_status(op, probe_device("cuda"))
        if not status.usable:
            pytest.fail(f"{op}: no usable plugin on this CUDA device: {status.reason} (see `astrai doctor`)",
                        pytrace=False)
        return status

    return require


@pytest.fixture(scope="session")
def rotary_build():
    """The one astrai-rotary +cu130 build (sm_80 + sm_90a + PTX) every rotary packaging test
    shares: the ci/build-wheels output folder, cached on disk per source tree by
    tests/wheel_cache.py (read-only: copy it before writing an index into it)."""
    from wheel_cache import plugin_build, ROTARY_ARCHS

    return plugin_build("rotary", "13.0", ROTARY_ARCHS)
