"""Where the FP8 training step's extra host time goes when autograd runs its backward on
the CUDA device thread, on the GPU machine (about 30 s of GPU time).

    python bench/profile/diag_fp8_step_threads.py [--m 1024 --n 8192 --k 8192] [--steps 20] [--rounds 5]
    python bench/profile/diag_fp8_step_threads.py --only baseline "bf16 F.linear"   # the table's rows alone

One nn.Linear step (``fp8_autocast`` forward, ``backward(gy)``) in variants that change one
thing each (pieces of the FP8 linear swapped out by monkeypatching, the floors a Python
autograd.Function pays), timed with autograd's multithreading on (the backward on the
device thread) and off (on the calling thread). Per variant, microseconds of wall time per
step, median of ``rounds`` rounds of ``steps`` back-to-back steps:

  ahead   the GPU kept ahead (a spin kernel in front): the host's own time per step
  idle    from an idle GPU, synchronized at the end of the round: what a user measures

each as ``thread`` (the backward on the device thread, autograd's default), ``1 thread``
(``torch.autograd.set_multithreading_enabled(False)``) and the ``extra`` between them.

Then the same baseline under interpreter and scheduler knobs (the GIL switch interval, the
garbage collector, every thread pinned to one core or to two), and last a torch.profiler
record (CPU events) of the baseline in both modes: per thread what it spends per step, how
long the handoffs between the calling thread and the device thread take, and the gaps where
neither runs an op.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from astrai.extension._fp8 import linear as linear_mod
from astrai.extension._fp8 import scaling as scaling_mod
from astrai.extension.fp8 import DelayedScaling, DynamicScaling, fp8_autocast, fp8_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graph_timing
from graph_timing import linear_shape_args, sleep_cycles_per_ms  # noqa: E402
from step_threads_profile import patched, profile_threads

DEV = "cuda"
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------- timing
class Timer:
    def __init__(self, steps: int, rounds: int, cycles_per_ms: float):
        self.steps, self.rounds, self.cycles_per_ms = steps, rounds, cycles_per_ms

    def run(self, step, ahead: bool) -> tuple[float, list[float]]:
        """(median us per step over the rounds, every step's own host us of the last round)."""
        for _ in range(3):
            step()
        per_round, each = [], []
        for _ in range(self.rounds):
            torch.cuda.synchronize()
            if ahead:  # long enough that the host never catches up within the round
                torch.cuda._sleep(int(self.cycles_per_ms * (3.0 * self.steps + 5)))
            each = []
            t0 = time.perf_counter()
            for _ in range(self.steps):
                t = time.perf_counter()
                step()
                each.append((time.perf_counter() - t) * 1e6)
            if not ahead:
                torch.cuda.synchronize()
            per_round.append((time.perf_counter() - t0) / self.steps * 1e6)
        torch.cuda.synchronize()
        return statistics.median(per_round), each


# ---------------------------------------------------------------------------- variants
class Bf16Linear(torch.autograd.Function):
    """The bf16 linear as a Python Function: the same three GEMMs and the bias sum."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


class Fp8GemmsOnly(torch.autograd.Function):
    """The step's three FP8 GEMMs alone, on operands quantized beforehand (no quantize,
    no scaling state): the floor of any FP8 linear written as a Python Function."""

    @staticmethod
    def forward(ctx, x, w, b, ops):
        ctx.ops = ops
        xq, wq = ops["xq"], ops["wq"]
        return torch._scaled_mm(xq, wq.t(), scale_a=ops["one"], scale_b=ops["one"], bias=b, out_dtype=BF16)

    @staticmethod
    def backward(ctx, g):
        ops = ctx.ops
        one = ops["one"]
        dx = torch._scaled_mm(ops["gq"], ops["wq_t"].t(), scale_a=one, scale_b=one, out_dtype=BF16)
        dw = torch._scaled_mm(ops["gq_t"], ops["xq_t"].t(), scale_a=one, scale_b=one, out_dtype=BF16)
        return dx, dw, g.sum(0), None


class Case:
    """Tensors of one variant: a fresh linear (a fresh FP8 state), x, dy."""

    def __init__(self, m: int, n: int, k: int, bias: bool = True, x_grad: bool = True, w_grad: bool = True):
        self.lin = torch.nn.Linear(k, n, bias=bias, device=DEV, dtype=BF16)
        self.lin.weight.requires_grad_(w_grad)
        self.x = torch.randn(m, k, device=DEV, dtype=BF16, requires_grad=x_grad)
        self.gy = torch.randn(m, n, device=DEV, dtype=BF16)
        self.recipe = DelayedScaling(amax_history_len=16)

    def fp8_step(self, after=None):
        def step():
            with fp8_autocast(recipe=self.recipe):
                y = self.lin(self.x)
            y.backward(self.gy)
            if after is not None:
                after()
        return step


def _end_now(state):  # the pass's step ends where the backward asks for it
    linear_mod._end_steps([(state.backward_roles, state.recipe)])


def _skip_update(group, recipe, runtime):  # forget the step's amaxes, no kernel, no bookkeeping
    for role in group.roles:
        role._recorded, role._ref, role._tokens = False, None, set()


def variants(m: int, n: int, k: int):
    """(label, builder) pairs; a builder enters its patches on ``stack`` and returns the step."""

    def baseline(stack):
        return Case(m, n, k).fp8_step()

    def no_bias(stack):
        return Case(m, n, k, bias=False).fp8_step()

    def x_no_grad(stack):
        return Case(m, n, k, x_grad=False).fp8_step()

    def w_no_grad(stack):
        return Case(m, n, k, w_grad=False).fp8_step()

    def forward_only(stack):
        case = Case(m, n, k)

        def step():
            with fp8_autocast(recipe=case.recipe):
                case.lin(case.x)
        return step

    def end_inside(stack):
        stack.enter_context(patched(linear_mod, "_end_with_backward", _end_now))
        return Case(m, n, k).fp8_step()

    def end_after(stack):
        case = Case(m, n, k)
        stack.enter_context(patched(linear_mod, "_end_with_backward", lambda state: None))
        return case.fp8_step(after=lambda: fp8_state(case.lin).end_backward_step())

    def no_updates(stack):
        stack.enter_context(patched(scaling_mod, "_update_group", _skip_update))
        return Case(m, n, k).fp8_step()

    def canned_backward(stack):
        case = Case(m, n, k)
        grads = (torch.randn_like(case.x), torch.randn_like(case.lin.weight), torch.randn_like(case.lin.bias), None)
        stack.enter_context(patched(linear_mod._Fp8Linear, "backward", staticmethod(lambda ctx, g: grads)))
        return case.fp8_step()

    def dynamic(stack):
        case = Case(m, n, k)
        case.recipe = DynamicScaling()
        return case.fp8_step()

    def bf16_linear(stack):
        case = Case(m, n, k)
        return lambda: F.linear(case.x, case.lin.weight, case.lin.bias).backward(case.gy)

    def bf16_function(stack):
        case = Case(m, n, k)
        return lambda: Bf16Linear.apply(case.x, case.lin.weight, case.lin.bias).backward(case.gy)

    def fp8_gemms_only(stack):
        case = Case(m, n, k)
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        xq = case.x.detach().to(e4)
        wq = case.lin.weight.detach().to(e4)
        gq = case.gy.to(e5)
        ops = {"xq": xq, "wq": wq, "wq_t": wq.t().contiguous(), "xq_t": xq.t().contiguous(), "gq": gq,
               "gq_t": gq.t().contiguous(), "one": torch.ones((), device=DEV)}
        return lambda: Fp8GemmsOnly.apply(case.x, case.lin.weight, case.lin.bias, ops).backward(case.gy)

    return [
        ("fp8 step (baseline)", baseline),
        ("fp8, no bias", no_bias),
        ("fp8, x without grad (no dgrad)", x_no_grad),
        ("fp8, weight without grad (no wgrad)", w_no_grad),
        ("fp8 forward only (grad recorded)", forward_only),
        ("fp8, step end inside backward (no callback)", end_inside),
        ("fp8, step end after backward(), caller", end_after),
        ("fp8, scale updates skipped", no_updates),
        ("fp8, backward returns canned grads", canned_backward),
        ("fp8, DynamicScaling", dynamic),
        ("floor: fp8 GEMMs only, Python Function", fp8_gemms_only),
        ("bf16 Python Function, 3 GEMMs + sum", bf16_function),
        ("bf16 F.linear", bf16_linear),
    ]


def measure(timer: Timer, build, modes=("ahead", "idle")) -> dict:
    """{(mode, threaded): us} for one variant, built once."""
    out = {}
    with contextlib.ExitStack() as stack:
        step = build(stack)
        for mode in modes:
            for threaded in (True, False):
                with torch.autograd.set_multithreading_enabled(threaded):
                    out[mode, threaded] = timer.run(step, mode == "ahead")[0]
    torch.cuda.synchronize()
    return out


def row(label: str, got: dict) -> str:
    cells = []
    for mode in ("ahead", "idle"):
        on, off = got[mode, True], got[mode, False]
        cells.append(f"{on:9.1f}{off:9.1f}{on - off:9.1f}")
    return f"{label:<52}" + "  ".join(cells)


HEADER = (f"{'us per step':<52}{'GPU ahead':>27}  {'GPU idle':>27}\n"
          f"{'':<52}" + f"{'thread':>9}{'1 thread':>9}{'extra':>9}  " * 2)


# ---------------------------------------------------------------------------- knobs
def l3_groups(cpus: list[int]) -> list[list[int]]:
    groups = {}
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/cache/index3/shared_cpu_list") as f:
                key = f.read().strip()
        except OSError:
            key = "?"
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


@contextlib.contextmanager
def pinned(cpus: set[int]):
    """Every thread of the process (the autograd device threads too) on ``cpus``."""
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    saved = {}
    for tid in tids:
        try:
            saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass
    try:
        yield
    finally:
        for tid, mask in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mask)


@contextlib.contextmanager
def switch_interval(seconds: float):
    saved = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


@contextlib.contextmanager
def gc_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def knobs() -> list[tuple[str, object]]:
    out = [(f"switch interval 1e-5 s (not {sys.getswitchinterval():g})", lambda: switch_interval(1e-5)),
           ("garbage collector off", gc_off)]
    if hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        groups = l3_groups(cpus)
        print(f"CPUs {len(cpus)}, L3 groups: " + "; ".join(f"{g[0]}..{g[-1]} ({len(g)})" for g in groups))
        out.append((f"threads on cpu {cpus[0]}", lambda: pinned({cpus[0]})))
        first = groups[0]
        if len(first) > 1:
            pair = {first[0], first[len(first) // 2]}  # apart in the group: not SMT siblings, usually
            out.append((f"threads on cpus {sorted(pair)} (one L3)", lambda: pinned(pair)))
        if len(groups) > 1:
            pair2 = {groups[0][0], groups[1][0]}
            out.append((f"threads on cpus {sorted(pair2)} (two L3s)", lambda: pinned(pair2)))
    return out


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    linear_shape_args(ap)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="+", metavar="TEXT",
                    help="the variants whose label holds one of these (e.g. baseline 'bf16 F.linear'), "
                         "without the knobs and the profiler: a few seconds, for A/B runs of two commits")
    args = ap.parse_args()
    m, n, k = args.m, args.n, args.k
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {torch.cuda.get_device_name()}, "
          f"M={m} N={n} K={k}, switch interval {sys.getswitchinterval():g} s, gc thresholds {gc.get_threshold()}")
    print("Python threads: " + ", ".join(f"{t.name} (daemon {t.daemon})" for t in threading.enumerate()))
    timer = Timer(args.steps, args.rounds, sleep_cycles_per_ms())
    print(HEADER)
    builders = dict(variants(m, n, k))
    chosen = {label: build for label, build in builders.items()
              if not args.only or any(text in label for text in args.only)}
    for label, build in chosen.items():
        try:
            print(row(label, measure(timer, build)), flush=True)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run here is reported
            print(f"{label:<52}not run: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    if args.only:
        return
    print("\nthe baseline and the bf16 Function under interpreter and scheduler knobs:")
    print(HEADER)
    for knob, enter in knobs():
        for short, label in (("fp8", "fp8 step (baseline)"), ("bf16 Fn", "bf16 Python Function, 3 GEMMs + sum")):
            try:
                with enter():
                    print(row(f"{short}, {knob}", measure(timer, builders[label])), flush=True)
            except Exception as exc:  # noqa: BLE001 - a knob this machine lacks is reported
                print(f"{short}, {knob}: not run: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    with contextlib.ExitStack() as stack:
        step = builders["fp8 step (baseline)"](stack)
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                _, each = timer.run(step, ahead=True)
            each.sort()
            print(f"baseline, {'device thread' if threaded else 'one thread'}, GPU ahead, single steps (us): "
                  f"min {each[0]:.1f}, median {statistics.median(each):.1f}, p90 {each[int(0.9 * len(each))]:.1f}, "
                  f"max {each[-1]:.1f}")
        for threaded in (True, False):
            profile_threads(step, args.steps, threaded)


if __name__ == "__main__":
    main()
