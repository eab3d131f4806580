"""The serving engine's FP8 KV cache: ``LLM``'s ``kv_cache_dtype`` argument checked, and the
calibration of the cache's scales before any decode graph is captured."""

from __future__ import annotations

import torch

from ..extension import PagedKVCache
from ..extension.kv_quant import FP8_KV_DTYPES
from .scheduler import Request, Scheduler

__all__ = ["calibrate_kv_scales", "check_kv_cache_dtype"]

_CALIBRATION_SEQ = "__calibrate__"


def check_kv_cache_dtype(kv_cache_dtype: object, dtype: torch.dtype) -> torch.dtype | None:
    """``LLM``'s ``kv_cache_dtype`` as the cache's ``kv_dtype``: None (pages in the model's
    ``dtype``, which names the same) or one of the FP8 formats."""
    valid = f"None (the model's {dtype}), {', '.join(map(str, FP8_KV_DTYPES))}"
    if kv_cache_dtype is None or kv_cache_dtype == dtype:
        return None
    if not isinstance(kv_cache_dtype, torch.dtype):
        raise TypeError(f"kv_cache_dtype must be one of {valid}, got {type(kv_cache_dtype).__name__} "
                        f"{kv_cache_dtype!r}")
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {valid}, got {kv_cache_dtype}")
    return kv_cache_dtype


def calibrate_kv_scales(llm, cache: PagedKVCache, requests: list[Request]) -> None:
    """Run the workload's first prefill step eagerly on throw-away sequences (released
    after): every layer's first append calibrates its FP8 scales (see ``LLM``'s docstring)."""
    sched = Scheduler(requests, page_size=llm.page_size, num_pages=cache.free_pages,
                      max_batch_size=llm.max_batch_size, max_batch_tokens=llm.max_batch_tokens, window=cache.window)
    step = sched.next_step()  # reads the requests, changes none of them
    ids = [(_CALIBRATION_SEQ, r.rid) for r in step.requests]
    tokens = [t for r, n in zip(step.requests, step.q_lens) for t in r.prompt[:n]]
    positions = [p for n in step.q_lens for p in range(n)]
    for s in ids:
        cache.add_sequence(s)
    try:
        with cache.step(ids, list(step.q_lens)):
            tokens_t, positions_t = llm._to_device(tokens + positions).view(2, -1).unbind(0)
            last = torch.tensor([len(tokens) - 1], device=llm.model.device)
            llm._forward(tokens_t, positions_t, last, cache)  # one logit row: the appends are what counts
    finally:
        for s in ids:
            cache.release(s)
