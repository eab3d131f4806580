"""Which route a linear over FP8 weights should take at each row count: the measurements that
decide the route table (Llama-3-8B's decoder linears, CUDA graphs, candidates interleaved).

    python bench/bench_fp8_weight_routes.py [--json out.json] [--quick]

Per (rows, N, K), microseconds per call of
  bf16       F.linear over the bf16 weight (cuBLAS): the speed FP8 must beat
  weight     the astrai-fp8 weight-only kernel (16-bit activations, FP8 weights), at every row count
  w8a8       the W8A8 route as fp8_weight_linear runs it: per-token e4m3 activations (amax / 448
             per row; the plugin's one-launch quantize where it has it) and torch._scaled_mm with
             row-wise scales over the same FP8 weights (cuBLASLt, FP8 tensor cores)
  w8a8_gemm  the _scaled_mm alone on activations quantized beforehand (what a quantize fused
             into the norm before the GEMM would leave)
and each against its weights' bytes at 3.35 TB/s; beside them, what a user's eager call sees: bf16's
F.linear and fp8_weight_linear (the route the table picks), per call with its host work. A
candidate that fails is shown failed.
Each call reads another copy of the weights, cycling through enough copies to overflow the
L2 cache twice over, as a decode step's layers do (one weight read back to back would stay in
L2 when it fits: a 4096 x 4096 bf16 weight measured faster than HBM allows).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from astrai import timing
from astrai.extension.backend import fp8_weights
from astrai.extension.backend.fp8_weights import fp8_weight_linear, quantize_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import checked, largest_error, print_rows, quick_json_args  # noqa: E402

SHAPES_NK = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [1, 8, 16, 32, 64, 96, 128, 192, 256]


def cold_copies(n: int, k: int) -> int:
    """Weight copies a call cycles through: FP8 ones that fill the L2 cache twice over."""
    return max(2, -(-2 * torch.cuda.get_device_properties(0).L2_cache_size // (n * k)))


def candidates(m: int, n: int, k: int) -> dict:
    copies = []
    for _ in range(cold_copies(n, k)):
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        w, w_scale = quantize_weight(w16)
        copies.append((w16, w, w_scale))
    w16, w, w_scale = copies[0]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, x_scale = fp8_weights.quantize_per_token(x)
    turn = itertools.count()

    def next_copy():  # each captured call takes the next copy: the graph replays them in turn
        return copies[next(turn) % len(copies)]

    def bf16():
        return F.linear(x, next_copy()[0])

    def weight():
        _, w, w_scale = next_copy()
        return fp8_weights._kernel(x, w, w_scale)  # at any row count, whatever the route table says

    def w8a8():
        _, w, w_scale = next_copy()
        return fp8_weights._w8a8(x, w, w_scale)

    def route():  # as users call it
        _, w, w_scale = next_copy()
        return fp8_weight_linear(x, w, w_scale)

    def w8a8_gemm():
        _, w, w_scale = next_copy()
        return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=torch.bfloat16)

    ref = F.linear(x.float(), w.float() * w_scale[:, None])
    fns = {"bf16": bf16, "weight": weight, "w8a8": w8a8, "w8a8_gemm": w8a8_gemm, "route": route}

    def first_copy():  # the check runs on copy 0, the reference's
        nonlocal turn
        turn = itertools.count()

    def error_of(name, got):  # the FP8 routes against the dequantized weights' float32 product
        return None if name == "bf16" else float((got.float() - ref).norm() / ref.norm())

    return checked(fns, error_of, first_copy)


def main() -> None:
    args = quick_json_args(__doc__, "bench_fp8_weight_routes")
    if args is None:
        return
    rows_list = [1, 16, 64, 128, 256] if args.quick else ROWS
    rows, every = [], []
    for name, (n, k) in SHAPES_NK.items():
        for m in rows_list:
            fns, errors = candidates(m, n, k)
            route = fns.pop("route", None)
            measured = timing.graphs(fns, calls=10, rounds=15)
            eager = {c: timing.eager(fn, calls=10, rounds=7) for c, fn in (("bf16", fns.get("bf16")), ("route", route))
                     if fn is not None}
            every += [*measured.values(), *eager.values()]
            times = {c: t.median_us for c, t in measured.items()}
            floor_us = (n * k + 2 * m * k + 2 * m * n) / 3.35e12 * 1e6  # FP8 weights, bf16 x and y
            row = {"linear": name, "m": m, "n": n, "k": k, "floor_us": floor_us,
                   **{f"{c}_us": times.get(c, float("nan")) for c in ("bf16", "weight", "w8a8", "w8a8_gemm")},
                   **{f"{c}_eager_us": eager[c].median_us if c in eager else float("nan") for c in ("bf16", "route")},
                   "iqr_us": {c: t.iqr_us for c, t in measured.items()},
                   "errors": errors}
            fastest = min((c for c in ("weight", "w8a8") if c in times), key=lambda c: times[c], default=None)
            row["fastest_fp8"] = fastest
            rows.append(row)

    def line(r: dict) -> str:
        cells = " ".join(f"{r[c + '_us']:9.1f}" for c in ("bf16", "weight", "w8a8", "w8a8_gemm"))
        cells += " " + " ".join(f"{r[c + '_eager_us']:11.1f}" for c in ("bf16", "route"))
        failed = [c for c, e in r["errors"].items() if isinstance(e, str)]
        return (f"{r['linear']:>8} {r['m']:5d} {cells} {r['floor_us']:8.1f}  {r['fastest_fp8'] or '-':>6}"
                f"{'  failed: ' + ','.join(failed) if failed else ''}")

    print_rows(f"{'linear':>8} {'rows':>5} {'bf16':>9} {'weight':>9} {'w8a8':>9} {'w8a8_gemm':>9} {'bf16 eager':>11} "
               f"{'FP8 eager':>11} {'floor':>8}  fastest FP8 (us per call: CUDA graphs, interleaved; then eager)",
               rows, line, args.json)
    print(timing.legend(every))
    print(f"largest relative error of an FP8 route against the dequantized weights' float32 product: {largest_error(rows):.2e}")


if __name__ == "__main__":
    main()
