"""A paged decode step with its KV append: the decode kernel appending the step's token itself
(``append_last``, one launch) against the append kernel then the decode (``slots``, two
launches in one binding call) and the decode alone (no append), bf16 GQA 32/8 d128, kv 4096,
page 16, batch 1 / 8 / 64, at the split count of decode_plan.

Per variant: the GPU time per call (median of CUDA-graph replays of 20 calls,
bench/graph_timing.py) and the eager time per call of the plan's launch
(``PagedDecodeLaunch.run_eager``, what the CUDA backend's decode step calls), wall clock over
back-to-back calls: the larger of the host path and the kernels.

    python bench/bench_decode_append.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # attention_cases
from attention_cases import Paged  # noqa: E402
from graph_timing import graph_time_ms  # noqa: E402

from astrai.extension.abi import tensor_arg  # noqa: E402
from astrai.extension.ops.attention_plan import plan_paged_decode  # noqa: E402


def eager_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer eager calls per round")
    args = ap.parse_args()
    calls = 500 if args.quick else 2000
    torch.manual_seed(0)
    Hq, Hkv, D, S, page, dt = 32, 8, 128, 4096, 16, torch.bfloat16
    rows = []
    for B in (1, 8, 64):
        cache = Paged([S] * B, page, Hkv, D, dt, spare_pages=0)
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=dt)
        k_new = torch.randn(B, 1, Hkv, D, device="cuda", dtype=dt)
        v_new = torch.randn(B, 1, Hkv, D, device="cuda", dtype=dt)
        pos = cache.kv_lens.long() - 1
        slots = (cache.kv_indices.long()[cache.kv_indptr.long()[:-1] + pos // page] * page + pos % page).contiguous()
        plan = dict(q_heads=Hq, kv_heads=Hkv, head_dim=D, max_kv_len=S, page_size=page,
                    num_pages=cache.k_cache.shape[0])
        fused = plan_paged_decode(cache.kv_indptr, cache.kv_indices, cache.kv_lens, append_last=True, **plan)
        two = plan_paged_decode(cache.kv_indptr, cache.kv_indices, cache.kv_lens, slots=slots, **plan)
        assert fused.append_last and two.slots is not None, "the module lacks append_last or kv_append"
        cache_args = (tensor_arg(cache.k_cache), tensor_arg(cache.v_cache))
        variants = {
            "append_last (1 launch)": lambda: fused.run_eager(q, cache_args, k_new, v_new),
            "slots (append + decode)": lambda: two.run_eager(q, cache_args, k_new, v_new),
            "decode only": lambda: fused.run_eager(q, cache_args),
        }
        for name, fn in variants.items():
            rows.append({"batch": B, "variant": name, "splits": fused.num_splits,
                         "graph_us": graph_time_ms(fn, calls=20, rounds=9) * 1e3, "eager_us": eager_us(fn, calls)})
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (kv 4096, GQA 32/8, d128, bf16, page 16)")
    print(f"{'B':<4} {'variant':<26} {'splits':>6} {'graph us':>9} {'eager us':>9}")
    for r in rows:
        print(f"{r['batch']:<4} {r['variant']:<26} {r['splits']:>6} {r['graph_us']:>9.2f} {r['eager_us']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
