"""Where the host time of one fp8_autocast linear goes, on the GPU machine.

    python bench/profile/profile_fp8_linear.py [--m 1024 --n 8192 --k 8192] [--calls 200]

First the host cost of each piece of the forward, issued back to back with the GPU kept
busy (microseconds of thread CPU per call, median ±IQR of 5 rounds, ``astrai.timing.host``);
then cProfile of ``calls`` forward
calls (no_grad, DelayedScaling, the weight cache on) and of ``calls // 4`` training steps,
sorted by own time; last the same forward captured in a CUDA graph (the GPU work alone,
no host cost).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graph_timing
import torch.nn.functional as F
from astrai import timing
from astrai.extension.backend import fp8 as backend
from astrai.extension.fp8 import DelayedScaling, fp8_autocast
from astrai.extension.ops import fp8 as fp8_ops
from diag_fp8_step_threads import Bf16Linear
from graph_timing import linear_shape_args


def host_us(fn, calls: int = 100) -> timing.Timing:
    """CPU time per call over 5 rounds of ``calls`` back-to-back calls, each round started
    behind a long GPU job so no call waits for the GPU."""
    busy = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def keep_gpu_busy():
        torch.cuda.synchronize()
        for _ in range(4):
            busy @ busy  # keeps the GPU ahead of the host

    return timing.host(fn, calls, rounds=5, warmup=3, setup=keep_gpu_busy)


def host_parts(m: int, n: int, k: int) -> None:
    """The host cost of each piece of one fp8_autocast forward, and of its peers."""
    dev = "cuda"
    lin = torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    a8 = x.to(torch.float8_e4m3fn)
    w8 = lin.weight.detach().to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    pair = torch.ones(2, device=dev).unbind(0)  # the second is not 16-byte aligned
    bias = lin.bias.detach()
    recipe = DelayedScaling(amax_history_len=16)
    small = torch.ones((), device=dev)
    parts = {
        "0-d tensor add (one tiny kernel)": lambda: small + 1,
        "torch.empty [m, n] bf16": lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16),
        "bf16 F.linear (the peer)": lambda: F.linear(x, lin.weight, lin.bias),
        "torch._scaled_mm": lambda: torch._scaled_mm(a8, w8.t(), one, one, bias=bias, out_dtype=torch.bfloat16),
        "torch._scaled_mm, scale_b 4 bytes past 16": lambda: torch._scaled_mm(
            a8, w8.t(), one, pair[1], bias=bias, out_dtype=torch.bfloat16),
        "backend.gemm (policy + _scaled_mm)": lambda: backend.gemm(a8, w8.t(), one, bias),
        "backend.gemm backend='plugin'": lambda: backend.gemm(a8, w8.t(), one, bias, backend="plugin"),
        "ops fp8_quantize (plugin)": lambda: fp8_ops.fp8_quantize(x, one, "e4m3", 0),
        "backend.quantize (policy + plugin)": lambda: backend.quantize(x, one, "e4m3", 0),
    }

    def region_only():
        with torch.no_grad(), fp8_autocast(recipe=recipe):
            pass

    def fwd():
        with torch.no_grad(), fp8_autocast(recipe=recipe):
            lin(x)

    xg = x.clone().requires_grad_()
    gy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    lin_train = torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16)  # no cached FP8 weight

    def bf16_step():
        F.linear(xg, lin_train.weight, lin_train.bias).backward(gy)

    def fp8_step():
        with fp8_autocast(recipe=recipe):
            y = lin_train(xg)
        y.backward(gy)

    parts["fp8_autocast enter + exit, no linear"] = region_only
    parts["fp8_autocast forward (whole)"] = fwd
    print(f"\n== host microseconds per call, M={m} N={n} K={k} (GPU kept busy; median ±IQR)")
    timed = []
    for label, fn in parts.items():
        try:
            with torch.no_grad():
                timed.append(host_us(fn))
            print(f"{label:<42} {timed[-1]:>14}")
        except Exception as exc:  # noqa: BLE001 - a piece that cannot run here is reported
            print(f"{label:<42} not run: {type(exc).__name__}: {str(exc)[:120]}")
    for label, fn in (("bf16 training step", bf16_step), ("fp8_autocast training step", fp8_step)):
        try:
            timed.append(host_us(fn, calls=30))
            print(f"{label:<42} {timed[-1]:>14}")
        except Exception as exc:  # noqa: BLE001 - a piece that cannot run here is reported
            print(f"{label:<42} not run: {type(exc).__name__}: {str(exc)[:120]}")
    print(timing.legend(timed))


def step_pieces(m: int, n: int, k: int, steps: int = 40) -> None:
    """Inclusive host microseconds per training step spent in each piece of the FP8 linear
    (wall time inside the function, nested pieces counted in their callers too), beside the
    floor any Python autograd.Function pays: the same bf16 linear written as one."""
    from astrai.extension._fp8 import linear as fp8_mod  # the FP8 linear's Function

    dev = "cuda"
    lin = torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    xg = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    recipe = DelayedScaling(amax_history_len=16)
    spent: dict[str, float] = {}

    def timed(label, fn):
        def inner(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        return inner

    def fp8_step():
        with fp8_autocast(recipe=recipe):
            y = lin(xg)
        y.backward(gy)

    steps_of = {
        "bf16 step": lambda: F.linear(xg, lin.weight, lin.bias).backward(gy),
        "bf16 step, Python Function": lambda: Bf16Linear.apply(xg, lin.weight, lin.bias).backward(gy),
        "fp8 step": fp8_step,
    }
    print(f"\n== host microseconds per training step, M={m} N={n} K={k} (GPU kept busy; median ±IQR)")
    timed = []
    for threaded in (True, False):
        with torch.autograd.set_multithreading_enabled(threaded):
            for label, fn in steps_of.items():
                timed.append(host_us(fn, calls=30))
                print(f"{label + (', backward on its own thread' if threaded else ', one thread'):<58} "
                      f"{timed[-1]:>14}")
    print(timing.legend(timed))
    from astrai.extension._fp8 import scaling as scaling_mod
    from astrai.extension._fp8 import weights as weights_mod

    names = ["_fp8_linear", "_plan_for", "_forward", "_quantize", "_quantize_weight", "_end_steps",
             "_end_with_backward", "_update_group", "_fold_refs"]
    # each function in every module that calls it by name, one timer per function
    saved = [(mod, name, getattr(mod, name)) for mod in (fp8_mod, weights_mod, scaling_mod)
             for name in names if hasattr(mod, name)]
    fwd, bwd = fp8_mod._Fp8Linear.forward, fp8_mod._Fp8Linear.backward
    try:
        timers: dict = {}
        for mod, name, fn in saved:
            setattr(mod, name, timers.setdefault(name, timed(name, fn)))
        fp8_mod._Fp8Linear.forward = staticmethod(timed("_Fp8Linear.forward", fwd))
        fp8_mod._Fp8Linear.backward = staticmethod(timed("_Fp8Linear.backward", bwd))
        fp8_mod.fp8_runners.scale_update = timed("backend.scale_update", saved_update := fp8_mod.fp8_runners.scale_update)
        parts = {"region enter": 0.0, "F.linear in region": 0.0, "region exit": 0.0, "backward()": 0.0}
        for _ in range(5):
            fp8_step()
        torch.cuda.synchronize()
        spent.clear()
        busy = torch.empty(8192, 8192, device=dev, dtype=torch.bfloat16)
        for _ in range(steps):
            torch.cuda.synchronize()
            busy @ busy
            t0 = time.perf_counter()
            region = fp8_autocast(recipe=recipe)
            region.__enter__()
            t1 = time.perf_counter()
            y = lin(xg)
            t2 = time.perf_counter()
            region.__exit__(None, None, None)
            t3 = time.perf_counter()
            y.backward(gy)
            t4 = time.perf_counter()
            for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[key] += dt
        torch.cuda.synchronize()
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        fp8_mod._Fp8Linear.forward, fp8_mod._Fp8Linear.backward = staticmethod(fwd), staticmethod(bwd)
        fp8_mod.fp8_runners.scale_update = saved_update
    for label, total in list(parts.items()) + sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<40} {total / steps * 1e6:8.1f}")


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
          f"(under cProfile), top {top} by own time, then by cumulative time")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    print("\n".join(line[:150] for line in out.getvalue().splitlines() if line.strip()))


def main() -> None:
    ap = argparse.ArgumentParser()
    linear_shape_args(ap)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    lin = torch.nn.Linear(args.k, args.n, device="cuda", dtype=torch.bfloat16)
    lin_train = torch.nn.Linear(args.k, args.n, device="cuda", dtype=torch.bfloat16)  # no cached FP8 weight
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(amax_history_len=16)

    def fwd():
        with torch.no_grad(), fp8_autocast(recipe=recipe):
            lin(x)

    def step():
        with fp8_autocast(recipe=recipe):
            y = lin_train(x)
        y.backward(gy)

    host_parts(args.m, args.n, args.k)
    step_pieces(args.m, args.n, args.k)
    profile(fwd, args.calls, "fp8 forward (no_grad)")
    # the backward on this thread, so cProfile sees it (by default it runs on the
    # autograd engine's device thread)
    with torch.autograd.set_multithreading_enabled(False):
        profile(step, max(args.calls // 4, 10), "fp8 training step")
    graphed = timing.graph(fwd, eager_fallback=True)
    print(f"\nfp8 forward in a CUDA graph: {graphed} per call (GPU work; the weight is "
          "quantized inside the graph, the cache being off under capture)")


if __name__ == "__main__":
    main()
