"""The same requests through transformers, for ``astrai generate --compare hf`` and the benchmarks.

``hf_generate``: ``model.generate`` (greedy, left-padded batches of ``batch_size``); its TTFT
is the time of a one-token ``generate`` of the batch (the prefill), its decode rate the
other new tokens over the rest of the time. ``hf_generate_batch``: transformers' continuous
batching (``generate_batch``), where the installed version has it and the device runs it.

A run is ``skipped`` where it cannot run here (said before it starts) and ``failed`` where it
started and did not deliver: it raised, a request came back with an error, or requests or
tokens are missing. Neither has figures: their timings stay None, so no ratio is made of them.
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
    failed: str | None = None

    @property
    def ran(self) -> bool:
        return self.skipped is None and self.failed is None

    @property
    def status(self) -> str:
        return "ran" if self.ran else "skipped" if self.skipped is not None else "failed"

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def fail(self, reason: str) -> HFRun:
        """Mark the run failed: its partial figures are dropped."""
        self.failed = reason
        self.tokens, self.total_s, self.ttft_s, self.decode_tokens_per_s = [], 0.0, None, None
        return self

    def summary(self) -> dict:
        ran = self.ran
        return {"name": self.name, "status": self.status, "total_s": self.total_s if ran else None,
                "ttft_s": self.ttft_s, "new_tokens": self.new_tokens, "decode_tokens_per_s": self.decode_tokens_per_s,
                "tokens_per_s": self.new_tokens / self.total_s if ran and self.total_s else None,
                "skipped": self.skipped, "failed": self.failed}


def _checked(run: HFRun, expected: int) -> HFRun:
    """``run`` failed unless it returned tokens for each of ``expected`` requests."""
    if run.failed or run.skipped:
        return run
    if len(run.tokens) != expected:
        return run.fail(f"returned {len(run.tokens)} of {expected} requests")
    empty = sum(not t for t in run.tokens)
    if empty:
        return run.fail(f"{empty} of {expected} requests came back without tokens")
    return run


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


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 64) -> HFRun:
    """Greedy ``model.generate`` over left-padded batches of ``batch_size`` prompts; ``failed``
    says why when it raises or returns too little."""
    run = HFRun("hf generate (sdpa)")
    try:
        _generate(model, prompts, max_new_tokens, batch_size, run)
    except Exception as exc:  # a peer's failure is reported, not fatal to the comparison
        return run.fail(f"generate failed: {type(exc).__name__}: {exc}")
    return _checked(run, len(prompts))


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], max_new_tokens: int, batch_size: int, run: HFRun) -> None:
    device = next(model.parameters()).device
    eos = _eos(model)
    pad = min(eos, default=0)
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
        return run.fail(f"generate_batch failed: {type(exc).__name__}: {exc}")
    _sync(device)
    run.total_s = time.perf_counter() - t0
    results = list(out.values())
    # a request that fails inside generate_batch comes back with its error and no tokens, not as an exception
    errors = [str(r.error) for r in results if getattr(r, "error", None)]
    if errors:
        return run.fail(f"generate_batch: {len(errors)} of {len(results)} requests failed: {errors[0]}")
    run.tokens = [list(r.generated_tokens) for r in results]
    return _checked(run, len(prompts))


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
