"""A paged decode step with its KV append: the decode kernel appending the step's token itself
(``append_last``, one launch) against the append kernel then the decode (``slots``, two
launches in one binding call) and the decode alone (no append), bf16 GQA 32/8 d128, kv 4096,
page 16, batch 1 / 8 / 64, at the split count of decode_plan.

Per variant: the GPU time per call (median of 9 CUDA-graph replays of 20 calls,
``astrai.timing.graph``) and the eager time per call of the plan's launch
(``PagedDecodeLaunch.run_eager``, what the CUDA backend's decode step calls), wall clock over
5 rounds of back-to-back calls (``astrai.timing.eager``): the larger of the host path and the
kernels. Each figure prints as median ±IQR; the JSON keeps each one's timing.

    python bench/bench_decode_append.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # attention_cases
from attention_cases import Paged  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension.abi import tensor_arg  # noqa: E402
from astrai.extension.ops.attention_plan import plan_paged_decode  # noqa: E402


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
            rows.append({"batch": B, "variant": name, "splits": fused.num_splits}
                        | timing.figures(graph_us=timing.graph(fn, calls=20, rounds=9),
                                         eager_us=timing.eager(fn, calls, rounds=5, warmup=50)))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (kv 4096, GQA 32/8, d128, bf16, page 16)")
    print(f"{'B':<4} {'variant':<26} {'splits':>6} {'graph us':>12} {'eager us':>12}")
    for r in rows:
        t = r["timings"]
        print(f"{r['batch']:<4} {r['variant']:<26} {r['splits']:>6} {t['graph_us']:>12} {t['eager_us']:>12}")
    print(timing.legend(t for r in rows for t in r["timings"].values()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=timing.jsonable))


if __name__ == "__main__":
    main()
