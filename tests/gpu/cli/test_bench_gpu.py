"""``astrai bench --quick`` on the GPU: eager, CUDA-graph and host-overhead times per op,
kernels named as doctor names them, and the speed-up over the torch path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from astrai.cli import doctor

pytestmark = pytest.mark.gpu


def test_bench_reports_eager_graph_and_host_overhead(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "astrai.cli.main", "bench", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    for column in ("eager us/call", "graph us/call", "host overhead us", "speed-up"):
        assert column in run.stdout
    report = json.loads(out.read_text())
    assert report["kernels"] is True
    fallbacks = set(doctor.FALLBACKS.values())
    names = {row["name"] for row in report["results"]}
    assert {"paged decode", "prefill causal", "rotary"} <= names
    for row in report["results"]:
        assert row["eager_ms"] > 0, row
        if row["choice"] in ("cuda", "plugin") or row["name"] in ("paged decode", "rotary"):
            assert row["graph_ms"] is not None, f"{row['name']} could not be captured in a CUDA graph"
        if row["graph_ms"] is None:  # a torch path that cannot be captured: said so, not guessed
            assert row["host_overhead_ms"] is None
        else:
            assert row["graph_ms"] > 0
            assert row["host_overhead_ms"] == pytest.approx(row["eager_ms"] - row["graph_ms"])
        assert row["speedup"] == pytest.approx(row["torch_ms"] / row["eager_ms"])
        assert row["backend"].startswith("CUDA kernel from astrai-") or row["backend"] in fallbacks \
            or "emulated on sm_" in row["backend"] or row["backend"] == "flash-attn", row["backend"]
        if row["choice"] in ("cuda", "plugin"):
            assert row["backend"].startswith("CUDA kernel from astrai-"), row
