"""bench/profile/profile_prefill.py's arithmetic on the CPU: waves of a grid, and a profiler trace
summarised per call (the GPU run reads the driver's figures through the same code)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "profile" / "profile_prefill.py"


@pytest.fixture(scope="module")
def prof():
    spec = importlib.util.spec_from_file_location("profile_prefill", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("blocks, sms, per_sm, want_waves, want_idle", [
    (132, 132, 1, 1.0, 0.0), (133, 132, 1, 133 / 132, 131 / 132), (264, 132, 2, 1.0, 0.0),
    (277, 132, 1, 277 / 132, (3 * 132 - 277) / 132),
])
def test_waves_and_the_idle_share_of_the_last(prof, blocks, sms, per_sm, want_waves, want_idle):
    assert prof.waves(blocks, sms, per_sm) == pytest.approx((want_waves, want_idle))


H100 = {"threads": 2048, "registers": 65536, "shared_memory": 233472}


@pytest.mark.parametrize("threads, registers, smem, want", [
    (384, 168, 115824, 1),  # the Hopper prefill: 12 warps x 5376 registers fill the register file
    (384, 168, 0, 1),
    (256, 26, 0, 8),  # the page gather: the 2048-thread limit
    (128, 32, 0, 16),
    (32, 16, 0, 32),  # the block limit
    (128, 64, 110000, 2),  # shared memory: two 111 KB blocks of 228 KB
    (128, 255, 0, 2),  # 255 registers round to 8192 a warp: 4 warps x 8192 = 32768
])
def test_resident_blocks_per_sm(prof, threads, registers, smem, want):
    assert prof.resident_blocks(threads, registers, smem, H100) == want


def _kernel(name, ts, dur, grid=(10, 8, 1)):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"grid": list(grid), "block": [384, 1, 1], "registers per thread": 168,
                     "shared memory": 200000, "blocks per SM": 99.0}}  # the trace's: grid / SMs, unused


def test_a_trace_is_summarised_per_call(prof):
    # two calls: a copy and a prefill each, with gaps; one overlapping kernel; CPU events ignored
    events = [_kernel("gather", 0, 10, grid=(4, 1, 1)), _kernel("prefill", 15, 100),
              _kernel("gather", 200, 10, grid=(4, 1, 1)), _kernel("prefill", 212, 100),
              _kernel("prefill_tail", 300, 20, grid=(1, 1, 1)),
              {"cat": "cpu_op", "name": "aten::empty", "ts": 0, "dur": 5}]
    out = prof.kernel_summary({"traceEvents": events}, calls=2, sms=40, limits=H100)
    assert list(out["kernels"]) == ["prefill", "gather", "prefill_tail"]  # by GPU time
    prefill = out["kernels"]["prefill"]
    assert prefill["launches"] == 1 and prefill["us"] == 100 and prefill["grid"] == [10, 8, 1]
    assert prefill["resident_per_sm"] == 1  # 168 registers x 384 threads
    assert prefill["waves"] == pytest.approx(2.0) and prefill["last_wave_idle"] == 0.0
    assert out["gpu_us"] == pytest.approx((20 + 200 + 20) / 2)
    assert out["span_us"] == pytest.approx(320 / 2)
    covered = 10 + 100 + 10 + 100 + 8  # the tail overlaps the second prefill by 12 us
    assert out["gap_us"] == pytest.approx((320 - covered) / 2)


def test_an_empty_trace_and_bad_shapes(prof):
    assert prof.kernel_summary({"traceEvents": []}, calls=3, sms=132, limits=H100) == \
        {"kernels": {}, "gpu_us": 0.0, "span_us": 0.0, "gap_us": 0.0}
    assert prof.parse_shape("64x512") == [512] * 64
    for bad in ("64", "x512", "0x512", "ax2"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxLENGTH"):
            prof.parse_shape(bad)
