"""Where one decode step of the engine spends its GPU time: kernel time per step by kind
(GEMMs, attention, rope + KV append, norms, element-wise and the rest), kernels per step,
and the step's wall time, for a Llama-3-8B-shaped model with random weights and CUDA graphs.

Each batch size runs ``generate`` twice under the torch profiler, with 1 + STEPS and with
1 + 2 * STEPS new tokens over the same prompts; the difference of the two is STEPS decode
steps, so the prefill drops out (a one-token run schedules its prefill differently).

    PYTHONPATH=packages/astrai/src python3 bench/profile/profile_decode_step.py [--layers 8]
        [--batch-sizes 1,64] [--context 1024] [--kv-cache-dtype fp8_e4m3] [--fp8 | --fp8-weights] [--sites]

``--sites``: one more eager decode (CUDA graphs off) profiled with Python stacks, listing for
each small kernel (element-wise and other) the source line of the engine that launched it.
"""

from __future__ import annotations

import argparse
import random
import re
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from astrai.cli.generate import KV_CACHE_DTYPES
from astrai.serve import LLM

STEPS = 32
# kind of a kernel by its name, first match wins
KINDS = [
    ("attention", re.compile(r"decode_mma|decode_combine|decode_scalar|prefill|flash|fmha|attn", re.I)),
    ("rope + append", re.compile(r"rope|rotary|kv_append", re.I)),
    ("GEMM", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|scaled_mm", re.I)),
    ("norm", re.compile(r"rms|norm", re.I)),
    ("element-wise", re.compile(r"elementwise|vectorized|unrolled|reduce|copy|cat|index|fill", re.I)),
]


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def kernel_times(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[Counter, Counter, Counter, float]:
    """Of one generate call: microseconds and kernel count per kind, microseconds per kernel
    name, and the decode step's wall ms."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, max_new_tokens=new_tokens)
        torch.cuda.synchronize()
    us, count, by_name = Counter(), Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kind_of(e.name)
            us[k] += e.device_time
            count[k] += 1
            by_name[e.name[:90]] += e.device_time
            by_name["#" + e.name[:90]] += 1
    return us, count, by_name, llm.last_stats.decode_step_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto")
    linears = ap.add_mutually_exclusive_group()
    linears.add_argument("--fp8", action="store_true", help="FP8 linears")
    linears.add_argument("--fp8-weights", action="store_true", help="decoder linears as FP8 weight copies")
    ap.add_argument("--top", type=int, default=12, help="the longest kernels per step to list")
    ap.add_argument("--sites", action="store_true", help="where each small kernel is launched from (an eager run)")
    a = ap.parse_args()
    rng = random.Random(0)
    llm = LLM.from_preset("llama3-8b", num_layers=a.layers, dtype=torch.bfloat16, device="cuda", seed=0,
                          max_batch_size=64, fp8=a.fp8, fp8_weights=a.fp8_weights,
                          kv_cache_dtype=KV_CACHE_DTYPES[a.kv_cache_dtype])
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    llm.reserve([[0] * a.context] * max(sizes), 2 * STEPS + 2)
    print(f"decode step, {a.layers} layers of Llama-3-8B shape, context {a.context}, "
          f"KV {a.kv_cache_dtype}, linears {'fp8' if a.fp8 else 'fp8 weights' if a.fp8_weights else 'bf16'}: GPU us per step by kind (kernels per step)")
    for b in sizes:
        prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(a.context)] for _ in range(b)]
        llm.generate(prompts, max_new_tokens=STEPS + 1)  # graphs captured, kernels loaded
        us0, n0, names0, _ = kernel_times(llm, prompts, 1 + STEPS)
        us1, n1, names1, step_ms = kernel_times(llm, prompts, 1 + 2 * STEPS)
        kinds = [k for k, _ in KINDS] + ["other"]
        per = {k: (us1[k] - us0[k]) / STEPS for k in kinds}
        counts = {k: (n1[k] - n0[k]) / STEPS for k in kinds}
        total = sum(per.values())
        cells = "  ".join(f"{k} {per[k]:7.1f} ({counts[k]:.0f})" for k in kinds)
        print(f"B={b:<3d} step {step_ms * 1e3:8.1f} us, kernels {total:8.1f} us "
              f"({sum(counts.values()):.0f}), gaps {step_ms * 1e3 - total:7.1f} us | {cells}")
        names1.subtract(names0)
        times = Counter({n: t for n, t in names1.items() if not n.startswith("#")})
        for name, t in times.most_common(a.top):
            print(f"    {t / STEPS:8.1f} us/step  {kind_of(name):13s} {name}")
        print("    the small kernels (element-wise and other), per step: us (launches)")
        for name, t in times.most_common():
            if kind_of(name) in ("element-wise", "other") and names1["#" + name] > 0:
                print(f"    {t / STEPS:8.1f} us ({names1['#' + name] / STEPS:4.1f})  {name}")

    if a.sites:
        launch_sites(llm, a.context)


def launch_sites(graphed: LLM, context: int) -> None:
    """The astrai source lines whose torch calls launch the small kernels of eager decode steps."""
    llm = LLM(graphed.model, cuda_graphs=False, max_batch_size=1, fused_rope=graphed.fused_rope,
              kv_cache_dtype=graphed.kv_cache_dtype)
    prompts = [[1] * context]
    llm.generate(prompts, max_new_tokens=3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        llm.generate(prompts, max_new_tokens=1 + STEPS)
        torch.cuda.synchronize()
    sites = Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.kernels:
            continue
        line = next((f for f in e.stack if "astrai" in f and "profile_decode_step" not in f), "?")
        for k in e.kernels:
            if kind_of(k.name) in ("element-wise", "other"):
                sites[(line.split("astrai/")[-1], e.name, k.name[:60])] += 1
    if not sites:
        print("no kernel was linked to a launching op (this torch's profiler keeps them apart)")
        return
    print("small kernels of eager decode steps by launch site (launches per step, the prefill's included):")
    for (line, op, kernel), n in sites.most_common(40):
        print(f"    {n / STEPS:5.1f}  {line:48s} {op:28s} {kernel}")


if __name__ == "__main__":
    main()
