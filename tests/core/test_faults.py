"""Fault injection through the public entry points: whatever breaks, the answer is right.

Each test installs fake plugins (entry points, manifests, compiled modules) into a fresh
``Runtime`` and drives ``apply_rotary_emb`` / ``attention`` / the FP8 policy as a user
would. The fake devices stand in for GPUs this CPU machine lacks; the fake compiled
modules compute the right answer (through the torch path) or fail the way a real binary
fails. Registry-level rejections (malformed manifests, API versions, allow/deny lists...)
are covered in ``test_registry.py``; here each fault is followed to the user's result.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from fakes import A100_OLD_DRIVER, H200, L20, FakeEntryPoint, entry_points, fake_module, manifest
from reference import attention_ref, rotary_ref, rotary_tables, tolerance

from astrai.extension import attention
from astrai.extension.backend import fp8 as fp8_policy
from astrai.extension.backend import rotary
from astrai.extension.device import DeviceInfo
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.ops import _plugin
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.runtime import Runtime, current_runtime, use_runtime

H200_B = DeviceInfo(type="cuda", index=4, name="NVIDIA H200", capability=(9, 0), driver_cuda=(13, 0))
H200_OLD_DRIVER = DeviceInfo(type="cuda", index=2, name="NVIDIA H200", capability=(9, 0), driver_cuda=(12, 4))
H200_DRIVER_UNKNOWN = DeviceInfo(type="cuda", index=3, name="NVIDIA H200", capability=(9, 0), driver_cuda=None)

NO_IMAGE = ("CUDA error cudaErrorNoKernelImageForDevice: no kernel image is available for execution "
            "on the device [`cudaLaunchKernelExC(&config, kernel, args)` at rotary_emb.cu:131]")
IMAGE_FAILURES = {
    "no kernel image": NO_IMAGE,
    "invalid device function": "CUDA error cudaErrorInvalidDeviceFunction: invalid device function",
    "ptx too new for the driver": ("CUDA error cudaErrorUnsupportedPtxVersion: the provided PTX was "
                                   "compiled with an unsupported toolchain."),
    "runtime newer than the driver": ("CUDA error cudaErrorInsufficientDriver: CUDA driver version is "
                                      "insufficient for CUDA runtime version"),
}


# -- fake plugins and the rotary wiring ------------------------------------------------


class Kernels:
    """Fake compiled modules: ``good`` ones compute the torch result, ``failing`` ones
    raise ``error`` from every call; counts imports and launches."""

    def __init__(self, failing: dict[str, str] | None = None, import_delay: float = 0.0):
        self.failing = failing or {}
        self.import_delay = import_delay
        self.imports: list[str] = []
        self.launches: list[str] = []
        self._lock = threading.Lock()

    def importer(self, name: str):
        time.sleep(self.import_delay)  # widens the window in which racing threads could double-import
        with self._lock:
            self.imports.append(name)

        def rotary_emb(x, cos, sin):
            with self._lock:
                self.launches.append(name)
            if name in self.failing:
                raise RuntimeError(self.failing[name])
            return rotary.rotary_torch(x, cos, sin)

        return fake_module(name, rotary_emb=rotary_emb, build_info=lambda: {"archs": "80"})


def rotary_plugin(name="astrai-elementwise", module="fake_rotary_module", **overrides) -> FakeEntryPoint:
    ops = {"rotary_emb": {"module": module, "abi": 1, "dtypes": ["bfloat16"]}}
    return FakeEntryPoint(name, manifest(name=name, ops=ops, **overrides), dist=name)


def runtime_of(kernels: Kernels, *eps) -> Runtime:
    return Runtime(Registry(entry_points(*eps), importer=kernels.importer))


@pytest.fixture
def on_device(monkeypatch):
    """``on_device(info)`` makes every tensor look like it lives on ``info`` to the rotary
    policy and the ops layer, and routes the op through ``_plugin.require`` (what the real
    ``ops.rotary.rotary_emb_unchecked`` does with a CUDA tensor)."""
    current = [H200]

    def set_device(info: DeviceInfo) -> None:
        current[0] = info
        # A tensor on another GPU has another x.device, so another rotary plan; the CPU
        # stand-in's device cannot change: forget the plans instead (not the decisions).
        current_runtime().resolver.derived.pop("rotary_plans", None)

    monkeypatch.setattr(rotary, "probe_device", lambda device=None: current[0])
    monkeypatch.setattr(_plugin, "probe_device", lambda device=None: current[0])
    monkeypatch.setattr(rotary.ops_rotary, "rotary_emb_unchecked",
                        lambda x, cos, sin, *layout: _plugin.require("rotary_emb", x.device).rotary_emb(x, cos, sin))
    return set_device


def rope_inputs(b=2, seq=7, heads=4, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, seq, heads, d, generator=g).to(torch.bfloat16)
    cos, sin = rotary_tables(seq, d, offset=int(torch.randint(0, 4096, (1,), generator=g)))
    return x, cos, sin


def check_rope(out, x, cos, sin):
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(torch.bfloat16))


def recorded(caught, category=PluginRejectedWarning):
    return [str(w.message) for w in caught if issubclass(w.category, category)]


# -- a binary that cannot run on the device ---------------------------------------------


@pytest.mark.parametrize("error", IMAGE_FAILURES.values(), ids=IMAGE_FAILURES.keys())
def test_kernel_image_failure_at_first_launch_falls_back_with_one_warning(on_device, error):
    # The manifest claims sm_90a, the binary lacks it: the registry accepts the plugin and
    # the first launch fails. The op is marked unusable on that device, the call (and every
    # later one) gets the torch result, and the user sees exactly one warning.
    kernels = Kernels(failing={"fake_rotary_module": error})
    runtime = runtime_of(kernels, rotary_plugin(sass_archs=["sm_90a"], ptx_archs=[]))
    assert runtime.registry.op_status("rotary_emb", H200).usable
    with use_runtime(runtime), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            x, cos, sin = rope_inputs(seed=seed)
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
    (message,) = recorded(caught)
    assert "rotary_emb disabled on cuda:0" in message and error.split(":")[0] in message
    assert kernels.launches == ["fake_rotary_module"]  # tried once, never again
    status = runtime.registry.op_status("rotary_emb", H200)
    assert not status.usable and "fake_rotary_module.rotary_emb cannot run here" in status.reason
    decision = runtime.explain("rotary_emb")[-1]
    assert decision.chosen == "torch" and "cannot run here" in decision.trace[0].reason


def test_other_launch_errors_propagate_and_keep_the_op(on_device):
    # An illegal address is a bug (or a corrupted context), not a missing image: it must
    # reach the user, and the op stays enabled.
    illegal = "CUDA error cudaErrorIllegalAddress: an illegal memory access was encountered"
    kernels = Kernels(failing={"fake_rotary_module": illegal})
    runtime = runtime_of(kernels, rotary_plugin())
    x, cos, sin = rope_inputs()
    with use_runtime(runtime), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress"):
            rotary.apply_rotary_emb(x, (cos, sin))
    assert runtime.registry.op_status("rotary_emb", H200).usable


def test_image_error_classification():
    assert _plugin.is_image_error(RuntimeError(NO_IMAGE))
    assert not _plugin.is_image_error(RuntimeError("CUDA error cudaErrorLaunchOutOfResources: too many resources"))
    assert not _plugin.is_image_error(ValueError("no kernel image is available"))  # argument errors never


def test_direct_op_reports_the_failure_and_then_the_reason(on_device):
    # ops.* never fall back: the first call raises the CUDA error, later ones the reason.
    kernels = Kernels(failing={"fake_rotary_module": NO_IMAGE})
    runtime = runtime_of(kernels, rotary_plugin())
    x, cos, sin = rope_inputs()
    with use_runtime(runtime):
        with pytest.warns(PluginRejectedWarning, match="no kernel image"), pytest.raises(RuntimeError, match="cudaErrorNoKernelImageForDevice"):
            _plugin.require("rotary_emb", "cuda").rotary_emb(x, cos, sin)
        with pytest.raises(RuntimeError, match=r"needs the astrai-elementwise plugin, which is not usable here \(.*no kernel image"):
            _plugin.require("rotary_emb", "cuda")


# -- driver older than the plugin's CUDA --------------------------------------------------


def test_driver_older_than_plugin_cuda_end_to_end(on_device):
    kernels = Kernels()
    runtime = runtime_of(kernels, rotary_plugin())
    on_device(H200_OLD_DRIVER)
    x, cos, sin = rope_inputs()
    with use_runtime(runtime), torch.no_grad():
        with pytest.warns(PluginRejectedWarning, match="built for CUDA 13.0, the driver supports CUDA 12.4") as caught:
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
        assert len(caught) == 1
        # The direct op names the fix: the CUDA 12.4 index for this driver.
        with pytest.raises(RuntimeError, match=r"built for CUDA 13.0.*--extra-index-url \S+/cu124"):
            _plugin.require("rotary_emb", "cuda")
    assert kernels.imports == [] and kernels.launches == []  # the binary was never touched
    assert "driver supports CUDA 12.4" in runtime.explain("rotary_emb")[0].trace[0].reason


def test_unreadable_driver_version_then_insufficient_driver_at_launch(on_device):
    # When libcuda's version can't be read, the registry can't reject up front; the
    # binary's own cudart then fails at launch and the call still falls back.
    kernels = Kernels(failing={"fake_rotary_module": IMAGE_FAILURES["runtime newer than the driver"]})
    runtime = runtime_of(kernels, rotary_plugin())
    on_device(H200_DRIVER_UNKNOWN)
    x, cos, sin = rope_inputs()
    with use_runtime(runtime), torch.no_grad():
        with pytest.warns(PluginRejectedWarning, match="cudaErrorInsufficientDriver"):
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)


def test_fp8_gemm_on_an_old_driver_is_emulated_with_the_reason():
    ops = {"fp8_gemm": {"module": "m", "abi": 1, "min_sm": 89, "native_sm": [89, 120],
                        "dtypes": ["float8_e4m3fn", "float8_e5m2"]}}
    runtime = Runtime(Registry(entry_points(FakeEntryPoint("fp8", manifest("astrai-fp8", ops=ops))),
                               importer=lambda name: pytest.fail(f"imported {name}")))
    old_ada = DeviceInfo(type="cuda", index=5, name="L20", capability=(8, 9), driver_cuda=(12, 4))
    with pytest.warns(PluginRejectedWarning, match="driver supports CUDA 12.4"):
        chosen = fp8_policy.choose_gemm(old_ada, "e4m3", "e4m3", runtime=runtime)
    assert chosen == "scaled_mm"
    assert "driver supports CUDA 12.4" in runtime.explain("fp8_gemm")[0].trace[0].reason


# -- the environment variable -----------------------------------------------------------


def test_bad_astr_backend_names_the_valid_values_before_any_work(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "nonsense")
    cache = PagedKVCache(1, 8, 4, 2, 16, dtype=torch.float32)
    cache.k_pages.normal_()  # torch.empty pages may hold NaN, which never compares equal
    cache.add_sequence(0)
    cache.plan([0], [3])
    before = cache.k_pages.clone()
    q, k, v = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    with use_runtime(Runtime(Registry(entry_points()))):
        with pytest.raises(ValueError, match=r"^ASTR_BACKEND='nonsense' is not an attention backend: "
                                             r"valid values are cuda, flash, torch_native$"):
            attention(q, k, v, kv_cache=cache, layer_id=0)
    assert torch.equal(cache.k_pages, before)  # rejected before the cache write
    monkeypatch.setenv("ASTR_BACKEND", " Torch_Native ")  # case and spaces are forgiven
    with use_runtime(Runtime(Registry(entry_points()))):
        out = attention(q, k, v)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v), **tolerance(torch.float32))


# -- two plugins, one op ----------------------------------------------------------------


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_two_plugins_same_op_run_the_same_binary_whatever_the_order(on_device, order):
    plugins = [rotary_plugin("zeta-rotary", "zeta_kernels"),
               rotary_plugin("astrai-elementwise", "astrai_kernels"),
               rotary_plugin("acme-rotary", "acme_kernels")]
    kernels = Kernels()
    runtime = runtime_of(kernels, *(plugins[i] for i in order))
    x, cos, sin = rope_inputs()
    with use_runtime(runtime), torch.no_grad():
        check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
    assert kernels.imports == ["acme_kernels"] and kernels.launches == ["acme_kernels"]
    trace = dict(runtime.registry.op_status("rotary_emb", H200).trace)
    assert trace == {"acme-rotary": "accepted", "astrai-elementwise": "shadowed by acme-rotary",
                     "zeta-rotary": "shadowed by acme-rotary"}


def test_when_the_winner_breaks_the_next_plugin_takes_over(on_device):
    kernels = Kernels(failing={"acme_kernels": NO_IMAGE})
    runtime = runtime_of(kernels, rotary_plugin("astrai-elementwise", "astrai_kernels"),
                         rotary_plugin("acme-rotary", "acme_kernels"))
    x, cos, sin = rope_inputs()
    with use_runtime(runtime), torch.no_grad():
        with pytest.warns(PluginRejectedWarning, match="no kernel image"):
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
        # The op is now unusable on the device as a whole (the registry keeps one verdict
        # per op and device), so the next call takes the torch path, not astrai_kernels.
        check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
    assert kernels.launches == ["acme_kernels"]


# -- discovery imports nothing but manifests ---------------------------------------------


def _write_plugin(root, package: str, dist: str, *, manifest_raises: bool = False) -> None:
    """A plugin on disk: a pure-Python manifest module, a 'compiled' module that blows up
    when imported, and the dist-info that registers the entry point."""
    pkg = root / package
    pkg.mkdir()
    body = "raise RuntimeError('manifest module imported')\n" if manifest_raises else ""
    (pkg / "__init__.py").write_text(body + textwrap.dedent(f"""
        def manifest():
            return {{
                "api_version": 1, "name": "{dist}", "version": "0.1.0+cu130",
                "core_requires": ">=0.1.0,<0.2.0", "cuda": "13.0",
                "sass_archs": ["sm_80", "sm_90a"], "ptx_archs": ["compute_90"],
                "ops": {{"rotary_emb": {{"module": "{package}._kernels", "abi": 1, "dtypes": ["bfloat16"]}}}},
            }}
    """))
    (pkg / "_kernels.py").write_text("raise SystemExit('compiled module imported')\n")
    info = root / f"{package}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[astrai.kernels]\nrotary = {package}:manifest\n")


def test_discovery_imports_only_the_manifest_module(tmp_path, monkeypatch):
    _write_plugin(tmp_path, "boomplug", "boom-rotary")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry()
    (record,) = [r for r in registry.plugins() if r.name == "boom-rotary"]
    assert record.manifest is not None
    status = registry.op_status("rotary_emb", H200)
    assert status.usable or "shadowed" not in status.reason
    assert "boomplug" in sys.modules and "boomplug._kernels" not in sys.modules


def test_import_astrai_and_doctor_never_import_a_compiled_module(tmp_path):
    _write_plugin(tmp_path, "boomplug", "boom-rotary")
    _write_plugin(tmp_path, "deniedplug", "denied-rotary", manifest_raises=True)
    script = textwrap.dedent("""
        import sys, io, contextlib
        import astrai, astrai.extension, astrai.extension.ops
        from astrai.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            main.main(["doctor", "--json"])
        assert "boom-rotary" in out.getvalue(), out.getvalue()
        loaded = sorted(m for m in sys.modules if m.startswith(("boomplug", "deniedplug")))
        print(",".join(loaded))
    """)
    env = {"PYTHONPATH": str(tmp_path), "ASTRAI_PLUGINS_DENY": "denied-rotary", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # The manifest module of the allowed plugin ran; the denied plugin's code never did.
    assert result.stdout.strip().splitlines()[-1] == "boomplug"


def test_disabled_discovery_reads_no_entry_point(monkeypatch):
    def never():
        raise AssertionError("entry points were read")

    monkeypatch.setenv("ASTRAI_DISABLE_PLUGINS", "1")
    assert Registry.from_environment().plugins() == ()
    assert Registry(never, enabled=False).plugins() == ()


# -- per device ------------------------------------------------------------------------


def test_decisions_are_per_device(on_device):
    # One process, three GPUs: the binary has sm_90a only. The L20 gets the torch path
    # with the reason; a kernel-image failure on one H200 leaves the other H200 on the kernel.
    kernels = Kernels()
    runtime = runtime_of(kernels, rotary_plugin(sass_archs=["sm_90a"], ptx_archs=[]))
    x, cos, sin = rope_inputs()
    with use_runtime(runtime), torch.no_grad():
        on_device(H200)
        check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
        on_device(L20)
        with pytest.warns(PluginRejectedWarning, match="no SASS or PTX for sm_89"):
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
        kernels.failing["fake_rotary_module"] = NO_IMAGE
        on_device(H200_B)
        with pytest.warns(PluginRejectedWarning, match="rotary_emb disabled on cuda:4"):
            check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
        check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)  # decided again: torch
        del kernels.failing["fake_rotary_module"]
        on_device(H200)
        check_rope(rotary.apply_rotary_emb(x, (cos, sin)), x, cos, sin)
    assert kernels.launches == ["fake_rotary_module"] * 3  # cuda:0, cuda:4 (failed), cuda:0
    # The failure cleared the decision cache; what was decided since:
    chosen = {d.key.device.key: d.chosen for d in runtime.explain("rotary_emb")}
    assert chosen == {"cuda:4": "torch", "cuda:0": "cuda"}
    assert runtime.registry.op_status("rotary_emb", H200).usable
    assert not runtime.registry.op_status("rotary_emb", H200_B).usable
    assert not runtime.registry.op_status("rotary_emb", L20).usable


# -- many threads, first use ------------------------------------------------------------


def run_threads(n: int, work):
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def worker(i):
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_first_use_from_many_threads_one_import_one_decision(on_device):
    kernels = Kernels(import_delay=0.05)
    runtime = runtime_of(kernels, rotary_plugin())
    inputs = [rope_inputs(seed=i) for i in range(16)]

    def work(i):
        x, cos, sin = inputs[i]
        with use_runtime(runtime), torch.no_grad():
            return rotary.apply_rotary_emb(x, (cos, sin))

    for out, (x, cos, sin) in zip(run_threads(16, work), inputs):
        check_rope(out, x, cos, sin)
    assert kernels.imports == ["fake_rotary_module"]
    assert len(kernels.launches) == 16
    assert [d.chosen for d in runtime.explain("rotary_emb")] == ["cuda"]


def test_kernel_image_failure_in_many_threads_warns_once(on_device):
    kernels = Kernels(failing={"fake_rotary_module": NO_IMAGE}, import_delay=0.02)
    runtime = runtime_of(kernels, rotary_plugin())
    inputs = [rope_inputs(seed=i) for i in range(12)]

    def work(i):
        x, cos, sin = inputs[i]
        with use_runtime(runtime), torch.no_grad():
            return rotary.apply_rotary_emb(x, (cos, sin))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warnings.warn call is recorded
        results = run_threads(12, work)
    for out, (x, cos, sin) in zip(results, inputs):
        check_rope(out, x, cos, sin)
    assert len(recorded(caught)) == 1
    assert kernels.imports == ["fake_rotary_module"]
    x, cos, sin = inputs[0]
    with use_runtime(runtime), torch.no_grad():
        rotary.apply_rotary_emb(x, (cos, sin))
    assert [d.chosen for d in runtime.explain("rotary_emb")] == ["torch"]


def test_import_failure_in_many_threads_warns_once(on_device):
    kernels = Kernels(import_delay=0.02)

    def broken(name):
        kernels.importer(name)
        raise ImportError("libcudart.so.13: cannot open shared object file")

    runtime = Runtime(Registry(entry_points(rotary_plugin()), importer=broken))
    inputs = [rope_inputs(seed=i) for i in range(8)]

    def work(i):
        x, cos, sin = inputs[i]
        with use_runtime(runtime), torch.no_grad():
            return rotary.apply_rotary_emb(x, (cos, sin))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threads(8, work)
    for out, (x, cos, sin) in zip(results, inputs):
        check_rope(out, x, cos, sin)
    assert len(recorded(caught)) == 1 and "libcudart.so.13" in recorded(caught)[0]
    assert len(kernels.imports) == 1


def test_attention_first_use_from_many_threads(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    runtime = Runtime(Registry(entry_points()))
    g = torch.Generator().manual_seed(3)
    calls = [tuple(torch.randn(2, n, h, 32, generator=g) for n, h in ((5, 8), (9, 2), (9, 2))) for _ in range(12)]

    def work(i):
        with use_runtime(runtime):
            return attention(*calls[i], is_causal=True)

    for out, (q, k, v) in zip(run_threads(12, work), calls):
        torch.testing.assert_close(out.double(), attention_ref(q, k, v, is_causal=True), **tolerance(torch.float32))
    assert len(runtime.explain("attention")) == 1


def test_fp8_gemm_first_use_from_many_threads():
    runtime = Runtime(Registry(entry_points()))
    g = torch.Generator().manual_seed(5)
    calls = [((torch.randn(16, 32, generator=g) * 4).to(torch.float8_e4m3fn),
              (torch.randn(32, 8, generator=g) * 4).to(torch.float8_e4m3fn)) for _ in range(8)]
    scale = torch.tensor(0.25)

    def work(i):
        return fp8_policy.gemm(*calls[i], scale, runtime=runtime)

    for out, (a, b) in zip(run_threads(8, work), calls):
        expected = (0.25 * (a.double() @ b.double())).to(torch.bfloat16)
        torch.testing.assert_close(out.double(), expected.double(), atol=1e-3, rtol=2 ** -7)
    assert [d.chosen for d in runtime.explain("fp8_gemm")] == ["emulated"]
