"""Where the host time of one fp8_autocast linear goes, on the GPU machine.

    python tests/gpu/profile_fp8_linear.py [--m 1024 --n 8192 --k 8192] [--calls 200]

cProfile of ``calls`` forward calls (no_grad, DelayedScaling, the weight cache on) and of
``calls // 4`` training steps, sorted by own time; then the same forward captured in a
CUDA graph (the GPU work alone, no host cost) next to its eager time per call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import graph_time_ms  # noqa: E402

from astrai.extension.fp8 import DelayedScaling, fp8_autocast  # noqa: E402


def profile(fn, calls: int, label: str, top: int = 28) -> None:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    print(f"\n== {label}: {stats.total_tt / calls * 1e3:.3f} ms of host time per call "
          f"(under cProfile), top {top} by own time")
    stats.sort_stats("tottime").print_stats(top)
    print("\n".join(line[:150] for line in out.getvalue().splitlines() if line.strip()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    lin = torch.nn.Linear(args.k, args.n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(amax_history_len=16)

    def fwd():
        with torch.no_grad(), fp8_autocast(recipe=recipe):
            lin(x)

    def step():
        with fp8_autocast(recipe=recipe):
            y = lin(x)
        y.backward(gy)

    profile(fwd, args.calls, "fp8 forward (no_grad)")
    profile(step, max(args.calls // 4, 10), "fp8 training step")
    graphed = graph_time_ms(fwd, eager_fallback=True)
    print(f"\nfp8 forward in a CUDA graph: {graphed:.3f} ms per call (GPU work; the weight is "
          "quantized inside the graph, the cache being off under capture)")


if __name__ == "__main__":
    main()
