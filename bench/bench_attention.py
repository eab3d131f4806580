"""Decode benchmark: the astrai-attention decode kernels side by side with torch SDPA (cuDNN and
flash backends on contiguous K/V, their best case) and with the torch fallback backend on
the same paged cache (prefill: bench_prefill.py). Prints a table of times, bandwidth and
ratios; ``--json``
writes the rows. Times are medians of CUDA-graph replays (no host overhead on any side).

    python bench/bench_attention.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # attention_cases
from attention_cases import Paged  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension.ops import attention as ops  # noqa: E402

HBM_READ_TBS = 4.6  # measured HBM read limit of the H200 (design anchors)


def time_us(fn, reps: int = 20, rounds: int = 7) -> float:
    """Median per-call microseconds of ``fn`` from a CUDA graph of ``reps`` calls (eager if not capturable)."""
    return timing.graph(fn, calls=reps, rounds=rounds, eager_fallback=True).median_us

def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def try_time(fn):
    try:
        return time_us(fn)
    except Exception as exc:  # a backend that does not take this shape
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def bench_decode(rows, quick):
    Hq, Hkv, D, dt = 32, 8, 128, torch.bfloat16
    for B in ([1, 16, 64] if quick else [1, 4, 16, 32, 64]):
        S = 4096
        kv_bytes = 2 * B * S * Hkv * D * 2
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dt)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        res = {}
        for page in (16, 1):
            cache = Paged([S] * B, page, Hkv, D, dt, spare_pages=0)
            res[f"astrai paged p{page}"] = try_time(lambda c=cache: ops.attn_paged_decode(
                q, c.k_cache, c.v_cache, c.kv_indptr, c.kv_indices, c.kv_lens))
        res["astrai contiguous"] = try_time(lambda: ops.attn_decode(q, k, v))
        res["sdpa cudnn"] = try_time(lambda: sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False))
        res["sdpa flash"] = try_time(lambda: sdpa(SDPBackend.FLASH_ATTENTION, qt, kt, vt, False))
        res["torch fallback (paged p16)"] = try_time(lambda: fallback_decode(q, k, v, B, S, Hkv, D, dt))
        for impl, t in res.items():
            row = {"kind": "decode", "shape": f"B={B} kv={S} GQA 32/8 d128 bf16", "impl": impl}
            if isinstance(t, float):
                row.update(us=t, tbs=kv_bytes / t * 1e-6, hbm_fraction=kv_bytes / t * 1e-6 / HBM_READ_TBS)
            else:
                row["error"] = t
            rows.append(row)
        del cache


_FALLBACK = {}


def fallback_decode(q, k, v, B, S, Hkv, D, dt):
    """The torch-native backend over a paged cache holding the same tokens (built once)."""
    from astrai.extension.backend.attention.torch_native import TorchNativeBackend
    from astrai.extension.kv_cache import PagedKVCache

    key = (B, S)
    if key not in _FALLBACK:
        cache = PagedKVCache(num_layers=1, num_pages=B * (S // 16 + 1), page_size=16, kv_heads=Hkv, head_dim=D,
                             dtype=dt, device="cuda")
        for b in range(B):
            cache.add_sequence(b)
        cache.plan(list(range(B)), [S - 1] * B)
        cache.append(0, k[:, : S - 1].reshape(1, -1, Hkv, D), v[:, : S - 1].reshape(1, -1, Hkv, D))
        cache.plan(list(range(B)), [1] * B)
        cache.append(0, k[:, S - 1:], v[:, S - 1:])
        _FALLBACK.clear()
        _FALLBACK[key] = (cache, TorchNativeBackend())
    cache, backend = _FALLBACK[key]
    return backend.fwd_decode(q, None, None, kv_cache=cache, layer_id=0, mask=None, is_causal=True)


def add_ratios(rows):
    for row in rows:
        peers = {r["impl"]: r for r in rows if r["shape"] == row["shape"] and "us" in r}
        for peer in ("sdpa cudnn", "sdpa flash"):
            if "us" in row and peer in peers:
                row[f"speedup_vs_{peer.split()[1]}"] = peers[peer]["us"] / row["us"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    bench_decode(rows, args.quick)
    add_ratios(rows)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':<36} {'impl':<28} {'us':>9} {'TB/s':>6} {'TFLOP/s':>8} {'x cuDNN':>8} {'x flash':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<36} {r['impl']:<28} {r['error']}")
            continue
        print(f"{r['shape']:<36} {r['impl']:<28} {r['us']:9.2f} {r.get('tbs', float('nan')):6.2f} "
              f"{r.get('tflops', float('nan')):8.1f} {r.get('speedup_vs_cudnn', float('nan')):8.2f} "
              f"{r.get('speedup_vs_flash', float('nan')):8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
