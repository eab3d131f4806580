"""How far the engine's logits are from a float32 reference, beside a peer's own distance.

Token agreement says little: with near-ties (random weights, bf16) one flipped token makes every
later position differ, and two runs that are equally accurate agree on a few per cent. Instead,
every model is run teacher-forced on the engine's own tokens (each request's prompt and the
tokens the engine generated) and its logits at the generated positions are compared with
those of a float32 reference of the same weights:

    error = ||logits - reference||_2 / ||reference||_2     (over every position and request)

The engine's logits are its own, from generation (they are teacher-forced on its tokens by
construction); transformers in the engine's dtype is the peer. In float32 the peer is its
own reference (error 0) and the engine's error is the float rounding of a different
summation order.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PRECISION_MODES", "float32_reference", "logit_errors", "precision_errors", "relative_l2",
           "teacher_forced_logits", "top1_agreement"]

# the engine's precision modes, as LLM options: each FP8 mode beside the model's own dtype ("")
# ("fp8_route": every FP8-weight linear the route can take on it, whatever the rows)
PRECISION_MODES = {
    "": {},
    "FP8 weights": {"fp8_weights": True},
    "FP8 weights, weight-only kernel": {"fp8_weights": True, "fp8_route": "weight"},
    "FP8 weights, W8A8": {"fp8_weights": True, "fp8_route": "w8a8"},
    "FP8 linears": {"fp8": True},
    "FP8 KV cache (e4m3)": {"kv_cache_dtype": torch.float8_e4m3fn},
}


def relative_l2(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """``||got - want|| / ||want||`` over all the tensors together, in float64."""
    if len(got) != len(want) or not got:
        raise ValueError(f"need as many tensors on each side, at least one: got {len(got)} and {len(want)}")
    num = den = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            raise ValueError(f"shapes differ: {tuple(g.shape)} and {tuple(w.shape)}")
        w = w.double()
        num += float((g.double() - w).pow(2).sum())
        den += float(w.pow(2).sum())
    return math.sqrt(num / den) if den else math.inf


@torch.inference_mode()
def teacher_forced_logits(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 CPU logits ``[len(tokens), vocab]`` of a transformers model that reads
    ``prompt + tokens`` and predicts each of ``tokens``."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    out = hf_model(input_ids=ids, logits_to_keep=len(tokens))
    return out.logits[0].float().cpu()


def float32_reference(hf_model):
    """A float32 copy of a transformers model on its device (the model itself when already float32)."""
    if next(hf_model.parameters()).dtype == torch.float32:
        return hf_model
    from transformers import AutoModelForCausalLM

    device = next(hf_model.parameters()).device
    with torch.device(device):
        ref = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32,
                                               attn_implementation=hf_model.config._attn_implementation)
    ref.load_state_dict(hf_model.state_dict())  # cast to float32 as they are copied
    return ref.eval()


def logit_errors(llm, peers: dict, reference, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The relative L2 error against ``reference`` of the engine and of each of ``peers``
    (name -> transformers model), teacher-forced on the engine's tokens for ``prompts``.

    A peer that raises is reported with its error (``{"name", "error": None, "failed": "..."}``),
    never as a number; ``is_reference``: the peer is the reference itself (float32), its error 0."""
    tokens, logits = llm.generate(prompts, max_new_tokens=max_new_tokens, return_logits=True)
    want = [teacher_forced_logits(reference, p, t) for p, t in zip(prompts, tokens)]
    result = {"requests": len(prompts), "tokens": sum(len(t) for t in tokens),
              "astrai": relative_l2(logits, want), "peers": []}
    for name, model in peers.items():
        entry = {"name": name, "error": None, "failed": None, "is_reference": model is reference}
        try:
            entry["error"] = relative_l2([teacher_forced_logits(model, p, t) for p, t in zip(prompts, tokens)], want)
        except Exception as exc:  # a peer's failure is shown as such; the engine's figure stands
            entry["failed"] = f"{type(exc).__name__}: {exc}"
        result["peers"].append(entry)
    return result


def top1_agreement(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The share of rows (positions) whose largest logit is the same token on both sides."""
    same = total = 0
    for g, w in zip(got, want):
        same += int((g.float().argmax(dim=-1) == w.float().argmax(dim=-1)).sum())
        total += g.shape[0]
    return same / total if total else math.nan


def precision_errors(model, reference, prompts: list[list[int]], max_new_tokens: int,
                     modes: dict | None = None, **engine_options) -> list[dict]:
    """Each precision mode of the engine over the same ``model`` (16-bit weights): its logits'
    relative L2 error and top-1 agreement against ``reference``, teacher-forced on that mode's
    own tokens, and its error as a multiple of the first mode's (``x_base``: the model's own
    dtype, named after it). A mode that raises is reported with its error (``failed``), never
    as a number. ``routes``: how many FP8-weight linear calls took each route ("weight",
    "w8a8", "torch"; a CUDA graph's counted once, at its capture), so a mode that forces a route
    says where it could not (the CPU has neither kernel)."""
    from ..extension.backend.fp8_weights import decided_routes
    from .engine import LLM

    rows = []
    for name, options in (modes or PRECISION_MODES).items():
        row = {"mode": name or str(model.dtype).removeprefix("torch."), "error": None, "top1": None, "failed": None,
               "routes": {}}
        options = dict(options)
        force = options.pop("fp8_route", None)
        try:
            with decided_routes(force) as routes:
                llm = LLM(model, **engine_options, **options)
                tokens, logits = llm.generate(prompts, max_new_tokens=max_new_tokens, return_logits=True)
            row["routes"] = dict(sorted(routes.items()))
            del llm  # its KV cache, before the next mode's
            want = [teacher_forced_logits(reference, p, t) for p, t in zip(prompts, tokens)]
            row["error"], row["top1"] = relative_l2(logits, want), top1_agreement(logits, want)
        except Exception as exc:  # shown failed; the other modes' figures stand
            row["failed"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    base = rows[0]["error"] if rows and rows[0]["error"] else None
    for row in rows:
        row["x_base"] = row["error"] / base if base and row["error"] is not None else None
    return rows
