"""Decode latency by split count, with the in-kernel split merge and with the separate
combine kernel, with and without programmatic dependent launch (PDL) of the split grid,
beside cuDNN / flash SDPA: bf16 GQA 32/8 d128, kv 4096, batch 1 / 16 / 64. Times are
medians of CUDA-graph replays of 20 calls (``astrai.timing.graph``), so with PDL a call's
blocks start while the previous call's last kernel drains. The ops use the "+combine"
(no PDL) variant at the split count of decode_plan.

    python bench/bench_decode_latency.py [--json out.json]
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
from attention_cases import Paged, abi, module  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension.abi import stream_handle  # noqa: E402
from astrai.extension.ops import attention as ops  # noqa: E402

SPLITS = {1: [16, 32], 16: [1, 2], 64: [1]}


def us(fn) -> float:
    return timing.graph(fn, calls=20, rounds=9).median_us


def direct(kind, q, kv, splits, fused, pdl):
    b, _, hq, d = q.shape
    hkv = 8
    count = torch.zeros(b * hkv, dtype=torch.int32, device="cuda") if fused and splits > 1 else None

    def call():
        out = torch.empty_like(q)
        ws_o = torch.empty(splits * b * hq * d, dtype=torch.float32, device="cuda") if splits > 1 else None
        ws_lse = torch.empty(splits * b * hq, dtype=torch.float32, device="cuda") if splits > 1 else None
        if kind == "paged":
            c = kv
            module("attn_paged_decode").attn_paged_decode(
                abi(q), abi(c.k_cache), abi(c.v_cache), abi(out), abi(c.kv_indptr), abi(c.kv_indices),
                abi(c.kv_lens), splits, abi(ws_o), abi(ws_lse), stream_handle(q.device), abi(count), pdl)
        else:
            k, v = kv
            module("attn_decode").attn_decode(abi(q), abi(k), abi(v), abi(out), None, splits, abi(ws_o),
                                              abi(ws_lse), stream_handle(q.device), abi(count), pdl)
        return out

    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    Hq, Hkv, D, S, dt = 32, 8, 128, 4096, torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B in (1, 16, 64):
        kv_bytes = 2 * B * S * Hkv * D * 2
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dt)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt)
        cache = Paged([S] * B, 16, Hkv, D, dt, spare_pages=0)
        plan = module("attn_decode").decode_plan(B, Hkv, Hq // Hkv, D, S, sms)
        res = {}
        for splits in SPLITS[B]:
            for fused in ((False, True) if splits > 1 else (False,)):
                for pdl in (True, False):
                    tag = (f"s={splits}{' merged' if fused else ' +combine' if splits > 1 else ''}"
                           f"{'' if pdl else ' no-pdl'}")
                    res[f"paged p16 {tag}"] = us(direct("paged", q, cache, splits, fused, pdl))
                    res[f"contig {tag}"] = us(direct("contig", q, (k, v), splits, fused, pdl))
        res[f"ops paged p16 (plan s={plan})"] = us(lambda: ops.attn_paged_decode(
            q, cache.k_cache, cache.v_cache, cache.kv_indptr, cache.kv_indices, cache.kv_lens))
        res[f"ops contig (plan s={plan})"] = us(lambda: ops.attn_decode(q, k, v))
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        for name, be in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            def peer(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            try:
                res[name] = us(peer)
            except Exception as exc:  # noqa: BLE001
                print(name, "failed:", exc)
        cudnn = res.get("sdpa cudnn")
        for impl, t in res.items():
            rows.append({"batch": B, "impl": impl, "us": t, "tbs": kv_bytes / t * 1e-6,
                         "x_cudnn": (cudnn / t) if cudnn else None})
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (kv 4096, GQA 32/8, d128, bf16)")
    for r in rows:
        x = f"{r['x_cudnn']:.3f}" if r["x_cudnn"] else "-"
        print(f"B={r['batch']:<3} {r['impl']:<34} {r['us']:8.2f} us {r['tbs']:6.2f} TB/s  x cuDNN {x}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
