"""Continuous batching: which requests run in the next engine step, and how many tokens each.

A step is either a **prefill** step (chunks of prompts, packed, up to ``max_batch_tokens``
tokens) or a **decode** step (one token for every request whose prompt is in the cache).
Prefill goes first, so a request admitted while others decode gets its first token soon;
requests are admitted while there are free slots (``max_batch_size``) and enough free
cache pages for their whole prompt plus ``max_new_tokens`` (reserved on admission, so a
running request never finds the cache full). On a cache that releases the pages left of a
sliding window (``PagedKVCache(window=W)``) a request holds at most the pages of ``W`` keys
and one step's tokens at once, and that is what it reserves.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["Request", "Scheduler", "Step", "requests_of"]


@dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the cache
    first_token_time: float | None = None
    finished: bool = False

    @property
    def seq_len(self) -> int:
        """Tokens in the cache."""
        return self.prefilled + max(len(self.output) - 1, 0)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt)

    def pages_needed(self, page_size: int) -> int:
        """Columns of its page table at its longest: every page it would ever use."""
        return math.ceil((len(self.prompt) + self.max_new_tokens) / page_size)

    def pages_held(self, page_size: int, window: int | None = None, max_step_tokens: int | None = None) -> int:
        """Most pages it holds at once: :meth:`pages_needed`, or on a cache releasing the pages
        left of ``window`` the pages spanning ``window`` keys and one step's new tokens (at most
        ``max_step_tokens`` of its prompt, one when decoding), with one more for misalignment."""
        full = self.pages_needed(page_size)
        if window is None:
            return full
        step = min(len(self.prompt), max_step_tokens or len(self.prompt))
        return min(full, math.ceil((window + step) / page_size) + 1)


@dataclass(frozen=True)
class Step:
    """One engine step: ``requests[b]`` adds ``q_lens[b]`` tokens; ``logits_for`` lists the
    requests whose next token this step produces (indices into ``requests``)."""

    kind: str  # "prefill" or "decode"
    requests: tuple[Request, ...]
    q_lens: tuple[int, ...]
    logits_for: tuple[int, ...]


class Scheduler:
    def __init__(self, requests: list[Request], *, page_size: int, num_pages: int,
                 max_batch_size: int, max_batch_tokens: int, window: int | None = None) -> None:
        self.waiting = deque(requests)
        self.running: list[Request] = []
        self.page_size = page_size
        self.free_pages = num_pages
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.window = window  # the cache's: pages left of it go back to the pool
        for r in requests:
            if self.pages_of(r) > num_pages:
                raise ValueError(
                    f"request {r.rid} needs {self.pages_of(r)} cache pages of {page_size} tokens "
                    f"(prompt {len(r.prompt)} + max_new_tokens {r.max_new_tokens}"
                    f"{f', window {window}' if window is not None else ''}) but the cache has {num_pages}"
                )

    def pages_of(self, request: Request) -> int:
        """The pages ``request`` reserves while it runs (:meth:`Request.pages_held`)."""
        return request.pages_held(self.page_size, self.window, self.max_batch_tokens)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            need = self.pages_of(self.waiting[0])
            if need > self.free_pages:
                break
            self.free_pages -= need
            self.running.append(self.waiting.popleft())

    def next_step(self) -> Step:
        self._admit()
        if not self.running:
            raise RuntimeError("no request can run: the scheduler is done or the cache is too small")
        prefill = [r for r in self.running if r.in_prefill]
        if not prefill:
            return Step("decode", tuple(self.running), (1,) * len(self.running), tuple(range(len(self.running))))
        budget = self.max_batch_tokens
        chosen, q_lens, logits_for = [], [], []
        for r in prefill:
            if budget == 0:
                break
            n = min(len(r.prompt) - r.prefilled, budget)
            budget -= n
            if r.prefilled + n == len(r.prompt):
                logits_for.append(len(chosen))
            chosen.append(r)
            q_lens.append(n)
        return Step("prefill", tuple(chosen), tuple(q_lens), tuple(logits_for))

    def finish(self, request: Request) -> None:
        request.finished = True
        self.running.remove(request)
        self.free_pages += self.pages_of(request)


def requests_of(prompts, max_new_tokens: int, config) -> list[Request]:
    """The requests of a ``generate`` call, after checking its arguments against the model's
    ``config`` (a :class:`~astrai.serve.config.ModelConfig`): each error names the argument."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    limit = config.max_position_embeddings  # sliding layers attend through window_left, past their window too
    requests = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(t, int) for t in p):
            raise ValueError(f"prompts[{i}] must be a non-empty list of ints")
        bad = [t for t in p if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds token ids outside [0, {config.vocab_size}): {bad[:5]}")
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens: with max_new_tokens={max_new_tokens} it "
                             f"passes the model's {limit} positions")
        requests.append(Request(rid=i, prompt=list(p), max_new_tokens=max_new_tokens))
    return requests
