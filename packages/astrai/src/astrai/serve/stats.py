"""Timings of one ``LLM.generate`` call, and its progress bar."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["GenerationStats", "progress"]


@dataclass
class GenerationStats:
    """Wall-clock seconds of the steps (each timed until its tokens reach the host)."""

    num_requests: int
    prompt_tokens: int
    new_tokens: int = 0
    prefill_steps: int = 0
    prefill_time: float = 0.0
    decode_steps: int = 0
    decode_time: float = 0.0
    decode_tokens: int = 0
    total_time: float = 0.0
    ttft: list[float] = field(default_factory=list)
    gpu_memory_bytes: int | None = None
    decode_batch_sizes: list[int] = field(default_factory=list)
    decode_context_tokens: int = 0  # keys the decode steps attended over, summed over steps and requests

    def add_step(self, kind: str, tokens: int, produced: int, seconds: float, context: int = 0) -> None:
        """One step; ``context``: the keys a decode step attends over, summed over its requests."""
        if kind == "prefill":
            self.prefill_steps += 1
            self.prefill_time += seconds
        else:
            self.decode_steps += 1
            self.decode_time += seconds
            self.decode_tokens += produced
            self.decode_batch_sizes.append(produced)
            self.decode_context_tokens += context

    def add_decode_run(self, steps: int, batch: int, seconds: float, context: int = 0) -> None:
        """Back-to-back decode steps (their tokens were counted as they reached the host);
        ``context``: the keys they attended over, summed over steps and requests."""
        self.decode_steps += steps
        self.decode_context_tokens += context
        self.decode_time += seconds
        self.decode_batch_sizes += [batch] * steps

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def decode_step_ms(self) -> float:
        return 1e3 * self.decode_time / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_context_per_step(self) -> float:
        """Mean keys a decode step attends over (summed over its batch): its KV cache read."""
        return self.decode_context_tokens / self.decode_steps if self.decode_steps else 0.0

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(self.ttft) if self.ttft else 0.0

    @property
    def ttft_max(self) -> float:
        return max(self.ttft) if self.ttft else 0.0

    def summary(self) -> dict:
        """The figures ``astrai generate`` prints and writes as JSON."""
        return {
            "requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "total_s": self.total_time,
            "ttft_mean_s": self.ttft_mean,
            "ttft_max_s": self.ttft_max,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "decode_step_ms": self.decode_step_ms,
            "decode_steps": self.decode_steps,
            "decode_batch_mean": (sum(self.decode_batch_sizes) / len(self.decode_batch_sizes)
                                  if self.decode_batch_sizes else 0.0),
            "decode_context_per_step": self.decode_context_per_step,
            "gpu_memory_bytes": self.gpu_memory_bytes,
        }


@contextlib.contextmanager
def progress(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar over finished requests; yields the function that advances it."""
    if not enabled:
        yield lambda: None
        return
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("generate", total=total)
        yield lambda: bar.advance(task)
