"""The plugin registry over fake entry points: accepted, rejected, lazily loaded."""

import sys
import warnings

import pytest
from fakes import A100_OLD_DRIVER, H200, L20, T4, FakeEntryPoint, entry_points, fake_module, manifest

from astrai.extension.device import CPU
from astrai.extension.registry import PluginRejectedWarning, Registry


def registry(*eps, **kwargs):
    imported = []

    def importer(name):
        imported.append(name)
        if name == "broken_module":
            raise ImportError("undefined symbol: cudaLaunchKernelExC")
        return fake_module(name, rotary_emb=lambda *a: "ran")

    reg = Registry(entry_points(*eps), importer=importer, **kwargs)
    reg.imported = imported
    return reg


def rejected(reg):
    return {r.name: r.rejected for r in reg.plugins() if r.rejected}


def test_good_plugin_is_usable_and_loaded_lazily():
    reg = registry(FakeEntryPoint("elementwise", manifest))
    status = reg.op_status("rotary_emb", H200)
    assert status.usable and status.plugin.name == "astrai-elementwise"
    assert reg.imported == []  # discovery and status never import compiled code
    assert reg.load("rotary_emb", H200).rotary_emb() == "ran"
    assert reg.imported == ["fake_rotary_module"]
    reg.load("rotary_emb", H200)
    assert reg.imported == ["fake_rotary_module"]


def test_manifest_may_be_a_plain_dict():
    reg = registry(FakeEntryPoint("elementwise", manifest()))
    assert reg.op_status("rotary_emb", H200).usable


@pytest.mark.filterwarnings("ignore::astrai.extension.registry.PluginRejectedWarning")
def test_entry_point_that_raises_is_rejected_with_reason():
    reg = registry(FakeEntryPoint("elementwise", ImportError("No module named 'astrai_elementwise'")))
    assert rejected(reg) == {"astrai-elementwise": "entry point raised ImportError: No module named 'astrai_elementwise'"}
    assert not reg.op_status("rotary_emb", H200).usable


def test_manifest_callable_that_raises_is_rejected():
    def bad():
        raise KeyError("build_info.json")

    reg = registry(FakeEntryPoint("elementwise", bad))
    assert "entry point raised KeyError" in rejected(reg)["astrai-elementwise"]


@pytest.mark.parametrize("raw, reason", [
    ("not a dict", "manifest must be a dict, got str"),
    ({k: v for k, v in manifest().items() if k != "ops"}, "manifest is missing key 'ops'"),
    (manifest(ops=[1]), "manifest key 'ops' must be Mapping, got list"),
    (manifest(sass_archs=["sm90"]), "'sm90' is not of the form sm_XY"),
    (manifest(version="one"), "'one' is not a PEP 440 version"),
    (manifest(cuda="thirteen"), "'thirteen' is not a version"),
    (manifest(ops={"rotary_emb": {"abi": 1, "dtypes": []}}), "op 'rotary_emb' is missing key 'module'"),
    (manifest(ops={"rotary_emb": {"module": "m", "abi": "1", "dtypes": []}}), "key 'abi' must be int, got str"),
])
def test_malformed_manifest_is_rejected_naming_the_key(raw, reason):
    reg = registry(FakeEntryPoint("elementwise", raw))
    assert reason in rejected(reg)["astrai-elementwise"]


def test_newer_plugin_api_version_is_rejected():
    reg = registry(FakeEntryPoint("elementwise", manifest(api_version=2, ops="whatever v2 says")))
    assert rejected(reg) == {"astrai-elementwise": "plugin API version 2, this core speaks 1: upgrade astrai"}


def test_core_version_mismatch_names_the_fix():
    reg = registry(FakeEntryPoint("elementwise", manifest(core_requires=">=0.2")), core_version="0.1.0")
    reason = rejected(reg)["astrai-elementwise"]
    assert "needs astrai>=0.2, this is astrai 0.1.0" in reason
    assert 'pip install "astrai-elementwise==0.1.0"' in reason


