"""Prefill benchmark: the astrai-attention prefill (contiguous K/V, and a paged cache with its
pages in order as a fresh cache hands them out, shuffled, and shuffled but gathered in order by a
copy first, timed with it, as the CUDA backend runs a long step) side by side with cuDNN and
FlashAttention-2 through torch SDPA, in one run, for head dims 64 / 128 / 256, causal and
not, at 4x4096, 1x16384, 16x1024 and a ragged batch of 64 requests of 128-1024 tokens (GQA
32/8 unless ``--heads`` says otherwise, bf16). Each peer gets its best case: SDPA is timed on contiguous
``[B, H, L, D]`` inputs and on the transposed view of ``[B, L, H, D]``, and the faster is
reported; "torch path" is what ``attention()`` runs without the plugin (SDPA's own choice
of kernel), "attention()" what it resolves to with it; these two are also timed as eager
calls (the "eager us" column: what a user sees per call). The ragged batch runs FA2's varlen
kernel (SDPA has no varlen entry for cuDNN). Times are medians of CUDA-graph replays;
TFLOP/s count the causal mask's half.

    python bench/bench_prefill.py [--json out.json] [--quick] [--dims 128] [--heads 32/32]
                                      [--write-table t.json]

``--write-table`` turns the run into the plugin's measured preference table for dense prefill
(``astrai_attention.prefill_table``), stamped with the commit ($ASTRAI_COMMIT or git's) and
the query / kv heads it measured (the table covers calls that pack heads as those did).
``--heads 32/32`` measures multi-head attention (one query head per K/V head).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # attention_cases
from attention_cases import Paged, ragged_plan  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension import ATTN_BACKEND, attention, attn_backend  # noqa: E402
from astrai.extension.backend.attention.ordered_pages import gather_pages, gathered_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DT = torch.bfloat16


# The paged cache's pages as a fresh PagedKVCache hands them out (in order: a tile over 8
# consecutive pages is one TMA box per panel), and shuffled (every page a box of its own).
PAGE_ORDERS = {"astrai paged p16": "in_order", "astrai paged p16 shuf": "shuffled"}


def time_us(fn) -> float | str:
    try:
        return timing.graph(fn, calls=5, rounds=7).median_us
    except Exception as exc:  # a backend that does not take this shape
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"


def best(*times):
    ok = [t for t in times if isinstance(t, float)]
    return min(ok) if ok else times[0]


def sdpa_best(backend, q, k, v, causal):
    """SDPA on contiguous [B, H, L, D] and on the transposed [B, L, H, D] view: the faster."""
    def call(qq, kk, vv):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=True)

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qc, kc, vc = (x.contiguous() for x in (qt, kt, vt))
    return best(time_us(lambda: call(qc, kc, vc)), time_us(lambda: call(qt, kt, vt)))


def torch_path(q, k, v, causal):
    with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
        return attention(q, k, v, is_causal=causal)


def fa2_varlen(q, k, v, cu, max_len, causal):
    """FlashAttention-2's varlen kernel on packed [total, H, D] tensors."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False)


def gathered_prefill(ops, q, cache, table, causal):
    """The paged prefill over ``cache``'s pages copied into consecutive ones first (the copy timed
    with it: backend/attention/ordered_pages.py)."""
    source, indptr, indices = gathered_table(cache.kv_indptr, cache.kv_indices, cache.kv_lens,
                                             tuple(cache.kv_lens_host), cache.page)
    k, v = cache.k_cache[source], cache.v_cache[source]
    qo, tb, ti = table

    def call():
        gather_pages(cache.k_cache, cache.v_cache, source, k, v)
        return ops.attn_paged_prefill(q, k, v, qo, indptr, indices, cache.kv_lens, tb, ti, causal)

    return call


def flops(lens, d, causal, hq) -> float:
    return sum(4.0 * hq * d * n * ((n + 1) / 2 if causal else n) for n in lens)


