"""The same requests through transformers, for ``astrai generate --compare hf`` and the benchmarks.

``hf_generate``: ``model.generate`` (greedy, left-padded batches of ``batch_size``); its TTFT
is the time of a one-token ``generate`` of the batch (the prefill), its decode rate the
other new tokens over the rest of the time. ``hf_generate_batch``: transformers' continuous
batching (``generate_batch``), where the installed version has it and the device runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

__all__ = ["HFRun", "agreement", "hf_generate", "hf_generate_batch"]


@dataclass
class HFRun:
    name: str
    tokens: list[list[int]] = field(default_factory=list)
    total_s: float = 0.0
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    skipped: str | None = None

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def summary(self) -> dict:
        return {"name": self.name, "total_s": self.total_s, "ttft_s": self.ttft_s, "new_tokens": self.new_tokens,
                "decode_tokens_per_s": self.decode_tokens_per_s,
                "tokens_per_s": self.new_tokens / self.total_s if self.total_s else None, "skipped": self.skipped}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {eos}


def _strip(new: list[int], eos: set[int]) -> list[int]:
    """generate()'s row of new tokens up to and including the first EOS."""
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1]
    return new


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 64) -> HFRun:
    """Greedy ``model.generate`` over left-padded batches of ``batch_size`` prompts."""
    device = next(model.parameters()).device
    eos = _eos(model)
    pad = min(eos, default=0)
    run = HFRun("hf generate (sdpa)")
    ttft = prefill_time = 0.0
    warm = torch.tensor([prompts[0][-8:]], device=device)  # kernels and handles load before the clock starts
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, pad_token_id=pad)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        args = dict(attention_mask=mask, do_sample=False, pad_token_id=pad)
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **args)
        _sync(device)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, **args)
        _sync(device)
        t2 = time.perf_counter()
        ttft = ttft or (t1 - t0)  # the first batch's requests see their first token after its prefill
        prefill_time += t1 - t0
        run.total_s += t2 - t1
        run.tokens += [_strip(row[width:].tolist(), eos) for row in out]
    decode = run.new_tokens - len(prompts)
    run.ttft_s = ttft
    run.decode_tokens_per_s = decode / (run.total_s - prefill_time) if run.total_s > prefill_time else None
    return run


@torch.inference_mode()
def hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> HFRun:
    """transformers' continuous batching; ``skipped`` says why when it cannot run here."""
    run = HFRun("hf generate_batch")
    device = next(model.parameters()).device
    if not hasattr(model, "generate_batch"):
        run.skipped = "this transformers has no generate_batch"
        return run
    if device.type != "cuda":
        run.skipped = "generate_batch sizes its cache from GPU memory: CUDA only"
        return run
    from transformers import GenerationConfig

    eos = _eos(model)
    pad = min(eos, default=0)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos) or None,
                              pad_token_id=pad)
    try:
        model.generate_batch(prompts[:2], generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=False, eos_token_id=sorted(eos) or None, pad_token_id=pad), progress_bar=False)
        _sync(device)
        t0 = time.perf_counter()  # its own start-up (cache sizing, graph warm-up) is timed: it runs per call
        out = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    except Exception as exc:  # a peer's failure is reported, not fatal to the comparison
        run.skipped = f"generate_batch failed: {type(exc).__name__}: {exc}"
        return run
    _sync(device)
    run.total_s = time.perf_counter() - t0
    results = list(out.values())
    if len(results) != len(prompts):
        run.skipped = f"generate_batch returned {len(results)} of {len(prompts)} requests"
        return run
    run.tokens = [list(r.generated_tokens) for r in results]
    return run


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Position-wise token agreement of two runs, and how many requests match exactly."""
    same = total = exact = 0
    first_divergence = []
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        matches = [i < len(x) and i < len(y) and x[i] == y[i] for i in range(n)]
        same += sum(matches)
        total += n
        exact += all(matches)
        first_divergence.append(next((i for i, m in enumerate(matches) if not m), None))
    return {"token_agreement": same / total if total else 1.0, "exact_requests": exact, "requests": len(a),
            "first_divergence": first_divergence}
