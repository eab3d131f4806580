"""astrai.timing on a CPU: the eager and host timers find a known per-call cost (median in a
band around a direct measurement, IQR >= 0, per call and not per round), setup stays out of
the figure, a Timing prints as documented, and the graph timers refuse without CUDA."""

from __future__ import annotations

import json
import time

import pytest
import torch

from astrai import timing


def work(n: int = 20_000) -> int:
    """Pure Python arithmetic: a cost that only the CPU's speed sets."""
    total = 0
    for i in range(n):
        total += i * i
    return total


def direct_us(fn, calls: int = 20, rounds: int = 5, clock=time.perf_counter) -> float:
    """The per-call cost measured by hand on ``clock``, best of ``rounds`` (the shared machine
    only adds)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t0) / calls * 1e6)
    return best


@pytest.mark.parametrize("timer", [timing.eager, timing.host])
def test_a_known_cost_is_found_per_call(timer):
    # the host timer reads this thread's CPU time: so does its reference (wall time on a loaded
    # machine can be several times the CPU time and fail the band for no fault of the timer)
    expected = direct_us(work, clock=time.thread_time if timer is timing.host else time.perf_counter)
    t = timer(work, calls=20, rounds=5)
    assert (t.rounds, t.calls, t.timer) == (5, 20, timer.__name__)
    assert expected / 3 < t.median_us < expected * 3, (t, expected)
    assert t.iqr_us >= 0
    # four times the work is about four times the figure: the unit and the per-call division hold
    longer = timer(lambda: work(80_000), calls=5, rounds=5)
    assert 2 < longer.median_us / t.median_us < 8, (longer, t)


def test_host_setup_runs_before_each_round_and_is_not_timed():
    seen = []

    def setup():
        seen.append(1)
        work(200_000)  # tens of milliseconds of CPU, far above one call of the timed function

    t = timing.host(lambda: work(1_000), calls=10, rounds=4, setup=setup)
    assert len(seen) >= 4
    assert t.median_us < direct_us(lambda: work(200_000), calls=1) / 5, t


def test_a_timing_prints_median_iqr_rounds_calls_and_timer():
    t = timing.Timing(12.34, 0.4, 50, 20, "eager")
    assert str(t) == f"{t}" == "12.3 us (IQR 0.4, 50 rounds x 20 calls, eager)"
    assert f"{t:>11}" == "  12.3 ±0.4"
    assert t.ms == pytest.approx(0.01234)
    assert t.to_json() == {"median_us": 12.34, "iqr_us": 0.4, "rounds": 50, "calls": 20, "timer": "eager"}
    assert str(timing.Timing(1234.6, 150.2, 9, 20, "graph")) == "1235 us (IQR 150, 9 rounds x 20 calls, graph)"
    g = timing.Timing(3.0, 0.1, 9, 20, "graph")
    assert timing.legend([t, g, t]) == ("timers (median per call): 50 rounds x 20 calls, eager; "
                                        "9 rounds x 20 calls, graph")


def test_figures_keep_each_timing_and_json_writes_it():
    e, g = timing.Timing(12.0, 0.5, 5, 400, "eager"), timing.Timing(3.0, 0.1, 9, 20, "graph")
    row = {"case": "x"} | timing.figures(eager_us=e, graph_us=g)
    assert (row["eager_us"], row["graph_us"], row["timings"]) == (12.0, 3.0, {"eager_us": e, "graph_us": g})
    back = json.loads(json.dumps(row, default=timing.jsonable))
    assert back["timings"]["graph_us"] == {"median_us": 3.0, "iqr_us": 0.1, "rounds": 9, "calls": 20, "timer": "graph"}
    with pytest.raises(TypeError, match="object is not JSON serializable"):
        json.dumps({"x": object()}, default=timing.jsonable)


@pytest.mark.parametrize("call", [lambda: timing.graph(work), lambda: timing.graphs({"a": work}),
                                  lambda: timing.graph(work, eager_fallback=True)])
def test_graph_timers_refuse_without_cuda(monkeypatch, call):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device, and none is available"):
        call()
