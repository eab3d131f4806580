"""Which route a linear over FP8 weights should take at each row count: the measurements that
decide the route table (Llama-3-8B's decoder linears, CUDA graphs, candidates interleaved).

    python bench/bench_fp8_weight_routes.py [--json out.json] [--quick]

Per (rows, N, K), microseconds per call of
  bf16       F.linear over the bf16 weight (cuBLAS): the speed FP8 must beat
  weight     the astrai-fp8 weight-only kernel (fp8_weight_linear; 16-bit activations, FP8 weights)
  w8a8       per-token e4m3 activations (amax / 448 per row, quantized in torch) and
             torch._scaled_mm with row-wise scales over the same FP8 weights (cuBLASLt, FP8 tensor cores)
  w8a8_gemm  the _scaled_mm alone on activations quantized beforehand (what a quantize fused
             into the norm before the GEMM would leave)
and each against its weights' bytes at 3.35 TB/s. A candidate that fails is shown failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from astrai import timing
from astrai.extension.backend.fp8_weights import fp8_weight_linear, quantize_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import print_rows, quick_json_args  # noqa: E402

SHAPES_NK = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [1, 8, 16, 32, 64, 96, 128, 192, 256]
E4M3_MAX = 448.0


def per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, scale [M, 1])``: each row of ``x`` in e4m3 with its own float32 scale."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def candidates(m: int, n: int, k: int) -> dict:
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    w, w_scale = quantize_weight(w16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, x_scale = per_token(x)
    w_t, w_scale_row = w.t(), w_scale[None, :]  # column-major B, scales [1, N]

    def w8a8():
        q, s = per_token(x)
        return torch._scaled_mm(q, w_t, scale_a=s, scale_b=w_scale_row, out_dtype=torch.bfloat16)

    ref = F.linear(x.float(), w.float() * w_scale[:, None])
    fns = {"bf16": lambda: F.linear(x, w16), "weight": lambda: fp8_weight_linear(x, w, w_scale), "w8a8": w8a8,
           "w8a8_gemm": lambda: torch._scaled_mm(xq, w_t, scale_a=x_scale, scale_b=w_scale_row,
                                                 out_dtype=torch.bfloat16)}
    usable, errors = {}, {}
    for name, fn in fns.items():
        try:
            got = fn().float()
            if name != "bf16":  # the FP8 routes against the dequantized weights' float32 product
                errors[name] = float((got - ref).norm() / ref.norm())
            usable[name] = fn
        except Exception as exc:  # shown failed, never dropped
            errors[name] = f"failed: {type(exc).__name__}: {exc}"[:160]
    return usable, errors


def main() -> None:
    args = quick_json_args(__doc__, "bench_fp8_weight_routes")
    if args is None:
        return
    rows_list = [1, 16, 64, 128, 256] if args.quick else ROWS
    rows, every = [], []
    for name, (n, k) in SHAPES_NK.items():
        for m in rows_list:
            fns, errors = candidates(m, n, k)
            measured = timing.graphs(fns, calls=10, rounds=15)
            every += measured.values()
            times = {c: t.median_us for c, t in measured.items()}
            floor_us = (n * k + 2 * m * k + 2 * m * n) / 3.35e12 * 1e6  # FP8 weights, bf16 x and y
            row = {"linear": name, "m": m, "n": n, "k": k, "floor_us": floor_us,
                   **{f"{c}_us": times.get(c, float("nan")) for c in ("bf16", "weight", "w8a8", "w8a8_gemm")},
                   "iqr_us": {c: t.iqr_us for c, t in measured.items()},
                   "errors": errors}
            fastest = min((c for c in ("weight", "w8a8") if c in times), key=lambda c: times[c], default=None)
            row["fastest_fp8"] = fastest
            rows.append(row)

    def line(r: dict) -> str:
        cells = " ".join(f"{r[c + '_us']:9.1f}" for c in ("bf16", "weight", "w8a8", "w8a8_gemm"))
        failed = [c for c, e in r["errors"].items() if isinstance(e, str)]
        return (f"{r['linear']:>8} {r['m']:5d} {cells} {r['floor_us']:8.1f}  {r['fastest_fp8'] or '-':>6}"
                f"{'  failed: ' + ','.join(failed) if failed else ''}")

    print_rows(f"{'linear':>8} {'rows':>5} {'bf16':>9} {'weight':>9} {'w8a8':>9} {'w8a8_gemm':>9} {'floor':>8}  "
               "fastest FP8 (us per call, CUDA graphs, interleaved)", rows, line, args.json)
    print(timing.legend(every))
    worst = max((e for r in rows for e in r["errors"].values() if isinstance(e, float)), default=float("nan"))
    print(f"largest relative error of an FP8 route against the dequantized weights' float32 product: {worst:.2e}")


if __name__ == "__main__":
    main()
