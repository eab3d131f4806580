"""The measured sm_90 preference table: the Hopper wgmma GEMM against cuBLASLt, per shape.

``sm90_table.json`` (next to this file) is written from a real benchmark run on an H200
(``bench/bench_fp8_sm90.py --write-table``, or this module on a saved benchmark JSON)::

    python -m astrai_fp8.sm90_table bench_fp8_sm90.json --commit 1a2b3c4 --date 2026-11-29 \\
        -o packages/astrai-fp8/src/astrai_fp8/sm90_table.json

It becomes the manifest's ``fp8_gemm`` ``prefer`` entry for arch 90 (docs/plugins.md): the
core runs the plugin's GEMM on sm_90 only for shape classes where the nearest measured row
says it beats ``torch._scaled_mm`` in the same accumulation mode. Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

TABLE_FILE = "sm90_table.json"
FORMAT = 1
PEER = "scaled_mm"  # the core's name for torch._scaled_mm (cuBLASLt)
MODES = ("promote", "fast")


def from_bench(bench: dict[str, Any], *, commit: str, date: str) -> dict[str, Any]:
    """The table of one ``bench_fp8_sm90.py --json`` result: every shape and mode where both
    times exist (cuBLASLt refuses some odd shapes; those rows are left out)."""
    rows = bench.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("benchmark JSON has no 'rows'")
    classes: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        for mode in MODES:
            ours, peer = r.get(f"ours_{mode}_ms"), r.get(f"cublas_{mode}_ms")
            if not (ours and peer):
                continue
            key = (int(r["M"]), int(r["N"]), int(r["K"]), mode)
            row = {"m": key[0], "n": key[1], "k": key[2], "mode": mode,
                   "ours_ms": round(float(ours), 5), "peer_ms": round(float(peer), 5),
                   "ratio": round(float(peer) / float(ours), 3)}
            if key not in classes or row["ratio"] < classes[key]["ratio"]:
                classes[key] = row  # a shape timed twice keeps its less favourable run
    if not classes:
        raise ValueError("benchmark JSON has no row with both our time and cuBLASLt's")
    device = str(bench.get("device", "unknown GPU"))
    return {
        "format": FORMAT,
        "device": device,
        "sm": 90,
        "torch": str(bench.get("torch", "")),
        "commit": commit,
        "date": date,
        "source": "bench/bench_fp8_sm90.py (medians of CUDA-graph replays, e4m3 x e4m3 -> bf16)",
        "peer": PEER,
        "measured": f"{device}, commit {commit}, {date}",
        "classes": list(classes.values()),
    }


def load() -> Any:
    """The shipped table as the manifest's value; if the file is missing or not JSON, a
    string saying so (the core treats a non-table as malformed and keeps cuBLASLt, with
    that string as the reason). Never raises: discovery must not fail over a table."""
    try:
        return json.loads(files(__package__).joinpath(TABLE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{TABLE_FILE} unreadable: {type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", type=Path)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args(argv)
    table = from_bench(json.loads(args.bench_json.read_text()), commit=args.commit, date=args.date)
    args.output.write_text(json.dumps(table, indent=1) + "\n")
    wins = [c for c in table["classes"] if c["ratio"] > 1.0]
    print(f"{args.output}: {len(table['classes'])} classes, plugin faster in {len(wins)}")


if __name__ == "__main__":
    main()
