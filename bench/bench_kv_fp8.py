"""Paged decode over FP8 pages beside the bf16 pages and cuDNN bf16, in one run: GQA 32/8 d128,
page 16 shuffled, bf16 q. Each row has the CUDA-graph time (median of graph replays,
``astrai.timing.graph``) and the eager per-call time of the public op; cuDNN runs bf16 on
contiguous [B, H, L, D] and on the transposed view of [B, L, H, D] (the faster is reported).
"GB/s" is the K/V bytes the call must read over its graph time. ``--prefill`` times the paged
prefill instead (causal, q = kv per request: the Hopper kernel over bf16 pages, the mma.sync
kernel over FP8 pages, and "e4m3 g": e4m3 pages dequantized into consecutive bf16 pages, then the
Hopper kernel, as the CUDA backend runs a long prefill over FP8 pages), with TFLOP/s counting the
causal half, and the eager per-call time of the public op beside the graph time.

    python bench/bench_kv_fp8.py [--quick] [--prefill] [--splits 1,2,3] [--json out.json]

With --splits, the e4m3 rows are repeated at each forced split count (marked *).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # attention_cases
from attention_cases import Paged, abi, module, ragged_plan  # noqa: E402
from bench_variants import cudnn_us  # noqa: E402
from graph_timing import print_rows  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension.abi import stream_handle  # noqa: E402
from astrai.extension.backend.attention.ordered_pages import gather_pages, gathered_table  # noqa: E402
from astrai.extension.kv_quant import calibrated_scale, quantize  # noqa: E402
from astrai.extension.ops import attention as ops  # noqa: E402

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 32768), (1, 4096), (16, 4096), (64, 4096), (128, 2048), (8, 8192)]
PREFILL_SHAPES = [(4, 4096), (16, 1024), (1, 16384), (32, 512), (64, 256), (128, 128)]  # last three: gathering pays?
PAGES = {"bf16": None, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def rows_for(batch: int, kv_len: int, extra_splits: tuple[int, ...] = ()) -> list[dict]:
    cache16 = Paged([kv_len] * batch, 16, HKV, D, torch.bfloat16, order="shuffled", seed=1)
    q = torch.randn(batch, 1, HQ, D, device="cuda").to(torch.bfloat16)
    mod = module("attn_paged_decode")
    k, v = (torch.randn(batch, kv_len, HKV, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    peer = cudnn_us(q, k, v, False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    runs = [(name, kv_dtype, None) for name, kv_dtype in PAGES.items()]
    runs += [("e4m3", torch.float8_e4m3fn, s) for s in extra_splits]
    for name, kv_dtype, forced in runs:
        kv_bytes = 2 if kv_dtype is None else 1
        splits = forced or mod.decode_plan(batch, HKV, HQ // HKV, D, kv_len, sms, kv_bytes=kv_bytes)
        ws_o = torch.empty(splits * batch * HQ * D, dtype=torch.float32, device="cuda")
        ws_lse = torch.empty(splits * batch * HQ, dtype=torch.float32, device="cuda")
        pages, kw, scales = fp8_pages((cache16.k_cache, cache16.v_cache), kv_dtype)
        out = torch.empty_like(q)

        def direct():
            mod.attn_paged_decode(abi(q), abi(pages[0]), abi(pages[1]), abi(out), abi(cache16.kv_indptr),
                                  abi(cache16.kv_indices), abi(cache16.kv_lens), splits, abi(ws_o), abi(ws_lse),
                                  stream_handle(q.device), **kw)

        def public():
            return ops.attn_paged_decode(q, pages[0], pages[1], cache16.kv_indptr, cache16.kv_indices,
                                         cache16.kv_lens, num_splits=splits, **scales)
        graph = timing.graph(direct, calls=20, rounds=9).median_us
        nbytes = 2 * batch * kv_len * HKV * D * pages[0].element_size()
        rows.append(dict(shape=f"B={batch} kv={kv_len}", pages=name, splits=splits, planned=forced is None,
                         graph_us=graph,
                         eager_us=timing.eager(public).median_us, gbps=nbytes / graph / 1e3, cudnn_us=peer,
                         vs_cudnn=peer / graph))
    return rows


def fp8_pages(pages, kv_dtype):
    """(pages, the binding's keyword, the ops' keywords) of 16-bit pages quantized to kv_dtype
    (None: as they are)."""
    if kv_dtype is None:
        return pages, {}, {}
    s = [calibrated_scale(t, "tensor", kv_dtype) for t in pages]
    quantized = tuple(quantize(t, sc, kv_dtype) for t, sc in zip(pages, s))
    return quantized, {"kv_scales": (abi(s[0]), abi(s[1]))}, {"k_scale": s[0], "v_scale": s[1]}


def prefill_rows_for(batch: int, length: int) -> list[dict]:
    cache16 = Paged([length] * batch, 16, HKV, D, torch.bfloat16, order="shuffled", seed=1)
    q = torch.randn(batch * length, HQ, D, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(batch, length, HKV, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    peer = cudnn_us(q.view(batch, length, HQ, D), k, v, True)
    mod = module("attn_paged_prefill")
    qo, tb, ti = ragged_plan([length] * batch, q.device)
    flops = 4 * batch * length * length * HQ * D / 2
    rows = []
    for name, kv_dtype in PAGES.items():
        pages, kw, scales = fp8_pages((cache16.k_cache, cache16.v_cache), kv_dtype)
        out = torch.empty_like(q)

        def direct():
            mod.attn_paged_prefill(abi(q), abi(pages[0]), abi(pages[1]), abi(out), abi(qo), abi(cache16.kv_indptr),
                                   abi(cache16.kv_indices), abi(cache16.kv_lens), abi(tb), abi(ti), True,
                                   stream_handle(q.device), **kw)
        def public():
            return ops.attn_paged_prefill(q, pages[0], pages[1], qo, cache16.kv_indptr, cache16.kv_indices,
                                          cache16.kv_lens, tb, ti, True, **scales)
        graph = timing.graph(direct, calls=5, rounds=7).median_us
        rows.append(dict(shape=f"{batch}x{length}", pages=name, graph_us=graph, eager_us=timing.eager(public).median_us,
                         tflops=flops / graph / 1e6, cudnn_us=peer, vs_cudnn=peer / graph))
    rows.append(gathered_row(batch, length, q, cache16, (qo, tb, ti), flops, peer))
    return rows


def gathered_row(batch, length, q, cache16, table, flops, peer) -> dict:
    """e4m3 pages dequantized into consecutive bf16 pages first, then the 16-bit kernel (what the
    CUDA backend runs for a long prefill over FP8 pages: backend/attention/ordered_pages.py), the
    dequantization inside both timed calls (its eager column: the same calls, not attention())."""
    pages, _, scales = fp8_pages((cache16.k_cache, cache16.v_cache), torch.float8_e4m3fn)
    source, indptr, indices = gathered_table(cache16.kv_indptr, cache16.kv_indices, cache16.kv_lens,
                                            tuple(cache16.kv_lens_host), cache16.page)
    shape = (len(indices), *pages[0].shape[1:])
    k16, v16 = (torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mod, out = module("attn_paged_prefill"), torch.empty_like(q)
    qo, tb, ti = table

    def gathered():
        gather_pages(pages[0], pages[1], source, k16, v16, (scales["k_scale"], scales["v_scale"]))
        mod.attn_paged_prefill(abi(q), abi(k16), abi(v16), abi(out), abi(qo), abi(indptr), abi(indices),
                               abi(cache16.kv_lens), abi(tb), abi(ti), True, stream_handle(q.device))

    graph = timing.graph(gathered, calls=5, rounds=7).median_us
    return dict(shape=f"{batch}x{length}", pages="e4m3 g", graph_us=graph, eager_us=timing.eager(gathered).median_us,
                tflops=flops / graph / 1e6, cudnn_us=peer, vs_cudnn=peer / graph)


def prefill_main(args) -> None:
    shapes = PREFILL_SHAPES[:1] if args.quick else PREFILL_SHAPES
    rows = [r for shape in shapes for r in prefill_rows_for(*shape)]
    print(f"paged prefill, causal, GQA {HQ}/{HKV} d{D}, page 16 shuffled, bf16 q; cuDNN bf16 contiguous")
    print_rows(f"{'shape':10} {'pages':6} {'graph us':>9} {'eager us':>9} {'TFLOP/s':>8} {'cuDNN us':>9} "
               f"{'cuDNN/ours':>10}",
               rows, lambda r: f"{r['shape']:10} {r['pages']:6} {r['graph_us']:9.1f} {r['eager_us']:9.1f} "
                               f"{r['tflops']:8.1f} {r['cudnn_us']:9.1f} {r['vs_cudnn']:10.2f}", args.json)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the issue's two shapes only")
    ap.add_argument("--json")
    ap.add_argument("--prefill", action="store_true", help="the paged prefill instead of the decode")
    ap.add_argument("--splits", default="", help="comma list of split counts to time over e4m3 pages beside "
                    "the plan's choice (a sweep of the decode plan)")
    args = ap.parse_args()
    if args.prefill:
        return prefill_main(args)
    shapes = [(1, 32768), (16, 4096)] if args.quick else SHAPES
    extra = tuple(int(x) for x in args.splits.split(",") if x)
    rows = [r for shape in shapes for r in rows_for(*shape, extra_splits=extra)]
    print_rows(f"{'shape':16} {'pages':6} {'splits':>6} {'graph us':>9} {'eager us':>9} {'GB/s':>7} {'cuDNN us':>9} "
               f"{'cuDNN/ours':>10}",
               rows, lambda r: f"{r['shape']:16} {r['pages']:6} {r['splits']:5d}{' ' if r['planned'] else '*'} "
                               f"{r['graph_us']:9.1f} {r['eager_us']:9.1f} {r['gbps']:7.0f} {r['cudnn_us']:9.1f} "
                               f"{r['vs_cudnn']:10.2f}", args.json)


if __name__ == "__main__":
    main()
