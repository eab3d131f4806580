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

from importlib.resources import files
from typing import Any

from . import _measured_table

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
    return _measured_table.table(
        bench, format=FORMAT, commit=commit, date=date,
        source="bench/bench_fp8_sm90.py (medians of CUDA-graph replays, e4m3 x e4m3 -> bf16)",
        peer=PEER, classes=list(classes.values()))


def load() -> Any:
    """The shipped table as the manifest's value; if the file is missing or not JSON, a
    string saying so (the core treats a non-table as malformed and keeps cuBLASLt, with
    that string as the reason). Never raises: discovery must not fail over a table."""
    return _measured_table.read(files(__package__).joinpath(TABLE_FILE))


def main(argv: list[str] | None = None) -> None:
    output, table = _measured_table.write_from_bench(argv, __doc__.split("\n\n")[0], from_bench)
    wins = [c for c in table["classes"] if c["ratio"] > 1.0]
    print(f"{output}: {len(table['classes'])} classes, plugin faster in {len(wins)}")


if __name__ == "__main__":
    main()
