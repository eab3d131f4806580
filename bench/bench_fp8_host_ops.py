"""Host cost of the single calls an FP8 training step makes, on the calling thread and on
autograd's CUDA device thread (where the backward runs), on the GPU machine (~10 s of GPU time).

    python bench/bench_fp8_host_ops.py [--m 1024 --n 8192 --k 8192] [--calls 200]

Microseconds of wall time per call, median of 5 rounds of ``calls`` back-to-back calls
with the GPU kept ahead (a spin kernel in front, so no call waits for the GPU). ``device
thread`` runs the same rounds inside the backward of a Python autograd.Function, which
autograd runs on its device thread; ``ratio`` is device thread over calling thread. The
alternatives side by side: a copy of the scale row by ``clone`` (cudaMemcpyAsync) or by a
kernel (``mul(1.0)``, the same bits for finite scales); the bias gradient as a float32
sum and a cast, as a sum straight into bf16, or as a product with a ones row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import linear_shape_args, sleep_cycles_per_ms  # noqa: E402

BF16 = torch.bfloat16
DEV = "cuda"


def rounds_us(fn, calls: int, spin: int) -> float:
    """Median us per call over 5 rounds, each behind a spin kernel that outlasts it."""
    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


class OnDeviceThread(torch.autograd.Function):
    """Runs ``fn`` in rounds inside its backward: on autograd's device thread for a CUDA
    input (multithreading on, autograd's default)."""

    @staticmethod
    def forward(ctx, x, job):
        ctx.job = job
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        fn, calls, spin, out = ctx.job
        out.append(rounds_us(fn, calls, spin))
        return g, None


def on_device_thread(fn, calls: int, spin: int) -> float:
    seed = torch.zeros(1, device=DEV, requires_grad=True)
    out: list[float] = []
    OnDeviceThread.apply(seed, (fn, calls, spin, out)).sum().backward()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    linear_shape_args(ap)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    m, n, k, calls = args.m, args.n, args.k, args.calls
    dev = DEV
    scale_row = torch.ones(8, device=dev)
    dy = torch.randn(m, n, device=dev, dtype=BF16)
    ones_row = torch.ones(1, m, device=dev, dtype=BF16)
    x = torch.randn(m, k, device=dev, dtype=BF16)
    w = torch.randn(n, k, device=dev, dtype=BF16)
    a8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    small = torch.ones((), device=dev)
    table = {i: i for i in range(64)}

    def python_only():  # interpreter work alone: no torch, no CUDA
        total = 0
        for i in range(50):
            total += table.get(i, 0)
        return total

    ops = {
        "pure Python (50 dict gets)": python_only,
        "0-d add (one tiny kernel)": lambda: small + 1,
        "torch.empty(8) float32": lambda: torch.empty(8, device=dev),
        "scale row clone() (cudaMemcpyAsync)": lambda: scale_row.clone(),
        "scale row mul(1.0) (a kernel)": lambda: scale_row.mul(1.0),
        "scale row clone, then [0] and [4]": lambda: (lambda c: (c[0], c[4]))(scale_row.clone()),
        "w.t() (a view)": lambda: w.t(),
        "is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "db: dy.sum(0, float32).to(bf16)": lambda: dy.sum(0, dtype=torch.float32).to(BF16),
        "db: dy.sum(0, dtype=bf16)": lambda: dy.sum(0, dtype=BF16),
        "db: ones[1, M] @ dy": lambda: torch.mm(ones_row, dy),
        "torch._scaled_mm M x N x K": lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=BF16),
        "bf16 F.linear M x N x K": lambda: F.linear(x, w),
    }
    try:
        from astrai.extension.ops import _plugin
        from astrai.extension.ops import fp8 as fp8_ops

        launch = fp8_ops.quantize_launcher(_plugin.require("fp8_quantize", x.device), "e4m3")
        amax = torch.zeros((), device=dev)
        ops["plugin quantize launch (memset + kernel)"] = lambda: launch(x, one, 0, amax)
        ops["plugin quantize launch, both layouts"] = lambda: launch(x, one, 2, amax)
    except Exception as exc:  # noqa: BLE001 - without the plugin its rows are left out
        print(f"plugin quantize not measured: {type(exc).__name__}: {exc}")
    spin = int(sleep_cycles_per_ms() * 40)  # outlasts a round of the slowest call
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, M={m} N={n} K={k}, {calls} calls a round")
    print(f"{'us per call (GPU kept ahead)':<44}{'calling':>9}{'device':>9}{'ratio':>7}")
    for label, fn in ops.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        here = rounds_us(fn, calls, spin)
        torch.cuda.synchronize()
        there = on_device_thread(fn, calls, spin)
        torch.cuda.synchronize()
        print(f"{label:<44}{here:9.2f}{there:9.2f}{there / here:7.2f}", flush=True)


if __name__ == "__main__":
    main()
