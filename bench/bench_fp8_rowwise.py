"""The W8A8 GEMM of a decode step (1-64 rows) on Llama-3-8B's decoder linears: the plugin's row-wise
kernel against the same kernel with K left whole, cuBLASLt, the weight-only kernel and bf16 cuBLAS.

    python bench/bench_fp8_rowwise.py [--json out.json] [--quick]

Per (rows, N, K), microseconds per call (CUDA graphs of 10 calls, every candidate replayed in turn
round after round: an interleaved A/B) of
  rowwise     gemm_rowwise (astrai-fp8): per-token e4m3 x per-channel e4m3 weights, the planner's
              tiles (swap-AB; K split over a cluster of 2-4 CTAs where N leaves SMs idle)
  whole_k     the same kernel with the swap-AB tile of the same width forced (K not split; a
              scalar scale through the kernel's C entry, csrc/gemm/sm90/capi.cu)
  scaled_mm   torch._scaled_mm with the same row-wise scales (cuBLASLt), the route's other GEMM
  weight      the weight-only kernel on bfloat16 activations (the route below W8A8_MIN_ROWS)
  bf16        F.linear over the bfloat16 weight (cuBLAS)
each against its bytes at 3.35 TB/s (FP8 weights, the activations and bf16 output), with the
planner's split; then what a user's eager call sees, per call with its host work: the W8A8 linear
on pre-quantized rows (``fp8_input_linear``, which runs gemm_rowwise here) and torch._scaled_mm.
Each call reads another copy of the weights, cycling through enough copies to overflow the L2 cache
twice over, as a decode step's layers do. A candidate that fails is shown failed.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from astrai import timing
from astrai.extension.backend import fp8_weights
from astrai.extension.ops import fp8_weights as ops_fp8_weights

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))
import sm90_capi  # noqa: E402
from graph_timing import checked, largest_error, print_rows, quick_json_args  # noqa: E402

SHAPES_NK = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [1, 8, 16, 32, 48, 64]
NAMES = ("rowwise", "whole_k", "scaled_mm", "weight", "bf16")


def whole_k_config(planner, m: int) -> int:
    """The promoted swap-AB config without split-K of the narrowest width covering m rows."""
    return min((c for c in planner.TILE_CONFIGS if c.swap and c.promote and not c.split and c.bn >= m),
               key=lambda c: c.bn).id


def candidates(lib, planner, m: int, n: int, k: int) -> tuple[dict, dict]:
    copies_n = max(2, -(-2 * torch.cuda.get_device_properties(0).L2_cache_size // (n * k)))
    copies = []
    for _ in range(copies_n):
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        copies.append((w16, *fp8_weights.quantize_weight(w16)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, x_scale = fp8_weights.quantize_per_token(x)
    one = torch.ones((), device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    forced = whole_k_config(planner, m)
    turn = itertools.count()

    def nxt():
        return copies[next(turn) % len(copies)]

    fns = {
        "rowwise": lambda: ops_fp8_weights.fp8_rowwise_gemm_unchecked(xq, x_scale, *nxt()[1:]),
        "whole_k": lambda: sm90_capi.gemm(lib, xq, nxt()[1], one, out=out, force_config=forced),
        "scaled_mm": lambda: (lambda c: torch._scaled_mm(xq, c[1].t(), scale_a=x_scale, scale_b=c[2].view(1, -1),
                                                         out_dtype=torch.bfloat16))(nxt()),
        "weight": lambda: fp8_weights._kernel(x, *nxt()[1:]),
        "bf16": lambda: F.linear(x, nxt()[0]),
        # eager only: the route as users run it
        "linear": lambda: fp8_weights.fp8_input_linear(xq, x_scale, *nxt()[1:], None, torch.bfloat16),
    }
    _, w, w_scale = copies[0]
    want = (xq.double() * x_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()

    def first_copy():  # the check runs on copy 0
        nonlocal turn
        turn = itertools.count()

    def error_of(name, got):  # the W8A8 GEMMs against the float64 product of the quantized operands
        if name not in ("rowwise", "whole_k", "scaled_mm", "linear"):
            return None
        got = got.double()
        if name == "whole_k":  # a scalar scale of 1: the row-wise scales applied here
            got = got * x_scale.double() * w_scale.double()[None, :]
        return float((got - want).norm() / want.norm())

    return checked(fns, error_of, first_copy)


def main() -> None:
    args = quick_json_args(__doc__, "bench_fp8_rowwise")
    if args is None:
        return
    from astrai_fp8._fp8_ops import sm90 as planner

    lib = sm90_capi.load()
    props = torch.cuda.get_device_properties(0)
    limits = planner.DeviceLimits(9, 0, props.multi_processor_count, 232448)
    rows, every = [], []
    for name, (n, k) in SHAPES_NK.items():
        for m in ([1, 16, 64] if args.quick else ROWS):
            fns, errors = candidates(lib, planner, m, n, k)
            linear = fns.pop("linear", None)
            measured = timing.graphs(fns, calls=10, rounds=15)
            eager = {c: timing.eager(fn, calls=10, rounds=7) for c, fn in (("linear", linear),
                                                                         ("scaled_mm", fns.get("scaled_mm")))
                     if fn is not None}
            every += [*measured.values(), *eager.values()]
            plan = planner.plan(planner.ProblemShape(m, n, k), limits, "promote")
            row = {"linear": name, "m": m, "n": n, "k": k, "split": plan.split, "grid": plan.grid,
                   "floor_us": (n * k + m * k + 2 * m * n) / 3.35e12 * 1e6,
                   **{f"{c}_us": measured[c].median_us if c in measured else float("nan") for c in NAMES},
                   **{f"{c}_eager_us": eager[c].median_us if c in eager else float("nan")
                      for c in ("linear", "scaled_mm")},
                   "iqr_us": {c: t.iqr_us for c, t in measured.items()}, "errors": errors}
            rows.append(row)

    def line(r: dict) -> str:
        cells = " ".join(f"{r[c + '_us']:9.1f}" for c in NAMES)
        cells += " " + " ".join(f"{r[c + '_eager_us']:12.1f}" for c in ("linear", "scaled_mm"))
        ratio = r["whole_k_us"] / r["rowwise_us"], r["scaled_mm_us"] / r["rowwise_us"]
        failed = [c for c, e in r["errors"].items() if isinstance(e, str)]
        return (f"{r['linear']:>8} {r['m']:4d} {r['split']:5d} {cells} {r['floor_us']:8.1f} "
                f"{r['rowwise_us'] / r['floor_us']:6.2f}x {ratio[0]:7.2f}x {ratio[1]:7.2f}x"
                f"{'  failed: ' + ','.join(failed) if failed else ''}")

    print_rows(f"{'linear':>8} {'rows':>4} {'split':>5} " + " ".join(f"{c:>9}" for c in NAMES)
               + f" {'W8A8 eager':>12} {'cuBLAS eager':>12} {'floor':>8} {'/floor':>7} {'whole_k/':>8} {'cublas/':>8}"
               "  (us per call: CUDA graphs, interleaved; then eager)", rows, line, args.json)
    print(timing.legend(every))
    print(f"largest relative error against the float64 product of the quantized operands: {largest_error(rows):.2e}")


if __name__ == "__main__":
    main()
