import os
import sys
from pathlib import Path

import pytest
import torch

# The helpers every test folder imports by name (``from reference import ...``, ``fakes``,
# ``attention_cases``, ...); the benchmark scripts in bench/ add the same folder themselves.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

MAX_WORKERS = 4  # each pytest-xdist worker imports torch: a few hundred MB apiece


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """With pytest-xdist installed (ci/requirements-dev.txt pins it) and no ``-n`` given, the
    suite runs as ``-n auto --dist loadfile --no-loadscope-reorder``: whole modules per worker
    (a module's build fixtures are made once), in the order of _slow_modules_first. ``-n 0``
    or ``-p no:xdist`` runs it in this process; so does an environment without pytest-xdist.
    Runs before xdist's own hook (both tryfirst; a conftest registers later, so goes first);
    a worker (``config.workerinput``), or a pytest a worker started, runs in one process."""
    option = config.option
    in_worker = hasattr(config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ
    if not config.pluginmanager.hasplugin("xdist") or in_worker or option.numprocesses is not None \
            or option.collectonly:
        return
    option.numprocesses = "auto"
    if option.dist == "no":
        option.dist, option.loadscopereorder = "loadfile", False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """The worker count of ``-n auto``: one per CPU this process may run on, at most
    MAX_WORKERS; none on a CUDA machine, where the GPU tests would share the device (and
    time kernels on it), so they run in this process as before."""
    if torch.cuda.is_available():
        return 0
    return min(len(os.sched_getaffinity(0)), MAX_WORKERS)


def pytest_configure(config):
    _share_the_cpus()


def _share_the_cpus():
    """In a pytest-xdist worker, torch's intra-op threads (and, through OMP_NUM_THREADS, those
    of the processes the tests start) get the worker's share of the CPUs: with one thread per
    CPU in every worker, the workers' threads spin against each other and the torch-heavy
    tests take twice the CPU time. A thread count set in the environment is left alone."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    _slow_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _slow_modules_first(items):
    """The modules with a ``slow`` test (they compile the plugins: minutes) before the rest,
    each module's tests kept together and in order: pytest-xdist hands out whole modules in
    this order (``--dist loadfile --no-loadscope-reorder``), so the compiles start at once
    and overlap the rest of the suite instead of ending it."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


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
    """The one astrai-elementwise +cu130 build (sm_80 + sm_90a + PTX) every rotary packaging test
    shares: the ci/build-wheels output folder, cached on disk per source tree by
    tests/helpers/wheel_cache.py (read-only: copy it before writing an index into it)."""
    from wheel_cache import plugin_build, ROTARY_ARCHS

    return plugin_build("elementwise", "13.0", ROTARY_ARCHS)
