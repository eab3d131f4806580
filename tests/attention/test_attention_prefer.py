"""Dense prefill's measured preference: the plugin's table writer, what the manifest ships, and
the CUDA backend's decision for dense calls (the plugin where the table says it is faster)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "packages" / "astrai-attention" / "src"))
from astrai_attention import prefill_table  # noqa: E402

from astrai.extension.backend import prefer  # noqa: E402
from astrai.extension.backend.attention import (  # noqa: E402
    ATTN_BACKEND, AttentionPolicy, CudaBackend, TorchNativeBackend, attn_backend)
from astrai.extension.backend.attention import cuda as cuda_backend  # noqa: E402
from astrai.extension.backend.attention.base import AttentionCall  # noqa: E402
from astrai.extension.registry import Registry  # noqa: E402
from astrai.extension.runtime import Runtime, use_runtime  # noqa: E402
from fakes import H200, L20, FakeEntryPoint, entry_points, manifest  # noqa: E402


def _bench(rows, heads=(32, 8)):
    return {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "heads": list(heads), "rows": rows}


def _row(shape, d, causal, impl, us):
    return {"shape": shape, "d": d, "causal": causal, "impl": impl, "us": us}


def test_table_from_bench_pairs_the_plugin_with_the_torch_path():
    bench = _bench([
        _row("4x4096", 128, True, "astrai contiguous", 1000.0),
        _row("4x4096", 128, True, "torch path", 1500.0),
        _row("4x4096", 128, True, "sdpa cudnn", 900.0),  # a forced peer is not the fallback
        _row("1x16384", 64, False, "astrai contiguous", 2000.0),
        _row("1x16384", 64, False, "torch path", 1000.0),
        _row("ragged 64x128-1024", 128, True, "astrai paged p16", 500.0),  # no dense peer
        {"shape": "16x1024", "d": 256, "causal": True, "impl": "torch path", "error": "OutOfMemoryError"},
    ])
    table = prefill_table.from_bench(bench, commit="abc1234", date="2026-12-01")
    assert table["peer"] == "torch" and table["sm"] == 90
    by_key = {(c["m"], c["n"], c["k"], c["mode"]): c for c in table["classes"]}
    assert set(by_key) == {(16384, 4096, 128, "causal"), (16384, 16384, 64, "full")}
    assert by_key[(16384, 4096, 128, "causal")]["ratio"] == 1.5
    assert by_key[(16384, 16384, 64, "full")]["ours_ms"] == 2.0
    assert (table["q_heads"], table["kv_heads"]) == (32, 8) and "heads 32/8" in table["source"]


@pytest.mark.parametrize("heads,why", [
    (None, "needs 'heads'"),
    ((32, 32), "multiple of 4"),  # multi-head attention: one head per block, another kernel
    ((40, 8), "multiple of 4"),  # group 5: head slots left empty
    ((32, 6), "multiple of 4"),  # kv heads do not divide the query heads
])
def test_table_is_written_only_from_a_group_that_fills_the_blocks(heads, why):
    bench = _bench([_row("4x4096", 128, True, "astrai contiguous", 1.0), _row("4x4096", 128, True, "torch path", 2.0)])
    if heads is None:
        del bench["heads"]
    else:
        bench["heads"] = list(heads)
    with pytest.raises(ValueError, match=why):
        prefill_table.from_bench(bench, commit="x", date="y")


def test_table_verdicts_name_the_measurement():
    bench = _bench([_row("4x4096", 128, True, "astrai contiguous", 1000.0),
                    _row("4x4096", 128, True, "torch path", 1500.0),
                    _row("4x4096", 128, False, "astrai contiguous", 1000.0),
                    _row("4x4096", 128, False, "torch path", 800.0)])
    entry = {"90": prefill_table.from_bench(bench, commit="abc1234", date="2026-12-01")}
    win = prefer.verdict(entry, 90, (4 * 4096, 4096, 128), "causal")
    assert win.plugin_faster and "1.50x torch" in win.reason and "abc1234" in win.reason
    lose = prefer.verdict(entry, 90, (2 * 3000, 3000, 128), "full")
    assert not lose.plugin_faster and "torch is faster" in lose.reason
    assert prefer.verdict(entry, 89, (4096, 4096, 128), "causal") is None  # no table for sm_89


def test_table_needs_paired_rows():
    with pytest.raises(ValueError, match="torch path"):
        prefill_table.from_bench(_bench([_row("4x4096", 128, True, "astrai contiguous", 1.0)]),
                                 commit="x", date="y")


def test_manifest_ships_the_table_only_with_sm90a_code(monkeypatch):
    import astrai_attention

    info = {"version": "0.1.0+cu130", "cuda": "13.0", "sass_archs": ["sm_90a"], "ptx_archs": []}
    monkeypatch.setattr(astrai_attention, "build_info", lambda: dict(info))
    table = {"peer": "torch", "classes": []}
    monkeypatch.setattr(prefill_table, "load", lambda: table)
    ops = astrai_attention.manifest()["ops"]
    assert ops["attn_prefill"]["prefer"] == {"90": table}
    assert "prefer" not in ops["attn_paged_prefill"]  # no peer outside the plugin
    info["sass_archs"] = ["sm_80", "sm_89"]
    assert "prefer" not in astrai_attention.manifest()["ops"]["attn_prefill"]


# -- the CUDA backend's dense prefill decision ---------------------------------------------


ATTN_OPS = {op: {"module": "fake_attn", "abi": 1, "dtypes": ["bfloat16", "float16"], "head_dims": [64, 128, 256],
                 "min_sm": 80} for op in ("attn_prefill", "attn_paged_prefill", "attn_paged_decode")}


def _measured_table():
    """At d128: the plugin 1.5x the torch path causal at 4x4096, 0.8x without the mask."""
    return prefill_table.from_bench(_bench([
        _row("4x4096", 128, True, "astrai contiguous", 1000.0), _row("4x4096", 128, True, "torch path", 1500.0),
        _row("4x4096", 128, False, "astrai contiguous", 1000.0), _row("4x4096", 128, False, "torch path", 800.0),
    ]), commit="abc1234", date="2026-12-01")


@pytest.fixture
def runtime(monkeypatch):
    ops = {name: dict(spec) for name, spec in ATTN_OPS.items()}
    ops["attn_prefill"]["prefer"] = {"90": _measured_table()}
    rt = Runtime(Registry(entry_points(FakeEntryPoint("attention", manifest("astrai-attention", ops=ops))),
                          importer=lambda name: pytest.fail(f"imported {name}")))
    monkeypatch.setattr(cuda_backend, "probe_device", lambda device: H200)
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    with use_runtime(rt):
        yield rt


def _dense(causal=True, tokens=4 * 4096, kv=4096, mode="prefill", mask_ndim=0, needs_grad=False, heads=(32, 8)):
    return AttentionCall(torch.device("cuda", 0), torch.bfloat16, 128, *heads, mode, None, causal, mask_ndim, False,
                         None, needs_grad, (tokens, kv))


def _policy():
    return AttentionPolicy((CudaBackend(), TorchNativeBackend()))


def _trace(runtime):
    return {e.candidate: e for e in runtime.explain("attention")[-1].trace}


def test_dense_prefill_runs_the_plugin_where_measured_faster(runtime):
    assert _policy().select(_dense(causal=True)).name == "cuda"
    accepted = _trace(runtime)["cuda"]
    assert accepted.accepted and "measured 1.50x torch at 16384x4096x128 causal" in accepted.reason


def test_dense_prefill_keeps_torch_where_it_is_faster(runtime):
    assert _policy().select(_dense(causal=False)).name == "torch_native"
    passed_over = _trace(runtime)["cuda"]
    assert not passed_over.accepted and "0.80x torch" in passed_over.reason and "torch is faster" in passed_over.reason
    # an explicit selection asks for capability only
    with attn_backend(ATTN_BACKEND.CUDA):
        assert _policy().select(_dense(causal=False)).name == "cuda"


@pytest.mark.parametrize("heads,runs", [
    ((64, 8), "cuda"),  # group 8: the measured blocks of 4 heads, twice per kv head
    ((32, 32), "torch_native"),  # multi-head attention: one head per block, not measured
    ((40, 8), "torch_native"),  # group 5: three of eight head slots empty
    ((16, 8), "torch_native"),  # group 2: blocks of 2 heads
])
def test_dense_prefill_table_speaks_only_for_the_measured_heads(runtime, heads, runs):
    assert _policy().select(_dense(causal=True, heads=heads)).name == runs
    reason = _trace(runtime)["cuda"].reason
    if runs == "cuda":
        assert "measured 1.50x torch" in reason
    else:
        assert f"measured at heads 32/8 (GQA group 4); heads {heads[0]}/{heads[1]} run other blocks" in reason


def test_a_format_1_table_counts_as_measured_at_32_8(runtime):
    table = runtime.registry.op_status("attn_prefill", H200).spec.prefer["90"]
    del table["q_heads"], table["kv_heads"]
    table["format"] = 1
    assert _policy().select(_dense(heads=(32, 8))).name == "cuda"
    assert _policy().select(_dense(heads=(32, 32))).name == "torch_native"
    assert "heads 32/8" in _trace(runtime)["cuda"].reason


def test_dense_prefill_without_a_table_for_the_arch_keeps_torch(runtime, monkeypatch):
    monkeypatch.setattr(cuda_backend, "probe_device", lambda device: L20)
    assert _policy().select(_dense()).name == "torch_native"
    assert "no measured table" in _trace(runtime)["cuda"].reason


@pytest.mark.parametrize("call,why", [
    (_dense(mode="decode"), "dense decode"),
    (_dense(needs_grad=True), "no backward"),
    (_dense(mask_ndim=2), "no 'masked' class"),
])
def test_dense_calls_the_plugin_does_not_take(runtime, call, why):
    assert _policy().select(call).name == "torch_native"
    assert why in _trace(runtime)["cuda"].reason


def test_an_unreadable_table_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    (tmp_path / "prefill_table.json").write_text("{not json")
    monkeypatch.setattr(prefill_table, "files", lambda package: tmp_path)
    value = prefill_table.load()
    assert isinstance(value, str) and "prefill_table.json unreadable: JSONDecodeError" in value
    v = prefer.verdict({"90": value}, 90, (16384, 4096, 128), "causal")
    assert not v.plugin_faster and "unreadable" in v.reason


def test_the_shipped_table_parses_and_names_its_heads():
    table = prefill_table.load()
    assert table["format"] == prefill_table.FORMAT and table["sm"] == 90
    group = table["q_heads"] // table["kv_heads"]
    assert group % prefill_table.PACKED_HEADS == 0
    parsed = prefer.parse_table(table)
    assert parsed.peer == "torch" and {c.k for c in parsed.classes} == {64, 128, 256}
