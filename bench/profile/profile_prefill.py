"""Where a prefill at server shapes loses to cuDNN: per implementation, the kernels one call
launches (name, GPU time, grid, block, registers, shared memory), the blocks of each an SM holds
at once (from those figures and the SM's limits), the waves its grid makes on this GPU and the
share of the last wave it leaves idle, the gaps between its kernels, and cuDNN's same figures in
the same run. (The trace's own "blocks per SM" is the grid divided by the SMs, not residency.)

The rows of bench/bench_prefill.py that lose most (16 x 1024 and 64 x 512, GQA 32/8, bf16) run
``attn_paged_prefill`` over pages in order and shuffled, the shuffled pages gathered in order
first (what the CUDA backend runs for a long step), the contiguous ``attn_prefill``, and cuDNN
through SDPA on contiguous ``[B, H, L, D]``. Each runs ``--calls`` times under the torch profiler
(kernel records from CUPTI: grid, block, registers and shared memory are the driver's own
figures), one profiler session per implementation, so every kernel of a trace is
that implementation's.

    PYTHONPATH=packages/astrai/src python3 bench/profile/profile_prefill.py [--dims 64 128 256]
        [--shapes 16x1024 64x512] [--full] [--heads 32/8] [--calls 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "helpers"))

DT = torch.bfloat16


def waves(blocks: int, sms: int, blocks_per_sm: int) -> tuple[float, float]:
    """``(waves, idle share of the last wave)`` of a grid of ``blocks`` on ``sms`` SMs holding
    ``blocks_per_sm`` each: 2.1 waves leave 90 % of the third wave's slots idle."""
    slots = sms * max(1, blocks_per_sm)
    w = blocks / slots
    full = math.ceil(w)
    return w, (full * slots - blocks) / slots if full else 0.0


# an SM's limits (torch.cuda.get_device_properties' names); blocks and the per-block shared
# memory the driver reserves are the same on sm_80 and sm_90
MAX_BLOCKS_PER_SM = 32
RESERVED_SMEM_PER_BLOCK = 1024


def sm_limits(props) -> dict:
    return {"threads": props.max_threads_per_multi_processor, "registers": props.regs_per_multiprocessor,
            "shared_memory": props.shared_memory_per_multiprocessor}


def resident_blocks(threads: int, registers: int, shared_memory: int, limits: dict) -> int:
    """Blocks of a kernel one SM holds at once: the least that its threads, registers (allocated
    per warp in units of 256), shared memory (plus the driver's 1 KB a block) and the block limit
    allow."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    fits = [MAX_BLOCKS_PER_SM, limits["threads"] // (warps * 32), limits["registers"] // (regs_per_warp * warps)]
    if shared_memory:
        fits.append(limits["shared_memory"] // (shared_memory + RESERVED_SMEM_PER_BLOCK))
    return max(0, min(fits))


def kernel_summary(trace: dict, calls: int, sms: int, limits: dict) -> dict:
    """A chrome trace of ``calls`` calls summarised per call: ``kernels`` (name -> launches, GPU
    us, grid, block, registers, shared memory, resident blocks per SM, waves, idle share of the
    last wave), ``gpu_us`` (the kernels' time), ``span_us`` (first kernel start to last kernel
    end, divided by calls) and ``gap_us`` (the span not covered by a kernel)."""
    kernels = sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e),
                     key=lambda e: e["ts"])
    by_name: dict[str, dict] = defaultdict(lambda: {"launches": 0, "us": 0.0})
    busy_end, covered = None, 0.0
    for e in kernels:
        row = by_name[e["name"]]
        row["launches"] += 1
        row["us"] += e["dur"]
        args = e.get("args", {})
        blocks = math.prod(args.get("grid", [0]))
        threads, registers = math.prod(args.get("block", [0])), args.get("registers per thread")
        row.update(grid=args.get("grid"), block=args.get("block"), registers=registers,
                   shared_memory=args.get("shared memory"))
        if blocks and threads and isinstance(registers, int):
            per_sm = resident_blocks(threads, registers, row["shared_memory"] or 0, limits)
            row["resident_per_sm"] = per_sm
            if per_sm:
                row["waves"], row["last_wave_idle"] = waves(blocks, sms, per_sm)
        start, end = e["ts"], e["ts"] + e["dur"]  # the union of the kernels' intervals
        if busy_end is None or start >= busy_end:
            covered += e["dur"]
            busy_end = end
        elif end > busy_end:
            covered += end - busy_end
            busy_end = end
    rows = {}
    for name, row in sorted(by_name.items(), key=lambda kv: -kv[1]["us"]):
        rows[name] = {**row, "launches": row["launches"] / calls, "us": row["us"] / calls}
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / calls if kernels else 0.0
    gpu = sum(r["us"] for r in rows.values())
    return {"kernels": rows, "gpu_us": gpu, "span_us": span, "gap_us": max(0.0, span - covered / calls)}


def profiled(fn, calls: int, sms: int, limits: dict) -> dict:
    """``fn`` warmed up, then ``calls`` times under the profiler: :func:`kernel_summary`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return kernel_summary(json.loads(path.read_text()), calls, sms, limits)


