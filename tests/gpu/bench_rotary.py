"""Rotary benchmark: the astrai-rotary kernel side by side with the torch complex-multiply
path (the fallback ``apply_rotary_emb`` uses) and a plain device copy of the same bytes.

Kernel and torch times are medians of CUDA-graph replays (no host overhead on either
side); "op eager" is one ``ops.rotary.rotary_emb`` call from Python, host overhead and
output allocation included. Bandwidth counts x read + out written + cos/sin read once.

    python tests/gpu/bench_rotary.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from graph_timing import graph_time_ms  # noqa: E402
from reference import rotary_tables  # noqa: E402

from astrai.extension.backend.rotary import rotary_torch  # noqa: E402
from astrai.extension.ops.rotary import rotary_emb  # noqa: E402

TARGET = (1, 16384, 32, 128)  # 16k tokens x 32 heads x 128: the design's anchor
TARGET_TBS, TARGET_SPEEDUP = 3.5, 5.0

CASES = [  # name, (B, L, H, D), layout
    ("prefill q", TARGET, "blhd"),
    ("prefill q, BHLD view", TARGET, "bhld"),
    ("prefill q, bf162 path", TARGET, "offset"),
    ("prefill k (GQA 8)", (1, 16384, 8, 128), "blhd"),
    ("prefill d64", (1, 16384, 32, 64), "blhd"),
    ("prefill d256", (1, 16384, 16, 256), "blhd"),
    ("batch prefill", (4, 8192, 32, 128), "blhd"),
    ("decode B=64", (64, 1, 32, 128), "blhd"),
    ("decode B=1", (1, 1, 32, 128), "blhd"),
]



def graph_time_us(fn, reps: int, rounds: int) -> float:
    return graph_time_ms(fn, calls=reps, rounds=rounds) * 1e3


def eager_time_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / reps


def make_x(shape, layout):
    B, L, H, D = shape
    if layout == "bhld":
        return torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3)
    if layout == "offset":  # 4-byte aligned view: the kernel takes its one-pair-per-thread path
        return torch.randn(B, L, H, D + 8, device="cuda", dtype=torch.bfloat16)[..., 2:2 + D]
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def bench_case(name, shape, layout, module, quick: bool) -> dict:
    B, L, H, D = shape
    x = make_x(shape, layout)
    cos, sin = (t.cuda() for t in rotary_tables(L, D, offset=1000))
    out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    abi = lambda t: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), 0 if t.dtype == torch.float32 else 2)  # noqa: E731
    args = (abi(x), abi(cos), abi(sin), abi(out))

    def kernel():
        module.rotary_emb(*args, torch.cuda.current_stream().cuda_stream)

    nbytes = 2 * x.numel() * 2 + 2 * cos.numel() * 4  # x read + out written + cos/sin
    reps, rounds = (5, 5) if quick else (20, 15)
    t_kernel = graph_time_us(kernel, reps, rounds)
    t_torch = graph_time_us(lambda: rotary_torch(x, cos, sin), reps, rounds)
    t_copy = graph_time_us(lambda: out.copy_(x), reps, rounds)
    t_eager = eager_time_us(lambda: rotary_emb(x, cos, sin), 20 if quick else 200)
    got = rotary_emb(x, cos, sin).float()
    want = rotary_torch(x, cos, sin).float()
    return {
        "case": name, "shape": list(shape), "layout": layout, "bytes": nbytes,
        "kernel_us": t_kernel, "kernel_tbs": nbytes / t_kernel / 1e6,
        "torch_us": t_torch, "torch_tbs": nbytes / t_torch / 1e6,
        "copy_us": t_copy, "copy_tbs": 2 * x.numel() * 2 / t_copy / 1e6,
        "op_eager_us": t_eager, "speedup": t_torch / t_kernel,
        "max_abs_diff_vs_torch": (got - want).abs().max().item(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_rotary: no CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    module = importlib.import_module("astrai_rotary._rotary_emb")
    rows = [bench_case(name, shape, layout, module, args.quick) for name, shape, layout in CASES]

    print(f"\nrotary on {torch.cuda.get_device_name()} (torch {torch.__version__}); "
          f"times are medians of CUDA-graph replays")
    print(f"{'case':<22} {'shape':<18} {'kernel us':>9} {'TB/s':>6} {'torch us':>9} {'TB/s':>6} "
          f"{'speedup':>7} {'copy TB/s':>9} {'op eager us':>11} {'diff':>8}")
    for r in rows:
        print(f"{r['case']:<22} {'x'.join(map(str, r['shape'])):<18} {r['kernel_us']:>9.1f} {r['kernel_tbs']:>6.2f} "
              f"{r['torch_us']:>9.1f} {r['torch_tbs']:>6.2f} {r['speedup']:>6.1f}x {r['copy_tbs']:>9.2f} "
              f"{r['op_eager_us']:>11.1f} {r['max_abs_diff_vs_torch']:>8.2g}")
    anchor = rows[0]
    verdict = anchor["kernel_tbs"] >= TARGET_TBS and anchor["speedup"] >= TARGET_SPEEDUP
    print(f"\ntarget at 16k x 32 x 128: >= {TARGET_TBS} TB/s and >= {TARGET_SPEEDUP}x -> "
          f"{anchor['kernel_tbs']:.2f} TB/s, {anchor['speedup']:.1f}x: {'MET' if verdict else 'NOT MET'}")
    if args.json:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "build_info": module.build_info(), "rows": rows,
                  "target": {"tbs": TARGET_TBS, "speedup": TARGET_SPEEDUP, "met": verdict}}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
