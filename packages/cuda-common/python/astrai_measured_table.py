"""What the plugins' measured sm_90 preference tables share: the table's JSON around its
classes, reading the shipped file, and the command line that writes one from a benchmark.

Each plugin's package holds this file as ``_measured_table.py`` (a link into cuda-common in
the source tree and the sdist, a plain copy in the wheel), so no plugin imports another at
run time. Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def table(bench: dict[str, Any], *, format: int, commit: str, date: str, source: str, peer: str,
          classes: list[dict[str, Any]], **facts: Any) -> dict[str, Any]:
    """The table of one benchmark run: its device and torch, the commit and date, the source,
    the plugin's own `facts`, the peer it was timed against and the measured classes."""
    device = str(bench.get("device", "unknown GPU"))
    return {
        "format": format,
        "device": device,
        "sm": 90,
        "torch": str(bench.get("torch", "")),
        "commit": commit,
        "date": date,
        "source": source,
        **facts,
        "peer": peer,
        "measured": f"{device}, commit {commit}, {date}",
        "classes": classes,
    }


def read(path: Traversable) -> Any:
    """The table at `path`; if the file is unreadable or not JSON, a string saying so (the core
    treats a non-table as malformed and keeps the peer, with that string as the reason)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{path.name} unreadable: {type(exc).__name__}: {exc}"


def write_from_bench(argv: list[str] | None, description: str,
                     from_bench: Callable[..., dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """The command line ``BENCH.json --commit C --date D -o TABLE.json``: writes the table of
    the benchmark JSON; returns the output path and the table."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("bench_json", type=Path)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args(argv)
    measured = from_bench(json.loads(args.bench_json.read_text()), commit=args.commit, date=args.date)
    args.output.write_text(json.dumps(measured, indent=1) + "\n")
    return args.output, measured
