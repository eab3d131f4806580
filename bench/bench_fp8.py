"""astrai-fp8 (mma.sync mainloop) side by side with torch: GEMM vs cuBLASLt and bf16, quantize
vs the torch cast.

    python bench/bench_fp8.py [--json out.json] [--plot out.png] [--quick]
    python bench/bench_fp8.py --replot out.json --plot out.png      (no GPU needed)

GEMM rows (M x N x K; N x K the LLM weight shapes, x [M, K] @ w.t()): TFLOP/s of ours
(the compiled op with ``mainloop="mma_sync"``, so the mma.sync kernel even on Hopper, where
the public op would take the wgmma kernel), of ``torch._scaled_mm`` (cuBLASLt FP8) and of a
bf16 ``torch.mm``, and
the ratios ours / cuBLASLt and ours / bf16. On sm_90 ours is the fp16 *emulation* of
mma.sync (F2FP unpack + HMMA): it is expected to trail cuBLASLt there, and the core never
routes Hopper GEMMs to it; the numbers are reported as measured. Quantize rows: GB/s of
``ops.fp8_quantize`` (bytes read + written) vs ``(x.float() * s).clamp().to(fp8)``.
Times: medians of CUDA-graph replays of back-to-back calls (launch gaps excluded).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from astrai import timing

LLM_NK = [(8192, 8192), (28672, 8192), (8192, 28672), (10240, 8192)]
MS = [1, 16, 128, 1024, 4096, 8192]



def _abi(t):
    from astrai.extension.abi import dtype_code

    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype_code(t)


def bench_gemm(module, shapes):
    rows = []
    for m, n, k in shapes:
        x = (torch.randn(m, k, device="cuda") * 2).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device="cuda") * 2).to(torch.float8_e4m3fn)
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        one = torch.tensor(1.0, device="cuda")
        flop = 2.0 * m * n * k
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        args = (_abi(x), _abi(w), _abi(one), None, _abi(out), False, True)
        ours = timing.graph(lambda: module.gemm(*args, torch.cuda.current_stream().cuda_stream,
                                           mainloop="mma_sync")).ms
        cublas = timing.graph(lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one,
                                                  out_dtype=torch.bfloat16)).ms
        bf16 = timing.graph(lambda: torch.mm(xb, wb.t())).ms
        props = torch.cuda.get_device_properties(0)
        smem_sm = props.shared_memory_per_multiprocessor
        smem_block = getattr(props, "shared_memory_per_block_optin", smem_sm - 1024)
        plan = module.plan(m, n, k, False, True, props.multi_processor_count, smem_sm, smem_block)
        row = {"m": m, "n": n, "k": k, "tile": plan["tile"], "ours_ms": ours, "scaled_mm_ms": cublas, "bf16_ms": bf16,
               "ours_tflops": flop / ours / 1e9, "scaled_mm_tflops": flop / cublas / 1e9,
               "bf16_tflops": flop / bf16 / 1e9, "ours_over_scaled_mm": cublas / ours,
               "ours_over_bf16": bf16 / ours}
        rows.append(row)
        print(f"gemm {m:>5} x {n:>5} x {k:>5} [{plan['tile']:>7}]  ours {row['ours_tflops']:7.1f}  cuBLASLt "
              f"{row['scaled_mm_tflops']:7.1f}  bf16 {row['bf16_tflops']:7.1f} TFLOP/s  "
              f"ours/cuBLASLt {row['ours_over_scaled_mm']:.2f}  ours/bf16 {row['ours_over_bf16']:.2f}",
              flush=True)
        del x, w, xb, wb
    return rows


def bench_quantize(ops, shapes):
    rows = []
    for m, k, layout in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        s = torch.tensor(10.0, device="cuda")
        ours = timing.graph(lambda: ops.fp8_quantize(x, s, "e4m3", layout)).ms

        def ref():
            q = (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
            amax = x.abs().amax()
            return (q if layout != 1 else q.t().contiguous()), amax

        theirs = timing.graph(ref).ms
        nbytes = m * k * (2 + (2 if layout == 2 else 1))
        row = {"m": m, "k": k, "out_layout": layout, "ours_ms": ours, "torch_ms": theirs,
               "ours_gbps": nbytes / ours / 1e6, "torch_gbps": nbytes / theirs / 1e6,
               "speedup": theirs / ours}
        rows.append(row)
        print(f"quantize {m:>5} x {k:>5} layout {layout}: ours {row['ours_gbps']:7.0f} GB/s, "
              f"torch {row['torch_gbps']:7.0f} GB/s, x{row['speedup']:.1f}", flush=True)
    return rows


def plot(result: dict, path: str) -> None:
    """TFLOP/s against M, one panel per N x K weight: ours, cuBLASLt FP8, bf16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nks = sorted({(r["n"], r["k"]) for r in result["gemm"]}, key=lambda nk: (nk[1], nk[0]))
    fig, axes = plt.subplots(1, len(nks), figsize=(4 * len(nks), 3.4), squeeze=False)
    for ax, (n, k) in zip(axes[0], nks):
        by_m = {r["m"]: r for r in reversed(result["gemm"]) if (r["n"], r["k"]) == (n, k)}
        rows = [by_m[m] for m in sorted(by_m)]
        ms = [r["m"] for r in rows]
        ours = "ours (mma.sync" + (", emulated)" if result["sm"] not in (89, 120) else ")")
        for key, label in (("ours_tflops", ours), ("scaled_mm_tflops", "cuBLASLt FP8"),
                           ("bf16_tflops", "bf16 torch.mm")):
            ax.plot(ms, [r[key] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"N={n}, K={k}")
        ax.set_xlabel("M")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"FP8 GEMM on {result['device']} (sm_{result['sm']}), torch {result['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--plot", help="also draw the GEMM rows into this PNG")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier --json (no GPU)")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot or "bench_fp8.png")
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("bench_fp8: needs an sm_89+ CUDA device; nothing to do")
        return 0
    from astrai.extension.ops import fp8 as ops

    ms = [16, 1024, 8192] if args.quick else MS
    nks = LLM_NK[:1] if args.quick else LLM_NK
    shapes = [(m, n, k) for m in ms for n, k in nks if not (m == 8192 and n * k > 8192 * 8192)]
    from astrai.extension.ops import _plugin

    gemm_rows = bench_gemm(_plugin.require("fp8_gemm", torch.device("cuda")), shapes)
    quant_rows = bench_quantize(ops, [(8192, 8192, 0), (8192, 8192, 1), (8192, 8192, 2),
                                      (16384, 4096, 0)])
    cap = torch.cuda.get_device_capability()
    result = {"device": torch.cuda.get_device_name(), "sm": cap[0] * 10 + cap[1],
              "torch": torch.__version__, "mainloop": "mma.sync m16n8k32",
              "gemm": gemm_rows, "quantize": quant_rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