def test_duplicate_plugin_names_keep_the_first_deterministically():
    first = FakeEntryPoint("elementwise", manifest(), dist="astrai-elementwise")
    again = FakeEntryPoint("rotary2", manifest(), dist="astrai-elementwise")
    for order in ((first, again), (again, first)):
        reg = registry(*order)
        kept = [r.entry_point for r in reg.plugins() if r.manifest]
        assert kept == ["elementwise = fake_elementwise:manifest"]
        assert rejected(reg) == {"astrai-elementwise": "duplicate of elementwise = fake_elementwise:manifest"}


def test_two_plugins_offering_one_op_first_name_wins_other_shadowed():
    a = FakeEntryPoint("a", manifest(name="acme-rotary"))
    b = FakeEntryPoint("b", manifest(name="astrai-elementwise"))
    status = registry(b, a).op_status("rotary_emb", H200)
    assert status.plugin.name == "acme-rotary"
    assert dict(status.trace) == {"acme-rotary": "accepted", "astrai-elementwise": "shadowed by acme-rotary"}


def test_cpu_device_rejects_cuda_plugin_with_reason():
    status = registry(FakeEntryPoint("elementwise", manifest)).op_status("rotary_emb", CPU)
    assert not status.usable
    assert "CUDA plugin (built for CUDA 13.0); no CUDA device" in status.reason


@pytest.mark.filterwarnings("ignore::astrai.extension.registry.PluginRejectedWarning")
def test_driver_older_than_plugin_cuda_is_rejected():
    status = registry(FakeEntryPoint("elementwise", manifest)).op_status("rotary_emb", A100_OLD_DRIVER)
    assert "built for CUDA 13.0, the driver supports CUDA 12.4" in status.reason


@pytest.mark.filterwarnings("ignore::astrai.extension.registry.PluginRejectedWarning")
def test_arch_matching_sass_ptx_and_arch_specific():
    only_90a = manifest(sass_archs=["sm_90a"], ptx_archs=[])
    assert registry(FakeEntryPoint("r", only_90a)).op_status("rotary_emb", H200).usable
    status = registry(FakeEntryPoint("r", only_90a)).op_status("rotary_emb", L20)
    assert "no SASS or PTX for sm_89 in the binaries (has sm_90a)" in status.reason
    sm80 = manifest(sass_archs=["sm_80"], ptx_archs=[])
    assert registry(FakeEntryPoint("r", sm80)).op_status("rotary_emb", L20).usable  # same major
    assert not registry(FakeEntryPoint("r", sm80)).op_status("rotary_emb", H200).usable
    ptx80 = manifest(sass_archs=[], ptx_archs=["compute_80"])
    assert registry(FakeEntryPoint("r", ptx80)).op_status("rotary_emb", H200).usable  # JIT
    assert not registry(FakeEntryPoint("r", ptx80)).op_status("rotary_emb", T4).usable


@pytest.mark.filterwarnings("ignore::astrai.extension.registry.PluginRejectedWarning")
def test_min_sm_and_native_sm_per_op():
    ops = {"fp8_gemm": {"module": "m", "abi": 1, "dtypes": ["float8_e4m3fn"], "min_sm": 89, "native_sm": [89, 120]}}
    reg = registry(FakeEntryPoint("fp8", manifest(name="astrai-fp8", ops=ops)))
    assert reg.op_status("fp8_gemm", L20).native is True
    assert reg.op_status("fp8_gemm", H200).native is False
    ampere = A100_OLD_DRIVER.__class__(type="cuda", index=3, name="A100", capability=(8, 0), driver_cuda=(13, 0))
    assert "needs sm_89+, device is sm_80" in reg.op_status("fp8_gemm", ampere).reason


@pytest.mark.filterwarnings("ignore::astrai.extension.registry.PluginRejectedWarning")
def test_unknown_abi_is_rejected_per_op():
    ops = {"rotary_emb": {"module": "m", "abi": 7, "dtypes": ["bfloat16"]}}
    status = registry(FakeEntryPoint("elementwise", manifest(ops=ops))).op_status("rotary_emb", H200)
    assert "op ABI 7, this core speaks [1]" in status.reason