def bench_shape(rows, name, lens, d, causal, ops, heads):
    hq, hkv = heads
    total = sum(lens)
    q = torch.randn(total, hq, d, device="cuda", dtype=DT)
    qo, tb, ti = ragged_plan(lens)
    res = {}
    for impl, order in PAGE_ORDERS.items():
        cache = Paged(lens, 16, hkv, d, DT, spare_pages=0, order=order)
        res[impl] = time_us(lambda: ops.attn_paged_prefill(
            q, cache.k_cache, cache.v_cache, qo, cache.kv_indptr, cache.kv_indices, cache.kv_lens, tb, ti, causal))
        if order == "shuffled":  # what the CUDA backend runs for a long step: the pages gathered in order first
            res[f"{impl} gathered"] = time_us(gathered_prefill(ops, q, cache, (qo, tb, ti), causal))
        del cache
    uniform = len(set(lens)) == 1
    eager = {}  # impl -> eager us per call, for the calls users make
    if uniform:
        b, n = len(lens), lens[0]
        qd = q.view(b, n, hq, d)
        k = torch.randn(b, n, hkv, d, device="cuda", dtype=DT)
        v = torch.randn(b, n, hkv, d, device="cuda", dtype=DT)
        res["astrai contiguous"] = time_us(lambda: ops.attn_prefill(qd, k, v, is_causal=causal))
        res["sdpa cudnn"] = sdpa_best(SDPBackend.CUDNN_ATTENTION, qd, k, v, causal)
        res["sdpa flash"] = sdpa_best(SDPBackend.FLASH_ATTENTION, qd, k, v, causal)
        # What attention() runs without the plugin (the torch backend: SDPA's own choice), and
        # what it resolves to with it.
        res["torch path"] = time_us(lambda: torch_path(qd, k, v, causal))
        res["attention()"] = time_us(lambda: attention(qd, k, v, is_causal=causal))
        # what a user sees per eager call, ours beside the torch path's
        eager = {"torch path": timing.eager(lambda: torch_path(qd, k, v, causal)).median_us,
                 "attention()": timing.eager(lambda: attention(qd, k, v, is_causal=causal)).median_us}
    else:
        k = torch.randn(total, hkv, d, device="cuda", dtype=DT)
        v = torch.randn(total, hkv, d, device="cuda", dtype=DT)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        res["flash varlen"] = time_us(lambda: fa2_varlen(q, k, v, cu, max(lens), causal))
    work = flops(lens, d, causal, hq)
    for impl, t in res.items():
        row = {"shape": name, "d": d, "causal": causal, "impl": impl}
        if isinstance(t, float):
            row.update(us=t, tflops=work / t * 1e-6)
            if impl in eager:
                row["eager_us"] = eager[impl]
        else:
            row["error"] = t
        rows.append(row)


def add_ratios(rows):
    for row in rows:
        same = {r["impl"]: r for r in rows
                if (r["shape"], r["d"], r["causal"]) == (row["shape"], row["d"], row["causal"]) and "us" in r}
        for peer, key in (("sdpa cudnn", "x_cudnn"), ("sdpa flash", "x_flash"), ("flash varlen", "x_flash"),
                          ("torch path", "x_torch_path")):
            if "us" in row and peer in same:
                row[key] = same[peer]["us"] / row["us"]
        if row["impl"] in PAGE_ORDERS and "astrai contiguous" in same and "us" in row:
            row["paged_vs_contiguous"] = same["astrai contiguous"]["us"] / row["us"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="d128 and the ragged batch only")
    ap.add_argument("--dims", type=int, nargs="*", default=None)
    ap.add_argument("--heads", default="32/8", help="query / kv heads, e.g. 32/32 for multi-head attention")
    ap.add_argument("--write-table", type=Path, help="write the dense-prefill preference table here")
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split("/"))
    if len(heads) != 2 or heads[0] % heads[1]:
        ap.error(f"--heads must be Q/KV with KV dividing Q, got {args.heads!r}")
    torch.manual_seed(0)
    from astrai.extension.ops import attention as ops

    rng = random.Random(0)
    ragged = [rng.randint(128, 1024) for _ in range(64)]
    shapes = {"4x4096": [4096] * 4, "1x16384": [16384], "16x1024": [1024] * 16, "ragged 64x128-1024": ragged}
    dims = args.dims or ([128] if args.quick else [64, 128, 256])
    rows: list[dict] = []
    for d in dims:
        for causal in (True, False):
            for name, lens in shapes.items():
                bench_shape(rows, name, lens, d, causal, ops, heads)
                torch.cuda.empty_cache()
    add_ratios(rows)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  heads {heads[0]}/{heads[1]} bf16, "
          "CUDA-graph medians;"
          " eager us: back-to-back eager calls, what a user sees")
    print(f"{'d':>3} {'mask':<6} {'shape':<19} {'impl':<22} {'us':>9} {'TFLOP/s':>8} {'x cuDNN':>8} {'x FA2':>6}"
          f" {'x torch':>7} {'paged/contig':>12} {'eager us':>9}")
    for r in rows:
        head = f"{r['d']:>3} {'causal' if r['causal'] else 'full':<6} {r['shape']:<19} {r['impl']:<22}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        print(f"{head} {r['us']:9.1f} {r['tflops']:8.1f} {r.get('x_cudnn', float('nan')):8.2f} "
              f"{r.get('x_flash', float('nan')):6.2f} {r.get('x_torch_path', float('nan')):7.2f} "
              f"{r.get('paged_vs_contiguous', float('nan')):12.2f} {r.get('eager_us', float('nan')):9.1f}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": list(heads), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.write_table:
        sys.path.insert(0, str(REPO / "packages" / "astrai-attention" / "src"))
        from astrai_attention import prefill_table

        commit = os.environ.get("ASTRAI_COMMIT") or subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        table = prefill_table.from_bench(result, commit=commit or "unknown", date=str(datetime.date.today()))
        args.write_table.write_text(json.dumps(table, indent=1) + "\n")
        print(f"{args.write_table}: {len(table['classes'])} classes")


if __name__ == "__main__":
    main()
