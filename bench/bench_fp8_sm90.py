"""Hopper FP8 GEMM (wgmma + TMA) side by side with cuBLASLt (torch._scaled_mm) on an H200.

    python bench/bench_fp8_sm90.py [--json out.json] [--quick] [--write-table sm90_table.json]

Per shape (M x N x K; N x K are the LLM weight shapes, M the tokens): TFLOP/s of both, the
ratio ours / cuBLASLt with the same accumulation (promote <-> use_fast_accum=False,
fast <-> use_fast_accum=True), and the two floors: FLOPs at the dense FP8 peak and bytes
(A + B read once, the bf16 output written once) at the HBM bandwidth. Times are medians of
CUDA-graph replays of 10 back-to-back calls, every candidate of a shape replayed in turn
round after round (so a drift of the card's clocks reaches all alike). ``--write-table`` turns the run into the
plugin's measured preference table (``astrai_fp8.sm90_table``), stamped with the commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # sm90_capi
REPO = Path(__file__).resolve().parents[1]
import sm90_capi  # noqa: E402
from astrai_fp8._fp8_ops import sm90 as sm90_planner  # noqa: E402 - the binary's own planner
from astrai import timing  # noqa: E402

TILE_CONFIGS = sm90_planner.TILE_CONFIGS

PEAK_TFLOPS = 1979.0  # H200 SXM dense FP8 (datasheet)
HBM_TBPS = 4.8        # H200 HBM3e (datasheet)
LLM_NK = [(8192, 8192), (28672, 8192), (8192, 28672), (10240, 8192)]
MS = [1, 16, 64, 128, 1024, 4096, 8192]


def graph_time_ms(fn) -> float:
    return timing.graph(fn, calls=10, rounds=15, warmup=2).ms


def run_shape(lib, M: int, N: int, K: int, forced: tuple[int, ...] = ()) -> dict:
    """Our planner's choice, cuBLASLt and the ``forced`` tile configs, both accumulation
    modes, timed in turn (``timing.graphs``)."""
    dev = "cuda"
    a = (torch.randn(M, K, device=dev) * 2).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, device=dev) * 2).to(torch.float8_e4m3fn)
    sa = torch.tensor(0.5, device=dev)
    sb = torch.tensor(0.25, device=dev)
    scale = sa * sb
    outs = {}

    def ours(accum: str, config: int = -1):
        out = outs.setdefault((accum, config), torch.empty(M, N, device=dev, dtype=torch.bfloat16))
        return lambda: sm90_capi.gemm(lib, a, b, scale, out=out, accum=accum, force_config=config)

    def cublas(fast: bool):
        return lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    flops = 2.0 * M * N * K
    bytes_ = M * K + N * K + 2 * M * N
    row = {"M": M, "N": N, "K": K,
           "floor_flop_ms": flops / (PEAK_TFLOPS * 1e12) * 1e3,
           "floor_byte_ms": bytes_ / (HBM_TBPS * 1e12) * 1e3}
    fns = {}
    for accum, fast in (("promote", False), ("fast", True)):
        fns[f"ours_{accum}"] = ours(accum)
        try:  # cuBLASLt FP8 needs M, N, K multiples of 16
            ref = cublas(fast)()
            fns[f"cublas_{accum}"] = cublas(fast)
        except RuntimeError as e:
            ref, row[f"cublas_{accum}_error"] = None, str(e).splitlines()[0]
        fns[f"ours_{accum}"]()
        torch.cuda.synchronize()
        if ref is not None:
            out = outs[(accum, -1)].float()
            row[f"rel_diff_{accum}"] = ((out - ref.float()).norm() / ref.float().norm()).item()
    for config in forced:
        fns[f"config{config}"] = ours("promote" if TILE_CONFIGS[config].promote else "fast", config)
    times = {name: t.ms for name, t in timing.graphs(fns).items()}
    for accum in ("promote", "fast"):
        t_ours, t_ref = times[f"ours_{accum}"], times.get(f"cublas_{accum}")
        row[f"ours_{accum}_ms"] = t_ours
        row[f"ours_{accum}_tflops"] = flops / (t_ours * 1e-3) / 1e12
        row[f"cublas_{accum}_ms"] = t_ref
        row[f"cublas_{accum}_tflops"] = flops / (t_ref * 1e-3) / 1e12 if t_ref else None
        row[f"ratio_{accum}"] = t_ref / t_ours if t_ref else None
    for config in forced:
        row[f"config{config}_ms"] = times[f"config{config}"]
    return row


CLUSTER = {"fast": 4, "promote": 5}  # the 2-CTA multicast configs (not chosen by default yet)


def time_forced(lib, M: int, N: int, K: int, config: int) -> float:
    a = (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.125, device="cuda")
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    return timing.graph(lambda: sm90_capi.gemm(lib, a, b, scale, out=out, force_config=config)).ms


def cluster_rows(shapes) -> dict:
    """TFLOP/s of the cluster configs, in a child process with a timeout (a protocol bug
    must not hang the benchmark run)."""
    import subprocess
    arg = ";".join(f"{M},{N},{K}" for M, N, K in shapes)
    try:
        r = subprocess.run([sys.executable, __file__, "--cluster-child", arg], capture_output=True,
                           text=True, timeout=240)
    except subprocess.TimeoutExpired:
        print("cluster configs: timed out (hang?)")
        return {}
    if r.returncode != 0:
        print("cluster configs failed:", (r.stdout + r.stderr)[-2000:])
        return {}
    return {tuple(v["shape"]): v for v in map(json.loads, r.stdout.splitlines()) if v}


def cluster_child(arg: str) -> None:
    lib = sm90_capi.load()
    for item in arg.split(";"):
        M, N, K = map(int, item.split(","))
        row = {"shape": [M, N, K]}
        for accum, cfg in CLUSTER.items():
            row[f"cluster_{accum}_tflops"] = 2.0 * M * N * K / (time_forced(lib, M, N, K, cfg) * 1e-3) / 1e12
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="M in {1, 1024, 8192} only")
    ap.add_argument("--configs", default="",
                    help="comma-separated tile configs to force at M >= 1024 beside the planner's "
                         "choice (e.g. 14: pipelined promotion, 15-17: staggered consumers)")
    ap.add_argument("--no-cluster", action="store_true", help="skip the forced 2-CTA cluster configs")
    ap.add_argument("--write-table", type=Path, help="write the measured preference table here")
    ap.add_argument("--cluster-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU")
        return
    if args.cluster_child:
        cluster_child(args.cluster_child)
        return
    lib = sm90_capi.load()
    shapes = [(M, N, K) for N, K in LLM_NK for M in ([1, 1024, 8192] if args.quick else MS)]
    shapes.append((8192, 8192, 8192))
    rows = []
    hdr = (f"{'M':>5} {'N':>6} {'K':>6} | {'ours P':>7} {'cuBL P':>7} {'ratio':>5} | "
           f"{'ours F':>7} {'cuBL F':>7} {'ratio':>5} | {'floorF':>7} {'floorB':>7} {'ours ms':>8}")
    print(f"{torch.cuda.get_device_name()}  TFLOP/s (P: promoted fp32 sums vs use_fast_accum=False;"
          " F: fast accumulation vs use_fast_accum=True); floors in ms")
    print(hdr)
    forced = tuple(int(c) for c in args.configs.split(",") if c)
    for M, N, K in shapes:
        r = run_shape(lib, M, N, K, forced if M >= 1024 else ())
        rows.append(r)

        def f(v, w=7, p=1):
            return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"
        print(f"{M:>5} {N:>6} {K:>6} | {f(r['ours_promote_tflops'])} {f(r['cublas_promote_tflops'])} "
              f"{f(r['ratio_promote'], 5, 2)} | {f(r['ours_fast_tflops'])} {f(r['cublas_fast_tflops'])} "
              f"{f(r['ratio_fast'], 5, 2)} | {f(r['floor_flop_ms'], 7, 4)} {f(r['floor_byte_ms'], 7, 4)} "
              f"{f(r['ours_promote_ms'], 8, 4)}", flush=True)
    big = [(r["M"], r["N"], r["K"]) for r in rows if r["M"] >= 1024]
    found = {} if args.no_cluster else cluster_rows(big)
    if found:
        print("\n2-CTA cluster configs (B multicast), TFLOP/s and ratio to cuBLASLt")
        for r in rows:
            c = found.get((r["M"], r["N"], r["K"]))
            if not c:
                continue
            r.update({k: v for k, v in c.items() if k != "shape"})
            cp, cf = c["cluster_promote_tflops"], c["cluster_fast_tflops"]
            rp = cp / r["cublas_promote_tflops"] if r["cublas_promote_tflops"] else None
            rf = cf / r["cublas_fast_tflops"] if r["cublas_fast_tflops"] else None
            print(f"{r['M']:>5} {r['N']:>6} {r['K']:>6} | P {cp:7.1f} {rp or 0:5.2f} | F {cf:7.1f} {rf or 0:5.2f}",
                  flush=True)
    for config in forced:
        accum = "promote" if TILE_CONFIGS[config].promote else "fast"
        print(f"\nconfig {config} ({TILE_CONFIGS[config].name}), timed in turn with the rest of its "
              "shape: TFLOP/s and ratio to cuBLASLt")
        for r in rows:
            if r["M"] < 1024:
                continue
            ms, ref = r[f"config{config}_ms"], r[f"cublas_{accum}_ms"]
            tf = 2.0 * r["M"] * r["N"] * r["K"] / (ms * 1e-3) / 1e12
            print(f"{r['M']:>5} {r['N']:>6} {r['K']:>6} | {accum[0].upper()} {tf:7.1f} {ref / ms if ref else 0:5.2f} "
                  f"(planner's {accum} {r[f'ratio_{accum}']:.2f})", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.write_table:
        write_table(result, args.write_table)


def _commit() -> str:
    """The short commit of the tree measured, marked when it had uncommitted changes;
    $ASTRAI_COMMIT names it where the copy measured carries no history of its own."""
    if os.environ.get("ASTRAI_COMMIT"):
        return os.environ["ASTRAI_COMMIT"]

    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "packages/astrai-fp8/csrc").stdout.strip()
    return head + ("+kernel-changes" if dirty else "")


def write_table(result: dict, path: Path) -> None:
    sys.path.insert(0, str(REPO / "packages" / "astrai-fp8" / "src"))
    from astrai_fp8 import sm90_table

    table = sm90_table.from_bench(result, commit=_commit(),
                                  date=datetime.date.today().isoformat())
    path.write_text(json.dumps(table, indent=1) + "\n")
    wins = sum(c["ratio"] > 1.0 for c in table["classes"])
    print(f"table: {path} ({len(table['classes'])} classes, plugin faster in {wins})")


if __name__ == "__main__":
    main()
