"""Norm benchmark, side by side in one run: the astrai-elementwise kernels against the torch ops
the decode step ran before them (bf16, Llama-3-8B: hidden 4096, intermediate 14336).

- residual add + RMSNorm: ``fused_add_rms_norm`` (one launch) against ``residual + x`` and
  transformers' RMSNorm (cast, square, mean, add, rsqrt, multiply, cast, multiply);
- RMSNorm alone: ``rms_norm`` against the same torch ops;
- SiLU-and-mul: ``silu_and_mul`` of the gate/up projection's output against
  ``F.silu(gate) * up``;
- one decoder layer's element-wise work: two fused norms and one SiLU-and-mul against the
  torch sequence of both residual adds, both norms and the activation.

At the decode step's row counts (1, 16, 64 tokens) and at prefill's (4096). Times are
medians of CUDA-graph replays, the candidates of a case replayed in turn
(``astrai.timing.graphs``), so the launch gaps of the torch sequence are measured as
the step's graph pays them. GB/s counts the bytes each call must move (reads and writes of
the activations and the weight).

    python bench/bench_norm.py [--json out.json] [--quick]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import quick_json_args  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension.backend.norm_torch import rms_norm_torch, silu_and_mul_torch  # noqa: E402
from astrai.extension.ops import norm as ops_norm  # noqa: E402

BF16 = torch.bfloat16
HIDDEN, INTER, EPS = 4096, 14336, 1e-5
BAR_DECODE_SPEEDUP = 3.0  # the layer's element-wise work at 1-64 tokens: fused vs the torch sequence


def cases(rows: int):
    """name -> (bytes moved, {candidate: fn}) for `rows` tokens."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=g).to(BF16)
    residual = torch.randn(rows, HIDDEN, device="cuda", generator=g).to(BF16)
    w = torch.randn(HIDDEN, device="cuda", generator=g).to(BF16)
    gate_up = torch.randn(rows, 2 * INTER, device="cuda", generator=g).to(BF16)
    act, el = rows * HIDDEN * 2, 2
    fx, fr = x.clone(), residual.clone()  # the fused op writes in place: its own buffers

    def torch_add_norm():
        s = residual + x
        return rms_norm_torch(s, w, EPS), s

    def torch_layer():
        s = residual + x
        h = rms_norm_torch(s, w, EPS)
        s = s + x
        h = rms_norm_torch(s, w, EPS)
        return silu_and_mul_torch(gate_up), h

    def fused_layer():
        ops_norm.fused_add_rms_norm(fx, fr, w, EPS)
        ops_norm.fused_add_rms_norm(fx, fr, w, EPS)
        return ops_norm.silu_and_mul(gate_up)

    silu_bytes = rows * 3 * INTER * el
    return {
        "add + rms_norm": (4 * act + HIDDEN * el, {
            "fused": lambda: ops_norm.fused_add_rms_norm(fx, fr, w, EPS), "torch": torch_add_norm}),
        "rms_norm": (2 * act + HIDDEN * el, {
            "kernel": lambda: ops_norm.rms_norm(x, w, EPS), "torch": lambda: rms_norm_torch(x, w, EPS)}),
        "silu_and_mul": (silu_bytes, {
            "kernel": lambda: ops_norm.silu_and_mul(gate_up), "torch": lambda: silu_and_mul_torch(gate_up)}),
        "layer element-wise": (2 * (4 * act + HIDDEN * el) + silu_bytes, {
            "fused": fused_layer, "torch": torch_layer}),
    }


def main() -> int:
    args = quick_json_args(__doc__, "bench_norm")
    if args is None:
        return 1
    start = time.time()
    rows_list = [1, 64, 4096] if args.quick else [1, 16, 64, 4096]
    results = []
    for rows in rows_list:
        for name, (nbytes, fns) in cases(rows).items():
            ms = {name: t.ms for name, t in timing.graphs(fns, calls=20, rounds=7 if args.quick else 15).items()}
            results.append({"case": name, "rows": rows, "bytes": nbytes, "us": {k: v * 1e3 for k, v in ms.items()},
                            "gbs": {k: nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()}})
    print(f"\nnorm ops on {torch.cuda.get_device_name()} (torch {torch.__version__}), bf16, hidden {HIDDEN}, "
          f"intermediate {INTER}; CUDA-graph replays")
    print(f"{'case':<20} {'rows':>5} {'kernel us':>10} {'torch us':>9} {'speedup':>8} {'kernel GB/s':>12} "
          f"{'torch GB/s':>11}")
    for r in results:
        mine = "fused" if "fused" in r["us"] else "kernel"
        r["speedup"] = r["us"]["torch"] / r["us"][mine]
        print(f"{r['case']:<20} {r['rows']:>5} {r['us'][mine]:>10.2f} {r['us']['torch']:>9.2f} {r['speedup']:>7.2f}x "
              f"{r['gbs'][mine]:>12.0f} {r['gbs']['torch']:>11.0f}")
    decode = [r["speedup"] for r in results if r["case"] == "layer element-wise" and r["rows"] <= 64]
    met = min(decode) >= BAR_DECODE_SPEEDUP
    print(f"\nbar: the layer's element-wise work {BAR_DECODE_SPEEDUP:.0f}x faster fused at 1-64 tokens "
          f"(min {min(decode):.2f}x): {'MET' if met else 'NOT MET'}  ({time.time() - start:.0f} s)")
    if args.json:
        report = {"device": torch.cuda.get_device_name(), "results": results, "bar_met": met}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