def implementations(lens: list[int], d: int, causal: bool, heads: tuple[int, int]) -> dict:
    """name -> a call of that implementation over one set of random inputs."""
    from attention_cases import Paged, ragged_plan
    from bench_prefill import gathered_prefill

    from astrai.extension.ops import attention as ops

    hq, hkv = heads
    q = torch.randn(sum(lens), hq, d, device="cuda", dtype=DT)
    qo, tb, ti = ragged_plan(lens)
    calls = {}
    for name, order in (("paged in order", "in_order"), ("paged shuffled", "shuffled")):
        cache = Paged(lens, 16, hkv, d, DT, spare_pages=0, order=order)
        calls[name] = (lambda c: lambda: ops.attn_paged_prefill(q, c.k_cache, c.v_cache, qo, c.kv_indptr, c.kv_indices,
                                                                c.kv_lens, tb, ti, causal))(cache)
        if order == "shuffled":
            calls["paged shuffled, gathered"] = gathered_prefill(ops, q, cache, (qo, tb, ti), causal)
    if len(set(lens)) == 1:
        b, n = len(lens), lens[0]
        qd = q.view(b, n, hq, d)
        k = torch.randn(b, n, hkv, d, device="cuda", dtype=DT)
        v = torch.randn(b, n, hkv, d, device="cuda", dtype=DT)
        calls["contiguous"] = lambda: ops.attn_prefill(qd, k, v, is_causal=causal)
        qc, kc, vc = (x.transpose(1, 2).contiguous() for x in (qd, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal, enable_gqa=True)

        calls["cuDNN (SDPA, contiguous BHLD)"] = cudnn
    return calls


def parse_shape(text: str) -> list[int]:
    batch, _, length = text.partition("x")
    if not (batch.isdigit() and length.isdigit()) or int(batch) < 1 or int(length) < 1:
        raise argparse.ArgumentTypeError(f"a shape is BATCHxLENGTH, e.g. 64x512; got {text!r}")
    return [int(length)] * int(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape("16x1024"), parse_shape("64x512")])
    ap.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill needs a CUDA device (the figures are the GPU's own)")
    heads = tuple(int(x) for x in a.heads.split("/"))
    props = torch.cuda.get_device_properties(0)
    sms, limits = props.multi_processor_count, sm_limits(props)
    causal = not a.full
    out = {"device": torch.cuda.get_device_name(0), "sms": sms, "causal": causal, "heads": a.heads, "rows": []}
    for lens in a.shapes:
        for d in a.dims:
            label = f"{len(lens)}x{lens[0]} d{d} {'causal' if causal else 'full'}"
            print(f"\n== {label} ==")
            results = {name: profiled(fn, a.calls, sms, limits) for name, fn in implementations(lens, d, causal, heads).items()}
            peer = results.get("cuDNN (SDPA, contiguous BHLD)")
            for name, r in results.items():
                ratio = f"  cuDNN / this {peer['span_us'] / r['span_us']:.2f}" if peer and r["span_us"] else ""
                print(f"  {name}: span {r['span_us']:.1f} us, kernels {r['gpu_us']:.1f} us, gaps {r['gap_us']:.1f} us{ratio}")
                for kname, k in list(r["kernels"].items())[:4]:
                    wave = (f", {k['waves']:.2f} waves, last {k['last_wave_idle']:.0%} idle" if "waves" in k else "")
                    print(f"      {k['us']:8.1f} us x{k['launches']:.0f}  grid {k['grid']} block {k['block']} "
                          f"regs {k['registers']} smem {k['shared_memory']} {k.get('resident_per_sm', '?')} a SM{wave}  "
                          f"{kname[:90]}")
            out["rows"].append({"shape": label, "results": results})
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
