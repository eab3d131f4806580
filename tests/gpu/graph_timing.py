"""The one timer of the GPU benchmarks: median per-call time of a CUDA-graph replay.

``fn`` is warmed up on a side stream (as graph capture requires), ``calls`` calls of it
are captured into one graph, and the graph is replayed ``rounds`` times between events;
replaying many calls per graph takes the launch gaps out of the figure.
"""

from __future__ import annotations

import statistics

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
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
