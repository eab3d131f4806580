"""``astrai generate``: the serving engine end to end on a preset or a local checkpoint.

Random prompts (lengths drawn between ``--prompt-len MIN MAX``) go through
:class:`astrai.serve.LLM`; the table gives TTFT, prefill and decode tokens/s and the GPU
memory used, and the decode step is set beside its HBM floor (:mod:`astrai.serve.hbm`).
``--checkpoint DIR`` loads a local transformers folder straight into the engine
(:mod:`astrai.serve.checkpoint`); ``--kv-cache-dtype fp8_e4m3`` (or ``fp8_e5m2``) stores
the KV cache in FP8. ``--compare hf`` runs the same weights and prompts through
transformers (``generate`` with sdpa, and ``generate_batch`` where it runs) and prints the
ratios of the peers that ran (a peer that fails is shown failed, with its error), and the
accuracy: the teacher-forced error of the logits against a float32 reference, the engine's
beside transformers' in the same dtype (:mod:`astrai.serve.accuracy`). ``--accuracy`` sets the
precision modes side by side on the same weights (16-bit, FP8 weights, FP8 linears, FP8 KV):
each one's error against float32, as a multiple of the model dtype's, and its top-1 agreement.
Without a CUDA device everything runs on the CPU through AstrAI's torch fallbacks.
"""

from __future__ import annotations

import json
import os
import random

import torch
from rich.console import Console

from ..extension import explain
from ..extension.runtime import current_runtime
from .checks import UsageError, check_environment, plugin_names, require, writable
from .generate_report import count, print_report

# --kv-cache-dtype's names: auto is the model's dtype
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

ACCURACY_REQUESTS = 4  # the first requests, teacher-forced through the float32 reference
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="random-weight model: tiny (default without a GPU) or llama3-8b")
    src.add_argument("--checkpoint", metavar="DIR", help="a local transformers Llama/Mistral/Qwen2 folder")
    parser.add_argument("--layers", type=int, help="layers of the preset (llama3-8b: default 8 here)")
    parser.add_argument("--requests", type=int, help="number of requests (default 64 on a GPU, 8 on the CPU)")
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="prompt length range")
    parser.add_argument("--max-new-tokens", type=int, help="new tokens per request (default 256 GPU / 32 CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16 on a GPU, float32 on the CPU")
    fp8 = parser.add_mutually_exclusive_group()
    fp8.add_argument("--fp8", action="store_true", help="FP8 linears in the decoder layers")
    fp8.add_argument("--fp8-weights", action="store_true",
                     help="FP8 weight copies of the decoder layers' linears, 16-bit activations")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="the KV cache's storage: auto (the model's dtype) or FP8 with per-layer scales")
    parser.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    parser.add_argument("--compare", choices=["hf"], help="also run the same weights in transformers")
    parser.add_argument("--accuracy", action="store_true",
                        help="also the teacher-forced error of each precision mode (16-bit, FP8 weights, FP8 linears, "
                             "FP8 KV) against float32, side by side (needs transformers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of decode tokens/s and TTFT (astrai[plot])")


