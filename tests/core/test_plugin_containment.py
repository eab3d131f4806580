"""Whatever a plugin's code raises stays inside the plugin: ``SystemExit`` and every other
``BaseException`` (``KeyboardInterrupt`` excepted) at discovery, import and launch becomes a
rejected plugin with the reason, and the op takes the torch path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from collections.abc import Mapping

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest
from reference import rotary_ref, rotary_tables, tolerance

from astrai.extension.backend import fp8 as fp8_policy
from astrai.extension.backend import fp8_runners
from astrai.extension.backend import rotary
from astrai.extension.ops import _plugin
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.runtime import Runtime, use_runtime


class PluginAbort(BaseException):
    """A BaseException of a plugin's own."""


ESCAPES = {
    "SystemExit": (SystemExit(3), "SystemExit: 3"),
    "GeneratorExit": (GeneratorExit(), "GeneratorExit"),
    "own BaseException": (PluginAbort("bye"), "PluginAbort: bye"),
    "Exception": (ImportError("libcudart.so.13: cannot open"), "ImportError: libcudart.so.13"),
}


def op_manifest(op: str, module: str = "fake_kernels", name: str = "acme-kernels") -> dict:
    return manifest(name=name, ops={op: {"module": module, "abi": 1, "dtypes": ["bfloat16"]}})


def raising(exc: BaseException):
    def call(*args, **kwargs):
        raise exc
    return call


@pytest.fixture
def on_h200(monkeypatch):
    """Every tensor looks like it lives on an H200 to the rotary policy and the ops layer;
    the rotary op goes through ``_plugin.require`` as the real one does on a CUDA tensor."""
    monkeypatch.setattr(rotary, "probe_device", lambda device=None: H200)
    monkeypatch.setattr(_plugin, "probe_device", lambda device=None: H200)
    # the kernel path launches on the current stream: hand the fake module a null stream
    monkeypatch.setattr(rotary.ops_rotary, "launch", lambda device, fn, *args: fn(*args, 0))
    monkeypatch.setattr(rotary.ops_rotary, "rotary_emb",
                        lambda x, cos, sin: _plugin.require("rotary_emb", x.device).rotary_emb(x, cos, sin))


def rope(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 4, 64, generator=g).to(torch.bfloat16)
    cos, sin = rotary_tables(7, 64, offset=int(torch.randint(0, 4096, (1,), generator=g)))
    return x, cos, sin


def check_rope(out, x, cos, sin):
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(torch.bfloat16))


# -- discovery --------------------------------------------------------------------------


@pytest.mark.parametrize(("exc", "text"), ESCAPES.values(), ids=ESCAPES.keys())
def test_entry_point_that_raises_is_a_rejected_plugin(exc, text):
    good = FakeEntryPoint("elementwise", manifest())
    registry = Registry(entry_points(FakeEntryPoint("exits", exc), good))
    records = {r.name: r for r in registry.plugins()}
    assert text in records["astrai-exits"].rejected and records["astrai-exits"].manifest is None
    assert records["astrai-elementwise"].manifest is not None  # the others are unaffected
    with pytest.warns(PluginRejectedWarning, match=f"plugin astrai-exits not used on cuda:0: .*{text}"):
        assert registry.op_status("rotary_emb", H200).usable


@pytest.mark.parametrize(("exc", "text"), ESCAPES.values(), ids=ESCAPES.keys())
def test_manifest_function_that_raises_is_a_rejected_plugin(exc, text):
    registry = Registry(entry_points(FakeEntryPoint("exits", raising(exc))))
    (record,) = registry.plugins()
    assert record.rejected == f"entry point raised {text}" or text in record.rejected


class Hostile(Mapping):
    """A manifest whose reads end the process."""

    def __getitem__(self, key):
        raise SystemExit(4)

    def __iter__(self):
        return iter(("api_version",))

    def __len__(self):
        return 1


def test_manifest_whose_reads_raise_is_a_rejected_plugin():
    (record,) = Registry(entry_points(FakeEntryPoint("hostile", Hostile()))).plugins()
    assert record.manifest is None and "reading the manifest raised SystemExit: 4" in record.rejected


def test_entry_point_listing_that_raises_is_reported():
    (record,) = Registry(raising(SystemExit(5))).plugins()
    assert record.manifest is None and "SystemExit: 5" in record.rejected


def test_keyboard_interrupt_passes_through_discovery():
    with pytest.raises(KeyboardInterrupt):
        Registry(entry_points(FakeEntryPoint("ctrl-c", KeyboardInterrupt()))).plugins()
    with pytest.raises(KeyboardInterrupt):
        Registry(entry_points(FakeEntryPoint("ctrl-c", raising(KeyboardInterrupt())))).plugins()
    with pytest.raises(KeyboardInterrupt):
        Registry(raising(KeyboardInterrupt())).plugins()


# -- import and launch, every op ---------------------------------------------------------


@pytest.mark.parametrize("op", list(_plugin.PLUGIN_OF_OP))
@pytest.mark.parametrize(("exc", "text"), ESCAPES.values(), ids=ESCAPES.keys())
def test_module_import_that_raises_disables_the_op(on_h200, op, exc, text):
    registry = Registry(entry_points(FakeEntryPoint("acme", op_manifest(op))), importer=raising(exc))
    with use_runtime(Runtime(registry)):
        with pytest.warns(PluginRejectedWarning, match=text), pytest.raises(RuntimeError, match=text):
            _plugin.require(op, "cuda")
        status = registry.op_status(op, H200)
        assert not status.usable and f"importing fake_kernels failed: {text}" in status.reason
        with pytest.raises(RuntimeError, match=f"not usable here .*{text}"):
            _plugin.require(op, "cuda")


