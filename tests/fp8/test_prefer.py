"""The measured preference table: the plugin's GEMM runs on sm_90 only where it beat cuBLASLt.

* ``backend.prefer``: parsing, nearest-class lookup, the verdict and its reason;
* the policy both ways through fake manifests (plugin faster / cuBLASLt faster), the
  reason in the resolver trace, the M bucket in the decision key;
* malformed tables never break the registry: the plugin stays accepted (its quantize
  runs), the GEMM falls back to cuBLASLt with the table's error as the reason;
* the astrai-fp8 manifest: 90 native and ``prefer`` only in a build with sm_90a, the
  shipped ``sm90_table.json`` well formed and made from a real run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from astrai.extension.backend import fp8 as backend
from astrai.extension.backend import prefer
from astrai.extension.manifest import parse_manifest
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime
from fakes import H200, L20, FakeEntryPoint, entry_points, manifest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "packages" / "astrai-fp8" / "src"))
import astrai_fp8  # noqa: E402
from astrai_fp8 import sm90_table  # noqa: E402


def _cls(m, n, k, ours, peer, mode="promote"):
    return {"m": m, "n": n, "k": k, "mode": mode, "ours_ms": ours, "peer_ms": peer}


TABLE = {
    "peer": "scaled_mm",
    "measured": "NVIDIA H200, commit abc1234, 2026-11-29",
    "classes": [
        _cls(1, 8192, 8192, 0.040, 0.020),        # 0.50x: cuBLASLt
        _cls(1024, 8192, 8192, 0.100, 0.104),     # 1.04x: plugin
        _cls(8192, 8192, 8192, 1.000, 0.950),     # 0.95x: cuBLASLt
        _cls(1024, 28672, 8192, 0.400, 0.500),    # 1.25x: plugin
        _cls(8192, 8192, 8192, 0.900, 0.950, "fast"),
    ],
}


def _ops(entry=None, native=(89, 90, 120)):
    gemm = {"module": "fake_fp8_ops", "abi": 1, "min_sm": 89, "native_sm": list(native),
            "dtypes": ["float8_e4m3fn", "float8_e5m2"]}
    if entry is not None:
        gemm["prefer"] = entry
    return {"fp8_quantize": {"module": "fake_fp8_ops", "abi": 1, "min_sm": 89,
                             "dtypes": ["float32", "float16", "bfloat16"]},
            "fp8_gemm": gemm}


def _runtime(entry=None, **kw) -> Runtime:
    raw = manifest("astrai-fp8", ops=_ops(entry, **kw))
    return Runtime(Registry(entry_points(FakeEntryPoint("fp8", raw, dist="astrai-fp8")),
                            importer=lambda name: pytest.fail(f"imported {name}")))


def _trace(runtime: Runtime):
    (decision,) = runtime.explain("fp8_gemm")
    return decision.trace


# ------------------------------------------------------------------ table, lookup


def test_parse_and_ratio():
    table = prefer.parse_table(TABLE)
    assert table.peer == "scaled_mm" and len(table.classes) == 5
    assert table.classes[1].ratio == pytest.approx(1.04)
    assert table.classes[1].shape == "1024x8192x8192"


@pytest.mark.parametrize("shape, expect", [
    ((1024, 8192, 8192), (1024, 8192, 8192)),   # exact
    ((2048, 8192, 8192), (1024, 8192, 8192)),   # 1 step from 1024, 2 from 8192: 1024
    ((4096, 8192, 8192), (8192, 8192, 8192)),   # 2 from 1024, 1 from 8192
    ((16, 8192, 8192), (1, 8192, 8192)),        # 4 steps from 1, 6 from 1024
    ((1024, 32768, 8192), (1024, 28672, 8192)),
    ((1024, 10240, 8192), (1024, 8192, 8192)),  # log2(10240/8192) < log2(28672/10240)
])
def test_nearest_class_in_log_space(shape, expect):
    near = prefer.parse_table(TABLE).nearest(*shape, "promote")
    assert (near.m, near.n, near.k) == expect


def test_nearest_respects_the_mode():
    table = prefer.parse_table(TABLE)
    assert table.nearest(16, 8192, 8192, "fast").ours_ms == 0.9
    assert table.nearest(16, 8192, 8192, "other") is None


def test_verdict_reasons():
    yes = prefer.verdict({"90": TABLE}, 90, (1024, 8192, 8192), "promote")
    assert yes.plugin_faster
    assert yes.reason.startswith("measured 1.04x scaled_mm at 1024x8192x8192 promote")
    assert "commit abc1234" in yes.reason
    no = prefer.verdict({"90": TABLE}, 90, (8192, 8192, 8192), "promote")
    assert not no.plugin_faster and "0.95x" in no.reason and "scaled_mm is faster there" in no.reason
    near = prefer.verdict({"90": TABLE}, 90, (1024, 28672, 4096), "promote")
    assert near.plugin_faster and "nearest to 1024x28672x4096" in near.reason
    assert prefer.verdict({"90": TABLE}, 89, (1024, 8192, 8192), "promote") is None
    assert prefer.verdict(None, 90, (1024, 8192, 8192), "promote") is None


def test_a_tie_keeps_the_peer():
    tie = {"peer": "scaled_mm", "classes": [_cls(1024, 8192, 8192, 0.1, 0.1)]}
    assert not prefer.verdict({"90": tie}, 90, (1024, 8192, 8192), "promote").plugin_faster


# ------------------------------------------------------------------ the policy


def test_policy_prefers_the_plugin_where_measured_faster():
    runtime = _runtime({"90": TABLE})
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime, shape=(1024, 8192, 8192)) == "plugin"
    plugin, peer, _ = _trace(runtime)
    assert plugin.accepted and "measured 1.04x scaled_mm at 1024x8192x8192 promote" in plugin.reason
    assert peer.accepted and "lower priority" in peer.reason


def test_policy_keeps_cublaslt_where_it_is_faster():
    runtime = _runtime({"90": TABLE})
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime, shape=(8192, 8192, 8192)) == "scaled_mm"
    plugin, peer, _ = _trace(runtime)
    assert not plugin.accepted and "measured 0.95x" in plugin.reason
    assert "astrai-fp8 0.1.0+cu130" in plugin.reason
    assert peer.accepted and peer.reason == "capable"


def test_m_is_bucketed_to_a_power_of_two():
    runtime = _runtime({"90": TABLE})
    for m in (513, 700, 1000, 1024):  # all class 1024
        assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime, shape=(m, 8192, 8192)) == "plugin"
    assert len(runtime.explain("fp8_gemm")) == 1
    assert backend.shape_class(1, 8, 16) == (1, 8, 16)
    assert backend.shape_class(1025, 8, 16) == (2048, 8, 16)


def test_no_shape_keeps_cublaslt():
    runtime = _runtime({"90": TABLE})
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime) == "scaled_mm"
    assert "needs the call's M, N, K" in _trace(runtime)[0].reason
    assert backend.wants_k_major(H200, "e4m3", "e4m3", runtime=runtime)


def test_the_table_of_one_arch_leaves_the_others_alone():
    runtime = _runtime({"90": TABLE})
    assert backend.choose_gemm(L20, "e4m3", "e4m3", runtime=runtime, shape=(8192, 8192, 8192)) == "plugin"
    assert _trace(runtime)[0].reason == "capable"


def test_native_without_a_table_still_means_plugin_first():
    runtime = _runtime(None)
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime, shape=(8192, 8192, 8192)) == "plugin"


@pytest.mark.parametrize("entry, words", [
    ("not a dict", "'prefer' must be a dict"),
    ({"90": "sm90_table.json unreadable: OSError: gone"}, "unreadable"),
    ({"90": {"classes": TABLE["classes"]}}, "'peer' must be a backend name"),
    ({"90": {"peer": "scaled_mm", "classes": []}}, "'classes' must be a non-empty list"),
    ({"90": {"peer": "scaled_mm", "classes": [_cls(1024, 8192, 8192, -1.0, 0.1)]}}, "'ours_ms' must be a positive"),
    ({"90": {"peer": "scaled_mm", "classes": [_cls(1024, 8192, 8192, float("nan"), 0.1)]}}, "positive"),
    ({"90": {"peer": "scaled_mm", "classes": [{**_cls(1024, 8192, 8192, 0.1, 0.2), "m": "1024"}]}},
     "'m' must be a positive int"),
    ({"90": {"peer": "scaled_mm", "classes": [{**_cls(1024, 8192, 8192, 0.1, 0.2), "mode": None}]}},
     "'mode' must be a string"),
    ({"90": {"peer": "scaled_mm", "classes": ["row"]}}, "class 0 must be a dict"),
])
def test_a_malformed_table_keeps_the_plugin_but_not_its_gemm(entry, words):
    runtime = _runtime(entry)
    status = runtime.registry.op_status("fp8_gemm", H200)
    assert status.usable  # the registry accepts the plugin
    assert runtime.registry.op_status("fp8_quantize", H200).usable
    assert backend.choose_quantize(H200, torch.bfloat16, "e4m3", runtime=runtime) == "plugin"
    assert backend.choose_gemm(H200, "e4m3", "e4m3", runtime=runtime, shape=(1024, 8192, 8192)) == "scaled_mm"
    reason = _trace(runtime)[0].reason
    assert words in reason and "peer is used" in reason


def test_gemm_passes_the_shape(monkeypatch):
    """End to end through backend.gemm: the class decides which implementation runs."""
    from astrai.extension.backend import fp8_torch
    from astrai.extension.ops import fp8 as ops_fp8

    ran = []

    def fake(name):
        def run(a, b, scale, bias=None):
            ran.append(name)
            return (scale * (a.float() @ b.float())).to(torch.bfloat16)
        return run

    monkeypatch.setattr(ops_fp8, "mm_fp8", fake("plugin"))
    monkeypatch.setattr(fp8_torch, "scaled_mm_gemm", fake("scaled_mm"))
    monkeypatch.setattr(backend, "probe_device", lambda device: H200)
    table = {"peer": "scaled_mm", "classes": [_cls(1024, 48, 32, 1.0, 2.0), _cls(16, 48, 32, 2.0, 1.0)]}
    runtime = _runtime({"90": table})
    b = torch.randn(32, 48).to(torch.float8_e4m3fn)
    for m in (1024, 16):
        a = torch.randn(m, 32).to(torch.float8_e4m3fn)
        out = backend.gemm(a, b, torch.tensor(0.5), runtime=runtime)
        torch.testing.assert_close(out, (0.5 * (a.float() @ b.float())).to(torch.bfloat16))
    assert ran == ["plugin", "scaled_mm"]


# ------------------------------------------------------------------ the plugin's side


def _build_info(sass):
    return {"version": "0.1.0+cu130", "cuda": "13.0", "sass_archs": sass, "ptx_archs": [],
            "modules": {"_fp8_ops": {"sass_archs": sass, "ptx_archs": []}}}


def test_manifest_marks_90_native_and_ships_the_table_with_sm90a(monkeypatch):
    monkeypatch.setattr(astrai_fp8, "build_info", lambda: _build_info(["sm_89", "sm_90a", "sm_120"]))
    parsed = parse_manifest(astrai_fp8.manifest())
    gemm = parsed.ops["fp8_gemm"]
    assert gemm.native_sm == (89, 90, 120)
    table = prefer.table_for(gemm.prefer, 90)
    assert table.peer == "scaled_mm" and table.classes
    assert prefer.table_for(gemm.prefer, 89) is None


def test_manifest_without_sm90a_is_not_native_on_90(monkeypatch):
    monkeypatch.setattr(astrai_fp8, "build_info", lambda: _build_info(["sm_89", "sm_120"]))
    gemm = parse_manifest(astrai_fp8.manifest()).ops["fp8_gemm"]
    assert gemm.native_sm == (89, 120) and gemm.prefer is None


def test_a_missing_table_file_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setattr(sm90_table, "TABLE_FILE", "no_such_table.json")
    value = sm90_table.load()
    assert isinstance(value, str) and "no_such_table.json unreadable" in value
    v = prefer.verdict({"90": value}, 90, (1024, 8192, 8192), "promote")
    assert not v.plugin_faster and "unreadable" in v.reason


def test_the_shipped_table_comes_from_a_real_run():
    raw = json.loads((REPO / "packages/astrai-fp8/src/astrai_fp8/sm90_table.json").read_text())
    table = prefer.parse_table(raw)
    assert raw["sm"] == 90 and "H200" in raw["device"] and raw["commit"] and raw["date"]
    assert {c.mode for c in table.classes} == {"promote", "fast"}
    ms = {c.m for c in table.classes}
    assert {1, 1024, 8192} <= ms
    for c in raw["classes"]:
        assert c["ratio"] == pytest.approx(c["peer_ms"] / c["ours_ms"], abs=1e-3)


def test_from_bench_skips_rows_without_a_peer_time():
    bench = {"device": "NVIDIA H200", "torch": "2.11", "rows": [
        {"M": 1024, "N": 8192, "K": 8192, "ours_promote_ms": 0.1, "cublas_promote_ms": 0.11,
         "ours_fast_ms": 0.09, "cublas_fast_ms": 0.1},
        {"M": 77, "N": 300, "K": 272, "ours_promote_ms": 0.01, "cublas_promote_ms": None,
         "ours_fast_ms": 0.01, "cublas_fast_ms": None},
    ]}
    table = sm90_table.from_bench(bench, commit="abc1234", date="2026-11-29")
    assert [(c["m"], c["mode"]) for c in table["classes"]] == [(1024, "promote"), (1024, "fast")]
    assert table["measured"] == "NVIDIA H200, commit abc1234, 2026-11-29"
    assert prefer.parse_table(table).classes[0].ratio == pytest.approx(1.1)
    with pytest.raises(ValueError, match="no row"):
        sm90_table.from_bench({"rows": bench["rows"][1:]}, commit="x", date="y")


def test_from_bench_keeps_the_less_favourable_of_two_runs():
    row = {"M": 8192, "N": 8192, "K": 8192, "ours_promote_ms": 1.0, "cublas_promote_ms": 1.1}
    again = dict(row, cublas_promote_ms=0.9)
    table = sm90_table.from_bench({"rows": [row, again]}, commit="c", date="d")
    assert [c["ratio"] for c in table["classes"]] == [0.9]


@pytest.mark.parametrize("dynamic", [True, False])
def test_compiled_gemm_with_symbolic_or_static_sizes(dynamic):
    """Under torch.compile the decision is made at trace time without the shape (sizes may
    be symbolic), for dynamic and static graphs alike, with no graph break."""
    b = (torch.randn(32, 8) * 4).to(torch.float8_e4m3fn)

    def fn(a, b):
        return backend.gemm(a, b, torch.tensor(0.5))

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for m in (16, 24):
        a = (torch.randn(m, 32) * 4).to(torch.float8_e4m3fn)
        torch.testing.assert_close(compiled(a, b), fn(a, b), atol=0, rtol=0)
