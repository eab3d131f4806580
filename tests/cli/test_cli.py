"""`astrai doctor` end to end, and its report over fake plugins."""

import json
import subprocess
import sys

from fakes import FakeEntryPoint, entry_points, manifest

from astrai.cli import doctor
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime


def test_doctor_runs_as_console_script():
    out = subprocess.run([sys.executable, "-m", "astrai.cli.main", "doctor"], capture_output=True, text=True, check=True)
    assert "astrai 0.1.0" in out.stdout
    assert "what each op runs here" in out.stdout
    assert "rotary_emb" in out.stdout


def test_doctor_json_is_complete():
    out = subprocess.run([sys.executable, "-m", "astrai.cli.main", "doctor", "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert {"astrai", "torch", "torch_cuda", "driver_cuda", "device", "plugins", "ops", "install"} <= set(report)
    assert {row["op"] for row in report["ops"]} >= {"attn_paged_decode", "rotary_emb", "fp8_gemm"}
    assert "pip" in report["install"]


def test_doctor_lists_rejected_plugins_with_reasons():
    eps = entry_points(FakeEntryPoint("elementwise", manifest),
                       FakeEntryPoint("fp8", manifest(name="astrai-fp8", api_version=9)),
                       FakeEntryPoint("attention", ImportError("libcudart.so.12: cannot open")))
    report = doctor.collect(Runtime(Registry(eps)))
    rows = {row["name"]: row for row in report["plugins"]}
    assert rows["astrai-elementwise"]["version"] == "0.1.0+cu130"
    assert rows["astrai-elementwise"]["sass_archs"][-1] == "sm_120"
    if report["device"] == "no CUDA device":
        assert not rows["astrai-elementwise"]["usable"]
        assert "no CUDA device" in rows["astrai-elementwise"]["reason"]
        rotary = next(r for r in report["ops"] if r["op"] == "rotary_emb")
        assert rotary["backend"] == "torch complex multiply"
    assert "plugin API version 9" in rows["astrai-fp8"]["reason"]
    assert "libcudart.so.12: cannot open" in rows["astrai-attention"]["reason"]


def test_bench_runs_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "astrai.cli.main", "bench", "--quick",
                          "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")],
                         capture_output=True, text=True, check=True)
    assert "astrai bench on" in out.stdout
    results = json.loads((tmp_path / "b.json").read_text())["results"]
    assert {r["name"] for r in results} >= {"paged decode", "prefill causal", "rotary"}
    assert all(r["eager_ms"] > 0 for r in results)
    assert (tmp_path / "b.png").stat().st_size > 1000