def _check(args) -> None:
    """Everything ``astrai generate`` can check before it builds a model."""
    for name in ("layers", "requests", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.prompt_len and not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise UsageError(f"--prompt-len needs 1 <= MIN <= MAX, got {' '.join(map(str, args.prompt_len))}")
    check_environment(plugin_names(current_runtime().registry))
    if args.preset is not None:
        from ..serve.config import PRESETS, preset

        try:
            preset(args.preset, args.layers)
        except ValueError:
            raise UsageError(f"--preset {args.preset!r} is unknown: valid presets are {', '.join(PRESETS)} "
                             "(llama3-8b-<N>l: N layers)") from None
    if args.checkpoint is not None:
        if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
            what = "has no config.json" if os.path.isdir(args.checkpoint) else "is not a folder"
            raise UsageError(f"--checkpoint {args.checkpoint}: {what} (a local transformers model folder)")
        if args.layers is not None:
            raise UsageError("--layers sets a preset's layers: a checkpoint keeps its own")
        require("transformers", "transformers", "--checkpoint")  # reads config.json and the rotary tables
        from ..serve.checkpoint import CheckpointError, read_config, weight_files

        try:  # the config and the weight files, before any tensor is read
            read_config(args.checkpoint)
            weight_files(args.checkpoint)
        except CheckpointError as exc:
            raise UsageError(f"--checkpoint: {exc}") from None
    if args.compare == "hf":
        require("transformers", "transformers", "--compare hf")
    if args.accuracy:
        require("transformers", "transformers", "--accuracy")
    writable(args.json, "--json")
    writable(args.plot, "--plot")
    if args.plot:
        require("matplotlib", "plot", "--plot")


def _build(args, device: torch.device, dtype: torch.dtype):
    from ..serve import LLM

    options = dict(cuda_graphs=not args.no_graphs, fp8=args.fp8, fp8_weights=args.fp8_weights,
                   kv_cache_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    if args.checkpoint:  # tensor by tensor into the engine's model: no transformers model is built
        return LLM.from_pretrained(args.checkpoint, dtype=dtype, device=device, **options)
    name = args.preset or ("llama3-8b" if device.type == "cuda" else "tiny")
    layers = args.layers or (8 if name == "llama3-8b" else None)
    return LLM.from_preset(name, num_layers=layers, dtype=dtype, device=device, seed=args.seed, **options)


def _peer_model(args, llm, dtype: torch.dtype):
    """transformers' model of the same weights: the checkpoint's own, or the engine's copied
    (a preset's original 16-bit weights, rebuilt from its seed where the engine freed them)."""
    if args.checkpoint:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, local_files_only=True,
                                                    attn_implementation="sdpa").to(llm.model.device).eval()
    if llm.model.linears_released:  # --fp8-weights: the peer, and the accuracy, see what FP8 changed
        from ..serve import LLM

        return LLM(_sixteen_bit_model(args, llm, dtype), cuda_graphs=False).to_transformers("sdpa")
    return llm.to_transformers("sdpa")


def _sixteen_bit_model(args, llm, dtype: torch.dtype):
    """The engine's model with its 16-bit weights: its own, or rebuilt where ``--fp8-weights`` freed them."""
    if not llm.model.linears_released:
        return llm.model
    from ..serve import LLM
    from ..serve.model import DecoderModel

    if args.checkpoint:
        return LLM.from_pretrained(args.checkpoint, dtype=dtype, device=llm.model.device, cuda_graphs=False).model
    return DecoderModel.random(llm.config, dtype=dtype, device=llm.model.device, seed=args.seed)


def _precision_accuracy(args, llm, prompts, new, dtype: torch.dtype) -> dict:
    """Every precision mode over the same 16-bit weights, teacher-forced against their float32 copy."""
    from ..serve import LLM
    from ..serve.accuracy import float32_reference, precision_errors

    try:
        model = _sixteen_bit_model(args, llm, dtype)
        reference = float32_reference(LLM(model, cuda_graphs=False).to_transformers("sdpa"))
        rows = precision_errors(model, reference, prompts, new, cuda_graphs=not args.no_graphs,
                                max_batch_size=llm.max_batch_size)
        return {"requests": len(prompts), "new_tokens": new, "dtype": str(dtype).removeprefix("torch."), "modes": rows}
    except Exception as exc:  # e.g. no memory for the float32 copy: said, and the timings stand
        return {"failed": f"{type(exc).__name__}: {exc}"}


def _attention_backend() -> str:
    chosen = [d.chosen for d in explain("attention") if d.chosen]
    return ", ".join(sorted(set(chosen))) or "none"


def main(args) -> int:
    _check(args)
    from ..serve.hbm import decode_floor

    console = Console()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    if cuda:
        console.print(f"device: {torch.cuda.get_device_name(device)}")
    else:
        console.print("[yellow]No CUDA device: running AstrAI's torch fallbacks on the CPU "
                      "(the CUDA kernels and CUDA graphs need a GPU; figures are not representative).[/]")
    llm = _build(args, device, dtype)
    c = llm.config
    n = args.requests or (64 if cuda else 8)
    lo, hi = args.prompt_len or ((128, 2048) if cuda else (16, 128))
    new = args.max_new_tokens or (256 if cuda else 32)
    if hi + new > c.max_position_embeddings:
        raise UsageError(f"prompts of up to {hi} tokens and {new} new ones pass the model's "
                         f"{c.max_position_embeddings} positions: lower --prompt-len MAX or --max-new-tokens")
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(c.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    console.print(f"model: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads "
                  f"of {c.head_dim}, {count(c.num_parameters())} parameters, {dtype}"
                  f"{', FP8 linears' if args.fp8 else ''}{', FP8 weights' if args.fp8_weights else ''}"
                  f"{', FP8 KV cache' if llm.kv_cache_dtype else ''}; "
                  f"{n} requests, prompts {lo}-{hi}, {new} new tokens")
    llm.reserve(prompts, new)  # the KV cache and the decode graphs, before the clock starts
    llm.generate(prompts, max_new_tokens=2)  # warm-up: this workload's shapes, kernels, resolver decisions
    if llm.graphs_off_reason:
        console.print(f"[yellow]decode steps run eagerly: {llm.graphs_off_reason}[/]")
    if llm.precision_note:
        console.print(f"[yellow]{llm.precision_note}[/]")
    tokens = llm.generate(prompts, max_new_tokens=new, progress_bar=True)
    stats = llm.last_stats
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    properties = torch.cuda.get_device_properties(device) if cuda else None
    result = {"device": name, "dtype": str(dtype), "fp8": args.fp8, "fp8_weights": args.fp8_weights,
              "cuda_graphs": llm.use_graphs, "weights_bytes": llm.model.weight_bytes(),
              "attention_backend": _attention_backend(), "kv_cache": _kv_cache(llm), "engine": stats.summary(),
              "peers": [], "accuracy": None, "precision_note": llm.precision_note}
    result["engine"]["hbm_floor"] = decode_floor(c, dtype, device=name, fp8=args.fp8 or args.fp8_weights,
                                                 step_ms=stats.decode_step_ms,
                                                 context_tokens_per_step=stats.decode_context_per_step,
                                                 kv_dtype=llm.kv_cache.kv_dtype,
                                                 properties=properties)
    if args.compare == "hf":
        hf = _peer_model(args, llm, dtype)
        result["peers"] = _compare(llm, hf, prompts, new, tokens)
        result["accuracy"] = _accuracy(llm, hf, prompts[:ACCURACY_REQUESTS], new, dtype)
        del hf
    if args.accuracy:
        result["precision_accuracy"] = _precision_accuracy(args, llm, prompts[:ACCURACY_REQUESTS], new, dtype)
    print_report(console, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"wrote {args.json}")
    if args.plot:
        _plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _kv_cache(llm) -> dict:
    cache = llm.kv_cache
    return {"dtype": str(cache.kv_dtype), "bytes": llm.kv_cache_bytes, "pages": cache.num_pages,
            "page_size": cache.page_size}


def _compare(llm, hf, prompts, new, tokens) -> list[dict]:
    from ..serve.compare import agreement, hf_generate, hf_generate_batch

    peers = []
    for run in (hf_generate(hf, prompts, new, batch_size=llm.max_batch_size), hf_generate_batch(hf, prompts, new)):
        entry = run.summary()
        if run.ran:  # kept in the JSON; the accuracy printed is the teacher-forced error
            entry["agreement"] = {k: v for k, v in agreement(tokens, run.tokens).items() if k != "first_divergence"}
        peers.append(entry)
    return peers


def _accuracy(llm, hf, prompts, new, dtype: torch.dtype) -> dict:
    """The teacher-forced logit errors of the engine and of transformers in ``dtype`` against float32."""
    from ..serve.accuracy import float32_reference, logit_errors

    try:
        reference = float32_reference(hf)
        return logit_errors(llm, {f"hf ({str(dtype).removeprefix('torch.')})": hf}, reference, prompts, new)
    except Exception as exc:  # e.g. no memory for the float32 copy: said, and the timings stand
        return {"failed": f"{type(exc).__name__}: {exc}"}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("astrai", result["engine"]["decode_tokens_per_s"], result["engine"]["ttft_mean_s"])]
    runs += [(p["name"], p["decode_tokens_per_s"] or p.get("tokens_per_s") or 0, p["ttft_s"] or 0)
             for p in result["peers"] if p["status"] == "ran"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r[0] for r in runs]
    ax1.barh(names, [r[1] for r in runs])
    ax1.set_xlabel("decode tokens/s")
    ax2.barh(names, [r[2] for r in runs])
    ax2.set_xlabel("TTFT (s)")
    fig.suptitle(f"astrai generate on {result['device']} ({result['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
