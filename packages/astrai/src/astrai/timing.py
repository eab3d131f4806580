"""The one timer of astrai's benchmarks: every figure they publish is a :class:`Timing`.

A :class:`Timing` is the median time per call over ``rounds`` rounds of ``calls`` calls, the
interquartile range of the rounds, and the timer that took it; it prints as
``12.3 us (IQR 0.4, 50 rounds x 20 calls, eager)``. The timers:

- :func:`eager`: wall time of ``calls`` back-to-back calls, the GPU synchronised before and
  after each round (``torch.utils.benchmark.Timer``): what a user sees per call, the host's
  work included where it outlasts the kernels';
- :func:`host`: the calling thread's CPU time (the same Timer with ``timer=time.thread_time``):
  the host's cost alone, nothing synchronised, robust to a shared machine;
- :func:`graph`: ``calls`` calls captured into one CUDA graph after a warm-up on a side
  stream (as capture requires), the graph replayed ``rounds`` times between CUDA events: the
  GPU's time without the host's launch gaps;
- :func:`graphs`: several candidates' graphs replayed in turn, round after round, the one
  that goes first rotating, so a drift of the card's clocks or temperature during the run
  reaches every candidate alike (a ratio of two of them is then fair).

All four take the same statistic, ``torch.utils.benchmark.Measurement``'s median and IQR.

    >>> from astrai import timing
    >>> t = timing.eager(lambda: sum(range(100)), calls=100, rounds=5)
    >>> t.rounds, t.timer
    (5, 'eager')
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils import benchmark
from torch.utils.benchmark.utils.common import TaskSpec


@dataclass(frozen=True)
class Timing:
    median_us: float  # per call
    iqr_us: float  # interquartile range of the rounds' per-call times
    rounds: int
    calls: int  # per round
    timer: str  # eager | host | graph | graph, interleaved | eager between events (not capturable)

    @property
    def ms(self) -> float:
        return self.median_us / 1e3

    def __str__(self) -> str:
        return f"{_num(self.median_us)} us (IQR {_num(self.iqr_us)}, {self.how})"

    def __format__(self, spec: str) -> str:
        """``f"{t}"`` is ``str(t)``; with a width (``f"{t:>12}"``), the :meth:`cell`."""
        return str(self) if not spec else format(self.cell(), spec)

    def cell(self) -> str:
        """The table cell ``12.3 ±0.4`` (us, median ±IQR); :func:`legend` says the rest."""
        return f"{_num(self.median_us)} ±{_num(self.iqr_us)}"

    @property
    def how(self) -> str:
        return f"{self.rounds} rounds x {self.calls} call{'s' * (self.calls != 1)}, {self.timer}"

    def to_json(self) -> dict:
        return asdict(self)


def legend(timings) -> str:
    """One line naming each distinct timer and round count among ``timings``, for under a table
    of their figures (medians per call; a cell ``12.3 ±0.4`` adds the rounds' IQR)."""
    hows = dict.fromkeys(t.how for t in timings)
    return "timers (median per call): " + "; ".join(hows)


def figures(**timings: Timing) -> dict:
    """A result row's figures in us (``graph_us=t``: ``{"graph_us": t.median_us}``), with
    every one's :class:`Timing` under ``"timings"`` (what a reader needs to weigh the figure;
    ``json.dump(rows, f, default=timing.jsonable)`` writes them)."""
    return {name: t.median_us for name, t in timings.items()} | {"timings": timings}


def jsonable(obj) -> dict:
    """``json.dump``'s ``default``: a :class:`Timing` as its fields."""
    if isinstance(obj, Timing):
        return obj.to_json()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def eager(fn: Callable[[], object], calls: int = 10, rounds: int = 7, warmup: int = 3) -> Timing:
    """Wall time per call of ``calls`` back-to-back calls of ``fn``, GPU synchronised per round."""
    return _measure(fn, calls, rounds, warmup, None, None, "eager")


def host(fn: Callable[[], object], calls: int = 500, rounds: int = 15, warmup: int = 1,
         setup: Callable[[], object] | None = None) -> Timing:
    """The calling thread's CPU time per call of ``calls`` back-to-back calls of ``fn``; nothing
    waits for the GPU. ``setup`` runs before each round, untimed (say, to keep the GPU busy)."""
    return _measure(fn, calls, rounds, warmup, time.thread_time, setup, "host")


def graph(fn: Callable[[], object], calls: int = 10, rounds: int = 10, warmup: int = 3,
          eager_fallback: bool = False) -> Timing:
    """GPU time per call of ``fn``, ``calls`` calls captured in one CUDA graph and replayed
    ``rounds`` times. With ``eager_fallback``, a function that cannot be captured is timed as
    ``calls`` eager calls between the same events (the timer says so)."""
    _need_cuda("graph")
    try:
        run, timer = _capture(fn, calls, warmup).replay, "graph"
    except Exception:
        if not eager_fallback:
            raise
        torch.cuda.synchronize()

        def run():
            for _ in range(calls):
                fn()

        run()
        timer = "eager between events (not capturable)"
    return _timing([_between_events(run) for _ in range(rounds)], calls, timer)


def graphs(fns: dict[str, Callable[[], object]], calls: int = 10, rounds: int = 15,
           warmup: int = 2) -> dict[str, Timing]:
    """:func:`graph` for each of ``fns`` (name -> function), their graphs replayed in turn."""
    _need_cuda("graphs")
    captured = {name: _capture(fn, calls, warmup) for name, fn in fns.items()}
    names, samples = list(captured), {name: [] for name in captured}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            samples[name].append(_between_events(captured[name].replay))
    return {name: _timing(s, calls, "graph, interleaved") for name, s in samples.items()}


def _measure(fn, calls, rounds, warmup, clock, setup, timer) -> Timing:
    for _ in range(warmup):
        fn()
    clocks = {} if clock is None else {"timer": clock}  # the default synchronises the GPU
    bench = benchmark.Timer("fn()", setup="setup()", num_threads=torch.get_num_threads(),
                            globals={"fn": fn, "setup": setup or (lambda: None)}, **clocks)
    merged = benchmark.Measurement.merge(bench.timeit(calls) for _ in range(rounds))[0]
    return Timing(merged.median * 1e6, merged.iqr * 1e6, rounds, calls, timer)


def _timing(seconds: list[float], calls: int, timer: str) -> Timing:
    """``seconds`` (one a round, for ``calls`` calls) as a Timing, by Measurement's statistic."""
    m = benchmark.Measurement(calls, seconds, TaskSpec(stmt=timer, setup=""))
    return Timing(m.median * 1e6, m.iqr * 1e6, len(seconds), calls, timer)


def _need_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"timing.{name} replays CUDA graphs: it needs a CUDA device, and none is available")


def _capture(fn, calls: int, warmup: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture wants the lazy work done off the capture stream
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def _between_events(run) -> float:
    """Seconds of GPU time ``run()`` takes, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _num(us: float) -> str:
    """Three significant figures, no exponent: 0.305, 7.00, 12.3, 1235."""
    return f"{us:.3g}" if abs(us) < 1 else f"{us:.{max(0, 2 - len(str(int(abs(us)))) + 1)}f}"
