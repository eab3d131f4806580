"""The measured sm_90 preference table for dense prefill: the plugin against torch SDPA.

A call of ``attention()`` without a KV cache has a peer outside the plugin: the core's torch
backend (SDPA, with whatever kernel SDPA picks). ``prefill_table.json`` (next to this file)
holds both times per shape class, measured side by side on an H200 by
``bench/bench_prefill.py --write-table`` (or this module on a saved benchmark JSON)::

    python -m astrai_attention.prefill_table bench_prefill.json --commit 1a2b3c4 --date 2026-12-01 \\
        -o packages/astrai-attention/src/astrai_attention/prefill_table.json

It becomes the ``attn_prefill`` op's ``prefer`` entry for arch 90 (docs/plugins.md), in the
manifest's generic form: ``m`` = query rows of the call (batch x q_len), ``n`` = KV length,
``k`` = head_dim, ``mode`` = ``"causal"`` or ``"full"``, and the query / kv heads measured
(``q_heads`` / ``kv_heads``): the table speaks for calls whose GQA group (q_heads / kv_heads)
is a multiple of the measured one, which run the same blocks (heuristics.h packs up to
``PACKED_HEADS`` query heads of a group per K/V tile; a multiple of that many fills every
block alike). Other groups, multi-head attention among them, keep the torch path: their
blocks differ (one head per block, or head slots left empty). Pure Python, no torch.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from . import _measured_table

TABLE_FILE = "prefill_table.json"
FORMAT = 2  # 2: q_heads / kv_heads (format 1 tables were all measured at 32 / 8)
PACKED_HEADS = 4  # query heads per prefill block at most (heuristics.h: prefill_head_block)
PEER = "torch"  # the core's name for its SDPA backend
OURS, THEIRS = "astrai contiguous", "torch path"  # bench_prefill.py's row names


def from_bench(bench: dict[str, Any], *, commit: str, date: str) -> dict[str, Any]:
    """The table of one ``bench_prefill.py --json`` result: every uniform shape where both the
    plugin's dense prefill and the torch path were timed, at the heads it measured (a GQA
    group that fills the prefill blocks: a multiple of ``PACKED_HEADS``)."""
    rows = bench.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("benchmark JSON has no 'rows'")
    q_heads, kv_heads = _heads(bench.get("heads"))
    timed = {(r["shape"], r["d"], r["causal"], r["impl"]): r for r in rows if "us" in r}
    classes = []
    for (shape, d, causal, impl), ours in timed.items():
        peer = timed.get((shape, d, causal, THEIRS))
        if impl != OURS or peer is None:
            continue
        batch, length = (int(x) for x in shape.split("x"))
        classes.append({"m": batch * length, "n": length, "k": int(d), "mode": "causal" if causal else "full",
                        "ours_ms": round(ours["us"] / 1e3, 5), "peer_ms": round(peer["us"] / 1e3, 5),
                        "ratio": round(peer["us"] / ours["us"], 3)})
    if not classes:
        raise ValueError(f"benchmark JSON has no shape with both {OURS!r} and {THEIRS!r} timed")
    return _measured_table.table(
        bench, format=FORMAT, commit=commit, date=date,
        source=f"bench/bench_prefill.py (medians of CUDA-graph replays, heads {q_heads}/{kv_heads} bf16)",
        q_heads=q_heads, kv_heads=kv_heads, peer=PEER, classes=classes)


def _heads(value: Any) -> tuple[int, int]:
    """The benchmark's (query heads, kv heads), checked: a group that fills the blocks."""
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value))
    if not ok:
        raise ValueError(f"benchmark JSON needs 'heads': [q_heads, kv_heads], got {value!r}")
    q_heads, kv_heads = value
    if q_heads % kv_heads or (q_heads // kv_heads) % PACKED_HEADS:
        raise ValueError(f"heads {q_heads}/{kv_heads}: a table must be measured at a GQA group that is a multiple "
                         f"of {PACKED_HEADS} (whole blocks of {PACKED_HEADS} query heads); a run at another group "
                         "measures blocks that only that group runs")
    return q_heads, kv_heads


def load() -> Any:
    """The shipped table as the manifest's value: None when this build carries none; if the
    file is unreadable or not JSON, a string saying so (the core treats a non-table as
    malformed and keeps the torch path, with that string as the reason). Never raises:
    discovery must not fail over a table."""
    path = files(__package__).joinpath(TABLE_FILE)
    if not path.is_file():
        return None
    return _measured_table.read(path)


def main(argv: list[str] | None = None) -> None:
    output, table = _measured_table.write_from_bench(argv, __doc__.splitlines()[0], from_bench)
    print(f"{output}: {len(table['classes'])} classes")


if __name__ == "__main__":
    main()