@pytest.mark.parametrize("op", list(_plugin.PLUGIN_OF_OP))
@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit(), PluginAbort("bye")], ids=type)
def test_launch_that_raises_a_base_exception_disables_the_op(on_h200, op, exc):
    module = fake_module("fake_kernels", launch=raising(exc))
    registry = Registry(entry_points(FakeEntryPoint("acme", op_manifest(op))), importer=lambda name: module)
    with use_runtime(Runtime(registry)), pytest.warns(PluginRejectedWarning, match=type(exc).__name__):
        with pytest.raises(RuntimeError, match=f"^{op}: fake_kernels.launch raised {type(exc).__name__}"):
            _plugin.require(op, "cuda").launch()
    assert f"fake_kernels.launch raised {type(exc).__name__}" in registry.op_status(op, H200).reason


def test_launch_argument_errors_and_interrupts_propagate_and_keep_the_op(on_h200):
    for exc in (ValueError("q must be bfloat16"), KeyboardInterrupt()):
        module = fake_module("fake_kernels", launch=raising(exc))
        registry = Registry(entry_points(FakeEntryPoint("acme", op_manifest("rotary_emb"))),
                            importer=lambda name, module=module: module)
        with use_runtime(Runtime(registry)), pytest.raises(type(exc)):
            _plugin.require("rotary_emb", "cuda").launch()
        assert registry.op_status("rotary_emb", H200).usable


@pytest.mark.parametrize("where", ["import", "launch"])
def test_rotary_survives_a_plugin_that_exits(on_h200, where):
    module = fake_module("fake_kernels", rotary_emb=raising(SystemExit(3)), rotary=raising(SystemExit(3)))
    importer = raising(SystemExit(3)) if where == "import" else (lambda name: module)
    runtime = Runtime(Registry(entry_points(FakeEntryPoint("acme", op_manifest("rotary_emb"))), importer=importer))
    with use_runtime(runtime), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(2):
            x, cos, sin = rope(seed)
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
    messages = [str(w.message) for w in caught if issubclass(w.category, PluginRejectedWarning)]
    assert len(messages) == 1 and "SystemExit: 3" in messages[0]
    decision = runtime.explain("rotary_emb")[-1]
    assert decision.chosen == "torch" and "SystemExit: 3" in decision.trace[0].reason


def test_fp8_quantizer_survives_a_plugin_module_that_exits(on_h200):
    ops = {"fp8_quantize": {"module": "fake_fp8", "abi": 1, "dtypes": ["bfloat16"]}}
    runtime = Runtime(Registry(entry_points(FakeEntryPoint("fp8", manifest("astrai-fp8", ops=ops))),
                               importer=raising(SystemExit(3))))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    multiplier = torch.tensor(8.0)
    with use_runtime(runtime), pytest.warns(PluginRejectedWarning, match="SystemExit: 3"):
        run = fp8_runners.quantizer(H200, torch.bfloat16, "e4m3", runtime)
        q, _, amax = run(x, multiplier, 0)
    expected = (x.float() * 8.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    assert amax.item() == x.float().abs().max().item()


# -- astrai doctor ------------------------------------------------------------------------


def _write_exiting_plugin(root, where: str) -> None:
    """A plugin on disk whose manifest module (or compiled module) calls sys.exit(3)."""
    pkg = root / "exitplug"
    pkg.mkdir()
    head = "import sys\nsys.exit(3)\n" if where == "manifest" else ""
    (pkg / "__init__.py").write_text(head + textwrap.dedent("""
        def manifest():
            return {
                "api_version": 1, "name": "exit-rotary", "version": "0.1.0",
                "core_requires": ">=0.1.0,<0.2.0", "sass_archs": [], "ptx_archs": [],
                "ops": {"rotary_emb": {"module": "exitplug._kernels", "abi": 1, "dtypes": ["bfloat16"]}},
            }
    """))
    (pkg / "_kernels.py").write_text("import sys\nsys.exit(3)\n")
    info = root / "exitplug-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: exit-rotary\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[astrai.kernels]\nrotary = exitplug:manifest\n")


@pytest.mark.parametrize("args", [["doctor"], ["doctor", "--json"]])
def test_doctor_reports_a_plugin_that_exits_at_import(tmp_path, args):
    _write_exiting_plugin(tmp_path, "manifest")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "astrai.cli.main", *args], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "exit-rotary" in result.stdout and "SystemExit: 3" in result.stdout


def test_a_compiled_module_that_exits_leaves_the_process_running(tmp_path):
    # A pure-Python plugin (no CUDA) serves CPU tensors: its module's sys.exit reaches
    # the registry on the first call, which falls back to the torch path.
    _write_exiting_plugin(tmp_path, "kernels")
    script = textwrap.dedent("""
        import warnings
        from astrai.extension.ops import _plugin
        from astrai.extension.runtime import current_runtime
        try:
            _plugin.require("rotary_emb", "cpu")
        except RuntimeError as exc:
            print("raised:", exc)
        print("status:", current_runtime().registry.op_status("rotary_emb", _plugin.probe_device("cpu")).reason)
    """)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "raised: rotary_emb: exit-rotary: importing exitplug._kernels failed: SystemExit: 3" in result.stdout
    assert "status: " in result.stdout and "SystemExit: 3" in result.stdout.split("status: ")[1]
