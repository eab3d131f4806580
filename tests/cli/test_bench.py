"""``astrai bench``: eager, graph and host overhead per op; on a CPU it says it times the
torch fallbacks and has no speed-up column; backends are named as doctor names them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, manifest

from astrai.cli import bench, doctor
from astrai.extension.registry import Registry

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU report (tests/gpu covers the GPU's)")


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "b.json"
    run = subprocess.run([sys.executable, "-m", "astrai.cli.main", "bench", "--quick", "--json", str(out)],
                         capture_output=True, text=True, check=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    return run.stdout, json.loads(out.read_text())


def test_cpu_table_says_it_times_the_fallbacks_and_compares_nothing(cpu_report):
    table, _ = cpu_report
    assert "the torch fallbacks" in table and "no speed-up" in table
    header = next(line for line in table.splitlines() if "backend" in line)
    assert "eager us/call" in header
    for dropped in ("speed-up", "graph", "torch eager", "overhead"):
        assert dropped not in header


def test_cpu_json_keeps_every_figure_and_names_backends_as_doctor(cpu_report):
    _, report = cpu_report
    assert report["kernels"] is False
    fallbacks = set(doctor.FALLBACKS.values())
    for row in report["results"]:
        assert row["eager_ms"] > 0
        assert row["graph_ms"] is None and row["host_overhead_ms"] is None
        assert row["torch_ms"] is None and row["speedup"] is None
        assert row["backend"] in fallbacks, row["backend"]  # doctor's words, one per op
    names = {row["name"]: row["backend"] for row in report["results"]}
    assert names["paged decode"] == names["prefill causal"] == doctor.FALLBACKS["attn_paged_decode"]


def test_host_overhead_and_speedup_come_from_the_three_times():
    g = torch.Generator().manual_seed(0)
    eager, graph, torch_ms = (0.05 + torch.rand(3, generator=g, dtype=torch.float64)).tolist()
    result = bench.Result("rotary", "s", "b", "cuda", eager, graph, torch_ms, "r")
    assert result.host_overhead_ms == pytest.approx(eager - graph)
    assert result.speedup == pytest.approx(torch_ms / eager)
    row = result.to_json()
    assert (row["eager_ms"], row["graph_ms"], row["torch_ms"]) == (eager, graph, torch_ms)
    assert row["host_overhead_ms"] == pytest.approx(eager - graph)


def test_kernel_and_torch_paths_are_named_as_doctor_names_them():
    registry = Registry(entry_points(FakeEntryPoint("elementwise", manifest())))
    status = registry.op_status("rotary_emb", H200)
    assert doctor.backend_name("rotary_emb", status, H200, kernel=True) == "CUDA kernel from astrai-elementwise 0.1.0+cu130"
    assert doctor.backend_name("rotary_emb", status, H200, kernel=False) == doctor.FALLBACKS["rotary_emb"]
    assert doctor.backend_name("rotary_emb", status, H200) == "CUDA kernel from astrai-elementwise 0.1.0+cu130"
