"""An installed plugin (wheel or conda package), checked from outside the source tree.

    ASTRAI_EXPECT_PLUGIN=astrai-elementwise[,astrai-fp8] [ASTRAI_EXPECT_CUDA=12.4] pytest ci/wheel-tests

Run by cibuildwheel's test-command, by the conda recipe's tests and by ci/check-conda,
with the core installed beside the plugin. Needs no GPU: what runs on one is tests/gpu.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from astrai.extension.device import DeviceInfo
from astrai.extension.manifest import Arch
from astrai.extension.registry import GROUP, Registry

SOURCE_PACKAGES = Path(__file__).resolve().parents[2] / "packages"
PLUGINS = [name.strip() for name in os.environ.get("ASTRAI_EXPECT_PLUGIN", "").split(",") if name.strip()]
EXPECT_CUDA = os.environ.get("ASTRAI_EXPECT_CUDA") or None


def test_the_plugins_to_check_are_named():
    assert PLUGINS, "set ASTRAI_EXPECT_PLUGIN to the distribution(s) to check, e.g. astrai-elementwise"


def _entry_point(plugin: str) -> importlib.metadata.EntryPoint:
    dist = importlib.metadata.distribution(plugin)
    points = [ep for ep in dist.entry_points if ep.group == GROUP]
    assert len(points) == 1, f"{plugin} must declare exactly one {GROUP} entry point, has {points}"
    return points[0]


def _record(plugin: str):
    records = [r for r in Registry().plugins() if r.distribution and
               importlib.metadata.distribution(r.distribution).name == importlib.metadata.distribution(plugin).name]
    assert len(records) == 1, f"discovery found {len(records)} records for {plugin}"
    return records[0]


def _compiled_modules_of(package: str) -> list[str]:
    return sorted(name for name, module in list(sys.modules.items())
                  if name.split(".")[0] == package
                  and str(getattr(module, "__file__", "") or "").endswith((".so", ".pyd")))


@pytest.fixture(params=PLUGINS or [None], ids=lambda name: name or "none")
def plugin(request):
    if request.param is None:
        pytest.fail("no plugin named in ASTRAI_EXPECT_PLUGIN")
    return request.param


def test_installed_outside_the_source_tree(plugin):
    package = _entry_point(plugin).module.split(".")[0]
    origin = Path(importlib.util.find_spec(package).origin).resolve()
    assert not origin.is_relative_to(SOURCE_PACKAGES), f"{package} is imported from the source tree: {origin}"


def test_discovery_accepts_it_without_importing_compiled_code(plugin):
    package = _entry_point(plugin).module.split(".")[0]
    before = set(_compiled_modules_of(package))
    record = _record(plugin)
    assert record.rejected is None, f"{plugin} rejected at discovery: {record.rejected}"
    assert set(_compiled_modules_of(package)) == before, "reading the manifest imported a compiled module"


def test_manifest_names_the_toolkit_it_was_built_with(plugin):
    manifest = _record(plugin).manifest
    assert manifest.cuda is not None, f"{plugin} is a CUDA plugin, its manifest says cuda=null"
    assert manifest.version.local == "cu%d%d" % manifest.cuda, \
        f"version {manifest.version} does not carry the tag of CUDA {manifest.cuda_text}"
    assert str(manifest.version) == importlib.metadata.version(plugin)
    if EXPECT_CUDA is not None:
        assert manifest.cuda_text == EXPECT_CUDA, f"{plugin} was built with CUDA {manifest.cuda_text}, expected {EXPECT_CUDA}"
    assert manifest.sass_archs or manifest.ptx_archs, "no SASS and no PTX listed"
    assert manifest.ops, "no ops listed"


def test_device_checks_follow_the_manifest(plugin):
    manifest = _record(plugin).manifest
    for arch in manifest.sass_archs:
        device = DeviceInfo("cuda", 0, "fake", (arch.major, arch.minor), manifest.cuda)
        assert Registry.device_rejection(manifest, device) is None, f"{arch} listed but rejected"
        old_driver = DeviceInfo("cuda", 0, "fake", (arch.major, arch.minor), (manifest.cuda[0] - 1, 9))
        assert "driver" in Registry.device_rejection(manifest, old_driver)
    too_old = DeviceInfo("cuda", 0, "fake", (7, 0), manifest.cuda)
    if not any(a.runs_on((7, 0)) for a in manifest.sass_archs + manifest.ptx_archs):
        assert "no SASS or PTX" in Registry.device_rejection(manifest, too_old)
    assert all(isinstance(a, Arch) for a in manifest.sass_archs + manifest.ptx_archs)


def test_compiled_modules_import_and_report_the_same_toolkit(plugin):
    manifest = _record(plugin).manifest
    for module_name in sorted({spec.module for spec in manifest.ops.values()}):
        module = importlib.import_module(module_name)  # no GPU needed to import (static cudart)
        info = module.build_info()
        assert info["cuda_version"] == manifest.cuda_text, \
            f"{module_name}.build_info() says CUDA {info['cuda_version']}, the manifest {manifest.cuda_text}"