def test_import_failure_marks_op_unusable_and_warns():
    ops = {"rotary_emb": {"module": "broken_module", "abi": 1, "dtypes": ["bfloat16"]}}
    reg = registry(FakeEntryPoint("elementwise", manifest(ops=ops)))
    with pytest.warns(PluginRejectedWarning, match="undefined symbol"), pytest.raises(RuntimeError, match="undefined symbol"):
        reg.load("rotary_emb", H200)
    assert not reg.op_status("rotary_emb", H200).usable
    assert "importing broken_module failed" in reg.op_status("rotary_emb", H200).reason


def test_rejection_warns_once_per_plugin_and_cuda_device():
    reg = registry(FakeEntryPoint("elementwise", manifest(sass_archs=["sm_90a"], ptx_archs=[])))
    with pytest.warns(PluginRejectedWarning, match="no SASS or PTX for sm_89") as caught:
        reg.op_status("rotary_emb", L20)
        reg.op_status("rotary_emb", L20)
        reg.op_status("fp8_gemm", L20)
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg.op_status("rotary_emb", CPU)  # CPU calls never warn about CUDA plugins


def test_allow_deny_and_disable():
    eps = (FakeEntryPoint("elementwise", manifest), FakeEntryPoint("fp8", manifest(name="astrai-fp8")))
    assert rejected(registry(*eps, deny=["astrai-fp8"])) == {"astrai-fp8": "listed in ASTRAI_PLUGINS_DENY"}
    assert rejected(registry(*eps, allow=["elementwise"])) == {"astrai-fp8": "not in ASTRAI_PLUGINS_ALLOW"}
    assert registry(*eps, enabled=False).plugins() == ()


def test_from_environment(monkeypatch):
    monkeypatch.setenv("ASTRAI_PLUGINS_DENY", "astrai-fp8, acme")
    monkeypatch.setenv("ASTRAI_DISABLE_PLUGINS", "1")
    reg = Registry.from_environment()
    assert reg.deny == {"astrai-fp8", "acme"} and not reg.enabled and reg.plugins() == ()


STANDIN = {  # distribution name: (entry point line, module source)
    "acme-standin": ("standin = acme_standin:manifest",
                     f"def manifest():\n    return {manifest(name='acme-standin')!r}\n"),
    "acme-broken": ("broken = acme_missing_module:manifest", None),
}


@pytest.fixture
def standin_plugins(tmp_path, monkeypatch):
    """Two plugins installed the way pip installs them (a ``*.dist-info`` with an
    ``entry_points.txt`` on sys.path): one good, one whose module is missing, so the real
    entry-point discovery has something to find on a machine with no plugin (CI)."""
    for dist, (entry_point, source) in STANDIN.items():
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[astrai.kernels]\n{entry_point}\n")
        if source:
            (tmp_path / f"{dist.replace('-', '_')}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("acme_standin", None)


@pytest.mark.filterwarnings("ignore::astrai.extension.registry.PluginRejectedWarning")
def test_real_entry_point_group_never_breaks(standin_plugins):
    # Whatever is installed here, discovery returns records and never raises; the two
    # stand-ins are among them, one accepted and one rejected with its reason.
    records = Registry().plugins()
    for record in records:
        assert record.manifest is not None or record.rejected
    by_dist = {r.distribution: r for r in records}
    good, broken = by_dist["acme-standin"], by_dist["acme-broken"]
    assert good.manifest.name == "acme-standin" and not good.rejected
    assert broken.manifest is None
    assert broken.rejected == "entry point raised ModuleNotFoundError: No module named 'acme_missing_module'"
    status = Registry().op_status("rotary_emb", CPU)
    assert dict(status.trace)["acme-standin"] == "rejected: CUDA plugin (built for CUDA 13.0); no CUDA device"
