"""The one timer of the GPU benchmarks: median per-call time of a CUDA-graph replay.

``fn`` is warmed up on a side stream (as graph capture requires), ``calls`` calls of it
are captured into one graph, and the graph is replayed ``rounds`` times between events;
replaying many calls per graph takes the launch gaps out of the figure. Beside the timers,
what the benchmarks' command lines and result tables share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def graph_time_ms(fn, calls: int = 10, rounds: int = 10, warmup: int = 3, eager_fallback: bool = False) -> float:
    """Median milliseconds per call of ``fn``. With ``eager_fallback``, a function that
    cannot be captured is timed as ``calls`` eager calls between the same events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except Exception:
        if not eager_fallback:
            raise

        def run():
            for _ in range(calls):
                fn()
    run()
    torch.cuda.synchronize()
    return _median_ms(run, calls, rounds)


def eager_time_ms(fn, calls: int = 10, rounds: int = 7, warmup: int = 3) -> float:
    """Median milliseconds per call of ``calls`` back-to-back eager calls of ``fn``: what a
    user sees per call (the host's work included where it outlasts the kernel's)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def run():
        for _ in range(calls):
            fn()

    return _median_ms(run, calls, rounds)


def _median_ms(run, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of ``run()``'s time between two events, per call."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_times_ms(fns: dict, calls: int = 10, rounds: int = 15, warmup: int = 2) -> dict:
    """Median milliseconds per call of each of ``fns`` (name -> function), their graphs
    replayed in turn round after round, so a drift of the card's clocks or temperature
    during the run reaches every candidate alike (a ratio of two of them is then fair)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs = {}
    for name, fn in fns.items():
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        graphs[name] = graph
    torch.cuda.synchronize()
    times: dict = {name: [] for name in fns}
    names = list(graphs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def sleep_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU (for spin kernels
    that keep the GPU ahead of a host-timed loop)."""
    cycles = 20_000_000
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def linear_shape_args(ap) -> None:
    """--m / --n / --k of the FP8 host diagnostics' linear (the 1024 x 8192 x 8192 step the
    host-path bar is set at)."""
    for name, default in (("--m", 1024), ("--n", 8192), ("--k", 8192)):
        ap.add_argument(name, type=int, default=default)


def quick_json_args(doc: str, name: str) -> argparse.Namespace | None:
    """The ``--json`` / ``--quick`` command line of a side-by-side benchmark, described by the
    first line of ``doc``; None (said on stderr, under ``name``) without a CUDA device."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"{name}: no CUDA device", file=sys.stderr)
        return None
    return args


def print_rows(header: str, rows: list[dict], line, json_path=None) -> None:
    """A benchmark's table: ``header``, then ``line(row)`` for each row; the rows also go to
    ``json_path`` as JSON when one is given."""
    print(header)
    for r in rows:
        print(line(r))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
