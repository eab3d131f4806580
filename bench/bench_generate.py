"""End-to-end generation on a Llama-3-8B-shaped model (random weights): astrai.serve against
transformers, in one run.

    PYTHONPATH=packages/astrai/src python3 bench/bench_generate.py            # ~3-4 min on an H200
    PYTHONPATH=packages/astrai/src python3 bench/bench_generate.py --quick    # ~1 min
    PYTHONPATH=packages/astrai/src python3 bench/bench_generate.py --kv-cache-dtype fp8_e4m3  # FP8 KV cache

Runs (bf16, ``--layers`` layers of hidden 4096, 32/8 heads of 128, MLP 14336, vocab 128256):
the engine (CUDA-graph decode), the engine with FP8 linears, with FP8 weights only
(``fp8_weights``: per-channel e4m3 copies, 16-bit activations), transformers ``generate``
(sdpa, dynamic cache, left-padded batches) and ``generate_batch`` where it runs, all on the
same ``--requests`` prompts (lengths uniform in ``--prompt-len``) with ``--new-tokens`` each.
``--kv-cache-dtype fp8_e4m3`` (or ``fp8_e5m2``) runs every engine with an FP8 KV cache
(``LLM(kv_cache_dtype=...)``; default ``auto``, the model's bf16).

Reports decode tokens/s, TTFT, and the engine's decode step at batch sizes 1..64 (context
``--context``) against its HBM floor: (weight bytes + KV bytes read per step) over the GPU's
peak bandwidth (``astrai.serve.hbm.memory_bandwidth``, the figure ``astrai generate`` prints against),
with the overlapped decode loop (default) and step by step (``overlap=False``).
Correctness: token agreement with transformers ``generate`` (position by position, and
teacher-forced: transformers' argmax on the engine's own sequence), and the engine's logits
against transformers' on the same sequences (relative L2 per step, ``--logit-requests``
requests). JSON to ``$OUT/bench_generate.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from astrai.cli.generate import KV_CACHE_DTYPES
from astrai.serve import LLM
from astrai.serve.compare import agreement, hf_generate, hf_generate_batch
from astrai.serve.hbm import memory_bandwidth


# the floor astrai generate prints: the device's peak bandwidth (from its memory clock and bus width)
HBM_BYTES_PER_S = (memory_bandwidth(torch.cuda.get_device_name(), torch.cuda.get_device_properties())
                   if torch.cuda.is_available() else None)


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 2048))
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=1024, help="prompt length of the decode-step sweep")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--logit-requests", type=int, default=8, help="requests whose logits are compared")
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--no-fp8-weights", action="store_true", help="skip the engine over FP8 weight copies")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                   help="the engines' KV cache storage (auto: the model's bf16)")
    p.add_argument("--no-fused-rope", action="store_true", help="rotary before attention, not fused with the cache write")
    p.add_argument("--no-serial-sweep", action="store_true", help="skip the decode sweep without overlap")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (and the correctness checks)")
    p.add_argument("--no-generate-batch", action="store_true")
    p.add_argument("--quick", action="store_true", help="16 requests, 64 new tokens, fewer sweep points")
    a = p.parse_args()
    if a.quick:
        a.requests, a.new_tokens, a.batch_sizes, a.logit_requests = 16, 64, "1,16,64", 4
    return a


def _hbm_ms(llm: LLM, batch: int, context: int) -> float:
    """Fewest milliseconds a decode step can take: every weight but the embedding (gathered,
    not read) and every cached key/value of the batch read once from HBM."""
    c = llm.config
    item = llm.model.dtype.itemsize
    h, i = c.hidden_size, c.intermediate_size
    linears = c.num_layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i)
    rest = c.num_parameters() - linears - c.vocab_size * h * (0 if c.tie_word_embeddings else 1)
    weights = linears * (1 if llm.fp8 or llm.fp8_weights else item) + rest * item
    kv = batch * context * c.num_layers * 2 * c.kv_size * (llm.kv_cache_dtype or llm.model.dtype).itemsize
    return float("nan") if HBM_BYTES_PER_S is None else 1e3 * (weights + kv) / HBM_BYTES_PER_S


def _decode_sweep(llm: LLM, sizes: list[int], context: int, rng: random.Random) -> list[dict]:
    rows = []
    llm.reserve([[0] * context] * max(sizes), 33)  # one cache and one set of graphs for the whole sweep
    for b in sizes:
        prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(context)] for _ in range(b)]
        llm.generate(prompts, max_new_tokens=33)
        s = llm.last_stats
        limit = _hbm_ms(llm, b, context + 16)
        rows.append({"batch": b, "decode_step_ms": s.decode_step_ms, "hbm_limit_ms": limit,
                     "x_of_limit": s.decode_step_ms / limit, "decode_tokens_per_s": s.decode_tokens_per_s})
    return rows


@torch.inference_mode()
def _teacher_forced(hf, prompts, tokens, engine_logits) -> dict:
    """transformers on the engine's sequences: argmax agreement, and logits against the engine's."""
    agree = total = 0
    rel = []
    for i, (prompt, new) in enumerate(zip(prompts, tokens)):
        ids = torch.tensor([prompt + new], device="cuda")
        logits = hf(ids, logits_to_keep=len(new) + 1).logits[0, :-1]
        agree += int((logits.argmax(-1).cpu() == torch.tensor(new)).sum())
        total += len(new)
        if i < len(engine_logits):
            got = engine_logits[i].cuda()
            rel.append(((got - logits.float()).norm(dim=-1) / logits.float().norm(dim=-1)).max().item())
    return {"teacher_forced_agreement": agree / total, "logits_rel_l2_max": max(rel) if rel else None,
            "logits_requests": len(rel)}


def main() -> None:
    a = _args()
    torch.manual_seed(0)
    rng = random.Random(0)
    t_start = time.perf_counter()
    llm = LLM.from_preset("llama3-8b", num_layers=a.layers, dtype=torch.bfloat16, device="cuda", seed=0,
                          max_batch_size=64, fused_rope=not a.no_fused_rope,
                          kv_cache_dtype=KV_CACHE_DTYPES[a.kv_cache_dtype])
    c = llm.config
    prompts = [[rng.randrange(c.vocab_size) for _ in range(rng.randint(*a.prompt_len))] for _ in range(a.requests)]
    result = {"device": torch.cuda.get_device_name(), "layers": a.layers, "requests": a.requests,
              "prompt_len": list(a.prompt_len), "new_tokens": a.new_tokens, "context": a.context,
              "kv_cache_dtype": a.kv_cache_dtype, "runs": {}}

    # the cache sized for the main run (the sweep reuses it), graphs captured, kernels loaded
    llm.reserve(prompts, a.new_tokens)
    llm.generate(prompts, max_new_tokens=2)
    tokens = llm.generate(prompts, max_new_tokens=a.new_tokens)
    result["runs"]["astrai bf16"] = llm.last_stats.summary()
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    result["decode_sweep_bf16"] = _decode_sweep(llm, sizes, a.context, rng)
    if not a.no_serial_sweep:  # every step waits for its tokens: what the overlap hides
        serial = LLM(llm.model, overlap=False, max_batch_size=llm.max_batch_size, fused_rope=llm.fused_rope,
                     kv_cache_dtype=llm.kv_cache_dtype)
        result["decode_sweep_bf16_serial"] = _decode_sweep(serial, sizes, a.context, rng)
        serial.kv_cache = serial.graphs = None
        del serial

    for key, option, skip in (("fp8", "fp8", a.no_fp8), ("fp8_weights", "fp8_weights", a.no_fp8_weights)):
        if skip:
            continue
        engine = LLM(llm.model, max_batch_size=llm.max_batch_size, fused_rope=llm.fused_rope,
                     kv_cache_dtype=llm.kv_cache_dtype, **{option: True})
        engine.reserve(prompts, a.new_tokens)
        engine.generate(prompts, max_new_tokens=2)
        engine_tokens = engine.generate(prompts, max_new_tokens=a.new_tokens)
        result["runs"][f"astrai {key.replace('_', ' ')}"] = engine.last_stats.summary()
        result[f"{key}_vs_bf16_agreement"] = {k: v for k, v in agreement(engine_tokens, tokens).items()
                                              if k != "first_divergence"}
        result[f"decode_sweep_{key}"] = _decode_sweep(engine, sizes, a.context, rng)
        engine.kv_cache = engine.graphs = None
        del engine

    if not a.no_hf:
        _, engine_logits = llm.generate(prompts[: a.logit_requests], max_new_tokens=a.new_tokens, return_logits=True)
        llm.kv_cache = llm.graphs = None  # the cache's memory goes to transformers
        torch.cuda.empty_cache()
        hf = llm.to_transformers("sdpa")
        run = hf_generate(hf, prompts, a.new_tokens, batch_size=64)
        result["runs"][run.name] = run.summary()
        result["agreement_vs_hf_generate"] = agreement(tokens, run.tokens)
        result["correctness"] = _teacher_forced(hf, prompts, tokens, engine_logits)
        if not a.no_generate_batch:
            run = hf_generate_batch(hf, prompts, a.new_tokens)
            result["runs"][run.name] = run.summary()
            if not run.skipped:
                result["agreement_vs_hf_generate_batch"] = agreement(tokens, run.tokens)
    result["wall_s"] = time.perf_counter() - t_start
    _print(result)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_generate.json"), "w") as f:
            json.dump(result, f, indent=2)


def _print(r: dict) -> None:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"\n{r['device']}: {r['layers']} layers of Llama-3-8B, {r['requests']} requests, prompts "
          f"{r['prompt_len'][0]}-{r['prompt_len'][1]}, {r['new_tokens']} new tokens, KV cache {r['kv_cache_dtype']} "
          f"(wall {r['wall_s']:.0f} s)")
    print(f"{'run':32} {'TTFT mean s':>11} {'TTFT max s':>10} {'decode tok/s':>12} {'step ms':>8} {'total s':>8}")
    for name, s in r["runs"].items():
        if s.get("skipped"):
            print(f"{name:32} skipped: {s['skipped']}")
            continue
        ttft = s.get("ttft_mean_s", s.get("ttft_s"))
        print(f"{name:32} {f(ttft, '11.3f')} {f(s.get('ttft_max_s'), '10.3f')} "
              f"{f(s.get('decode_tokens_per_s') or s.get('tokens_per_s'), '12,.0f')} "
              f"{f(s.get('decode_step_ms'), '8.2f')} {f(s['total_s'], '8.2f')}")
    for key in ("decode_sweep_bf16", "decode_sweep_bf16_serial", "decode_sweep_fp8", "decode_sweep_fp8_weights"):
        if key in r:
            print(f"\n{key} (context {r['context']}): batch, step ms, HBM limit ms, x of limit")
            for row in r[key]:
                print(f"  {row['batch']:4d} {row['decode_step_ms']:8.3f} {row['hbm_limit_ms']:8.3f} "
                      f"{row['x_of_limit']:6.2f}x")
    hf = r["runs"].get("hf generate (sdpa)")
    bf = r["runs"]["astrai bf16"]
    if hf and hf.get("decode_tokens_per_s"):
        print(f"\nvs transformers generate: decode tokens/s {bf['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.1f}x, "
              f"TTFT mean {bf['ttft_mean_s']:.3f} s vs {hf['ttft_s']:.3f} s (its first batch's prefill)")
    if "agreement_vs_hf_generate" in r:
        ag, co = r["agreement_vs_hf_generate"], r["correctness"]
        print(f"token agreement with transformers generate: {ag['token_agreement']:.1%} position by position "
              f"({ag['exact_requests']}/{ag['requests']} requests identical), "
              f"{co['teacher_forced_agreement']:.1%} teacher-forced; logits rel L2 max "
              f"{f(co['logits_rel_l2_max'], '.4f')} over {co['logits_requests']} requests")
    at64 = [row for row in r.get("decode_sweep_bf16", []) if row["batch"] == 64]
    if at64:
        ok = at64[0]["x_of_limit"] <= 3.0
        print(f"bar: decode step at 64 requests {at64[0]['x_of_limit']:.2f}x its HBM limit (<= 3x: "
              f"{'met' if ok else 'NOT met'}; goal 1.3x)")
    if "fp8_vs_bf16_agreement" in r:
        print(f"FP8 vs bf16 engine tokens: {r['fp8_vs_bf16_agreement']['token_agreement']:.1%}")


if __name__ == "__main__":
    main()
