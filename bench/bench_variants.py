"""What the attention variants cost, beside cuDNN in the same run: paged decode (pages
shuffled, page 16) and dense prefill, bf16 GQA 32/8 d128 (--dims: others), plain against a soft-cap of 50,
sinks, ALiBi slopes, and a 4096-token window at kv 32768 (batch 1, and 16 without --quick). Each row has the
CUDA-graph time (median of graph replays, ``astrai.timing.graph``) and the eager per-call time
of the public op;
cuDNN runs on contiguous [B, H, L, D] and on the transposed view of [B, L, H, D] (the
faster is reported), plain causal (it has no soft-cap, sinks or ALiBi; for the window rows it runs
the full context, the work the window saves). Decode rows also time the binding alone, eager
("binding us": the host path below the op wrapper).

    python bench/bench_variants.py [--quick] [--plain] [--only decode|prefill] [--dims 64 128 256]
                                   [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # attention_cases
from attention_cases import Paged, abi, decode_workspace, module, variant_arg  # noqa: E402
from graph_timing import print_rows  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension.abi import stream_handle  # noqa: E402
from astrai.extension.backend.attention.variant import alibi_slopes  # noqa: E402
from astrai.extension.ops import attention as ops  # noqa: E402

HQ, HKV = 32, 8


PLAIN_ONLY = False  # --plain: the plain rows alone (an A/B against a build without variants)


def variants(kv_len: int) -> dict:
    sinks = torch.randn(HQ, device="cuda")
    if PLAIN_ONLY:
        return {"plain": {}}
    # a build before ALiBi (an A/B's older side) has no alibi rows: its binding refuses the slopes
    alibi = "alibi_slopes" in getattr(module("attn_paged_decode"), "VARIANTS", ())
    return {"plain": {}, "softcap 50": dict(logits_soft_cap=50.0), "sinks": dict(sinks=sinks),
            "alibi": dict(alibi_slopes=alibi_slopes(HQ, "cuda")) if alibi else None,
            "window 4096": dict(window_left=4095) if kv_len >= 8192 else None}


def cudnn_us(q, k, v, causal: bool) -> float:
    """cuDNN's best of contiguous [B, H, L, D] and the transposed view of [B, L, H, D]."""
    best = float("inf")
    for layout in ("contiguous", "view"):
        if layout == "contiguous":
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        else:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        try:
            best = min(best, timing.graph(call, calls=10, rounds=9).median_us)
        except Exception as exc:  # a peer that fails is reported as failed
            print(f"cuDNN {layout} failed: {type(exc).__name__}: {exc}")
    return best


def decode_rows(batch: int, kv_len: int, D: int) -> list[dict]:
    cache = Paged([kv_len] * batch, 16, HKV, D, torch.bfloat16, order="shuffled", seed=1)
    q = torch.randn(batch, 1, HQ, D, device="cuda").to(torch.bfloat16)
    mod = module("attn_paged_decode")
    splits, ws_o, ws_lse = decode_workspace(mod, batch, HQ, HKV, D, kv_len)
    k, v = (torch.randn(batch, kv_len, HKV, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    peer = cudnn_us(q, k, v, False)
    rows = []
    for name, kw in variants(kv_len).items():
        if kw is None:
            continue
        out = torch.empty_like(q)
        arg = {} if not kw else {"variant": variant_arg(**kw)}  # a plugin built before variants takes none

        def direct():
            mod.attn_paged_decode(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),
                                  abi(cache.kv_indices), abi(cache.kv_lens), splits, abi(ws_o), abi(ws_lse),
                                  stream_handle(q.device), **arg)

        def public():
            return ops.attn_paged_decode(q, cache.k_cache, cache.v_cache, cache.kv_indptr, cache.kv_indices,
                                         cache.kv_lens, num_splits=splits, **kw)
        graph = timing.graph(direct, calls=20, rounds=9).median_us
        rows.append(dict(kind="paged decode", d=D, shape=f"B={batch} kv={kv_len}", variant=name, graph_us=graph,
                         eager_us=timing.eager(public).median_us, binding_us=timing.eager(direct).median_us,
                         cudnn_us=peer, vs_cudnn=peer / graph))
    return rows


def prefill_rows(seq: int, D: int) -> list[dict]:
    q = torch.randn(1, seq, HQ, D, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(1, seq, HKV, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    peer = cudnn_us(q, k, v, True)
    flops = 4 * seq * seq / 2 * HQ * D
    rows = []
    for name, kw in variants(seq).items():
        if kw is None:
            continue

        def public():
            return ops.attn_prefill(q, k, v, None, True, **kw)
        graph = timing.graph(public, calls=3, rounds=7).median_us
        rows.append(dict(kind="prefill causal", d=D, shape=f"1x{seq}", variant=name, graph_us=graph,
                         eager_us=timing.eager(public, calls=3).median_us, cudnn_us=peer, vs_cudnn=peer / graph,
                         tflops=flops / graph / 1e6))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plain", action="store_true", help="plain attention only (A/B against an older build)")
    ap.add_argument("--only", choices=("decode", "prefill"), help="one kind of row")
    ap.add_argument("--dims", type=int, nargs="+", default=[128], choices=(64, 128, 256), help="head dims")
    ap.add_argument("--json")
    args = ap.parse_args()
    global PLAIN_ONLY
    PLAIN_ONLY = args.plain
    rows = []
    for d in args.dims:
        if args.only != "prefill":
            rows += decode_rows(1, 32768, d) + decode_rows(16, 4096, d) + decode_rows(1, 4096, d)
            # the window at a batch that is bound by bandwidth (at B=1 a 4096-key decode is the latency floor)
            rows += [] if args.quick else decode_rows(16, 32768, d)
        if args.only != "decode":
            rows += prefill_rows(8192, d) + ([] if args.quick else prefill_rows(32768, d))
    print_rows(f"{'kind':16} {'d':>3} {'shape':14} {'variant':12} {'graph us':>9} {'eager us':>9} {'binding us':>10} "
               f"{'cuDNN us':>9} {'cuDNN/ours':>10}",
               rows, lambda r: f"{r['kind']:16} {r['d']:3} {r['shape']:14} {r['variant']:12} {r['graph_us']:9.1f} "
                               f"{r['eager_us']:9.1f} {r.get('binding_us', float('nan')):10.1f} {r['cudnn_us']:9.1f} "
                               f"{r['vs_cudnn']:10.2f}", args.json)


if __name__ == "__main__":
    main()
