"""Dense prefill's measured preference: the plugin's table writer and what the manifest ships."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "packages" / "astrai-attention" / "src"))
from astrai_attention import prefill_table  # noqa: E402

from astrai.extension.backend import fp8_prefer  # noqa: E402


def _bench(rows):
    return {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "rows": rows}


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


def test_table_verdicts_name_the_measurement():
    bench = _bench([_row("4x4096", 128, True, "astrai contiguous", 1000.0),
                    _row("4x4096", 128, True, "torch path", 1500.0),
                    _row("4x4096", 128, False, "astrai contiguous", 1000.0),
                    _row("4x4096", 128, False, "torch path", 800.0)])
    prefer = {"90": prefill_table.from_bench(bench, commit="abc1234", date="2026-12-01")}
    win = fp8_prefer.verdict(prefer, 90, (4 * 4096, 4096, 128), "causal")
    assert win.plugin_faster and "1.50x torch" in win.reason and "abc1234" in win.reason
    lose = fp8_prefer.verdict(prefer, 90, (2 * 3000, 3000, 128), "full")
    assert not lose.plugin_faster and "torch is faster" in lose.reason
    assert fp8_prefer.verdict(prefer, 89, (4096, 4096, 128), "causal") is None  # no table for sm_89


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
