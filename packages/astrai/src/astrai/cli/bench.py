"""``astrai bench``: every op through the resolver, side by side with the torch path.

Each case builds fresh random inputs, runs the public entry point (whatever backend the
resolver picks here) and the plain torch path on the same inputs, and reports the median
time, the achieved bandwidth or arithmetic rate, and the speed-up over torch. Without a
CUDA device the cases shrink to CPU sizes and the table says so.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from ..extension import ATTN_BACKEND, apply_rotary_emb, attention, attn_backend
from ..extension.backend import fp8 as fp8_policy
from ..extension.backend.rotary import rotary_torch
from ..extension.kv_cache import PagedKVCache
from ..extension.runtime import current_runtime


@dataclass
class Case:
    name: str
    shape: str
    run: Callable[[], object]  # through the resolver
    run_torch: Callable[[], object]  # the torch path
    bytes: float = 0.0  # fewest bytes the op must move
    flops: float = 0.0
    op: str = ""  # resolver op name, to report the chosen backend


@dataclass
class Result:
    name: str
    shape: str
    backend: str
    ms: float
    torch_ms: float
    rate: str

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.ms


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: module load, autotuning, allocator
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _decode_case(device, dtype, batch, kv_len, page_size=16, hq=32, hkv=8, d=128) -> Case:
    pages_per_seq = -(-(kv_len + 1) // page_size)
    cache = PagedKVCache(num_layers=1, num_pages=batch * pages_per_seq, page_size=page_size,
                         kv_heads=hkv, head_dim=d, dtype=dtype, device=device)
    seqs = list(range(batch))
    for s in seqs:
        cache.add_sequence(s)
    cache.plan(seqs, q_lens=[kv_len] * batch)
    cache.append(0, torch.randn(batch * kv_len, hkv, d, device=device, dtype=dtype),
                 torch.randn(batch * kv_len, hkv, d, device=device, dtype=dtype))
    cache.plan(seqs, q_lens=[1] * batch)
    q = torch.randn(batch, 1, hq, d, device=device, dtype=dtype)
    k = torch.randn(batch, 1, hkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)

    def run():
        return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="decode")

    def run_torch():
        with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
            return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="decode")

    kv_bytes = 2 * batch * (kv_len + 1) * hkv * d * dtype.itemsize
    return Case("paged decode", f"B={batch} kv={kv_len} {hq}/{hkv}x{d} page={page_size}", run, run_torch,
                bytes=kv_bytes, op="attention")


def _prefill_case(device, dtype, batch, seq, page_size=16, hq=32, hkv=8, d=128) -> Case:
    """Ragged causal prefill of fresh sequences over the paged cache (the serving path)."""
    cache = PagedKVCache(num_layers=1, num_pages=batch * -(-seq // page_size), page_size=page_size,
                         kv_heads=hkv, head_dim=d, dtype=dtype, device=device)
    seqs = list(range(batch))
    for s in seqs:
        cache.add_sequence(s)
    cache.plan(seqs, q_lens=[seq] * batch)
    q = torch.randn(batch, seq, hq, d, device=device, dtype=dtype)
    k = torch.randn(batch, seq, hkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)

    def run():
        return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="prefill")

    def run_torch():
        with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
            return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="prefill")

    flops = 4 * batch * hq * seq * seq * d / 2  # causal: half of QK^T and PV
    return Case("prefill causal", f"B={batch} L={seq} {hq}/{hkv}x{d} page={page_size}", run, run_torch,
                flops=flops, op="attention")


def _rotary_case(device, dtype, tokens, heads=32, d=128) -> Case:
    x = torch.randn(1, tokens, heads, d, device=device, dtype=dtype)
    angles = torch.randn(tokens, d // 2, device=device)
    cos, sin = angles.cos(), angles.sin()

    def run():
        with torch.inference_mode():
            return apply_rotary_emb(x, (cos, sin))

    def run_torch():
        with torch.inference_mode():
            return rotary_torch(x, cos, sin)

    nbytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * 4
    return Case("rotary", f"{tokens} tok x {heads} x {d}", run, run_torch, bytes=nbytes, op="rotary_emb")


def _fp8_case(device, m, n, k) -> Case:
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    scale = torch.tensor(0.5, device=device)
    dense_a, dense_b = a.to(torch.bfloat16), b.to(torch.bfloat16)

    def run():
        return fp8_policy.gemm(a, b, scale)

    def run_torch():  # the bf16 GEMM the FP8 path replaces
        return (dense_a @ dense_b) * scale

    return Case("fp8 gemm vs bf16", f"{m}x{n}x{k}", run, run_torch, flops=2 * m * n * k, op="fp8_gemm")


def cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        dtype = torch.bfloat16
        out = [_decode_case(device, dtype, 1, 4096), _decode_case(device, dtype, 16, 4096),
               _prefill_case(device, dtype, 1, 4096), _rotary_case(device, dtype, 16384)]
        if torch.cuda.get_device_capability(device) >= (8, 9):
            out.append(_fp8_case(device, 4096, 4096, 4096))
        if quick:
            out = [_decode_case(device, dtype, 4, 1024), _prefill_case(device, dtype, 1, 1024),
                   _rotary_case(device, dtype, 2048)]
        return out
    size = 1 if quick else 2
    dtype = torch.float32
    return [_decode_case(device, dtype, 2 * size, 256 * size), _prefill_case(device, dtype, 1, 128 * size),
            _rotary_case(device, torch.bfloat16, 512 * size), _fp8_case(device, 128 * size, 128 * size, 128 * size)]


def _backend_of(case: Case) -> str:
    """The backend the resolver picks for ``case.run`` (decided afresh, not the torch run's)."""
    resolver = current_runtime().resolver
    resolver.clear()
    case.run()
    decisions = [d for d in resolver.decisions(case.op) if d.source != "explicit"]
    return decisions[-1].chosen if decisions else "-"


def _rate(case: Case, ms: float) -> str:
    per_second = (case.bytes or case.flops) / ms * 1e3
    unit = "B/s" if case.bytes else "FLOP/s"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if per_second >= scale:
            return f"{per_second / scale:.2f} {prefix}{unit}"
    return f"{per_second:.0f} {unit}"


def run_all(device: torch.device, quick: bool, only: list[str] | None) -> list[Result]:
    repeats = 5 if device.type == "cpu" or quick else 30
    results = []
    selected = [c for c in cases(device, quick) if not only or any(o in c.name for o in only)]
    for case in track(selected, description="benchmarking", transient=True):
        backend = _backend_of(case)
        ms = _time_ms(case.run, device, repeats)
        torch_ms = _time_ms(case.run_torch, device, repeats)
        results.append(Result(case.name, case.shape, backend, ms, torch_ms, _rate(case, ms)))
    return results


def render(results: list[Result], device: torch.device, console: Console) -> None:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    table = Table(title=f"astrai bench on {where}")
    for column in ("op", "shape", "backend", "ms", "rate", "torch ms", "speed-up"):
        table.add_column(column)
    for r in results:
        table.add_row(r.name, r.shape, r.backend, f"{r.ms:.3f}", r.rate, f"{r.torch_ms:.3f}", f"{r.speedup:.2f}x")
    console.print(table)
    if device.type != "cuda":
        console.print("[yellow]no CUDA device: these are the torch fallbacks at small CPU sizes, "
                      "not kernel figures[/yellow]")


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.6 * len(results) + 1.5))
    labels = [f"{r.name}\n{r.shape}" for r in results]
    ax.barh(labels, [r.speedup for r in results])
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_xlabel("speed-up over the torch path")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    results = run_all(device, args.quick, args.ops)
    render(results, device, Console(width=160))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "results": [asdict(r) | {"speedup": r.speedup} for r in results]},
                      f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0
