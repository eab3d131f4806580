"""What the GPU benchmarks' command lines and result tables share. Their timers are
``astrai.timing`` (eager, host, CUDA-graph replays), one for every benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from astrai import timing


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
    """A benchmark's table: ``header``, then ``line(row)`` for each row, then the timers and
    rounds of the rows' figures (``timing.figures``); the rows also go to ``json_path`` as JSON
    when one is given, each figure's timing with them."""
    print(header)
    for r in rows:
        print(line(r))
    timed = [t for r in rows for t in r.get("timings", {}).values()]
    if timed:
        print(timing.legend(timed))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1, default=timing.jsonable))


def checked(fns: dict, error_of, before=lambda: None) -> tuple[dict, dict]:
    """The candidates of a side-by-side run that work, each called once after ``before()``:
    ``error_of(name, output)`` (a relative error, or None where a candidate is not checked) is
    kept by name; one that raises is shown failed (its message under its name), never dropped."""
    usable, errors = {}, {}
    for name, fn in fns.items():
        try:
            before()
            err = error_of(name, fn())
            if err is not None:
                errors[name] = err
            usable[name] = fn
        except Exception as exc:  # shown failed, never dropped
            errors[name] = f"failed: {type(exc).__name__}: {exc}"[:160]
    return usable, errors


def largest_error(rows: list[dict]) -> float:
    """The largest relative error any checked candidate of ``rows`` (``row["errors"]``) showed."""
    return max((e for r in rows for e in r["errors"].values() if isinstance(e, float)), default=float("nan"))
