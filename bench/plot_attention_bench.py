"""Plot ``bench_attention.py --json`` output: decode KV-read bandwidth by batch and prefill
TFLOP/s per implementation.

    python bench/plot_attention_bench.py bench_attention.json docs/kernels/attention_bench.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: Path, dst: Path) -> None:
    data = json.loads(src.read_text())
    rows = [r for r in data["rows"] if "us" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    dec = [r for r in rows if r["kind"] == "decode"]
    impls = list(dict.fromkeys(r["impl"] for r in dec))
    batches = sorted({int(r["shape"].split()[0][2:]) for r in dec})
    for impl in impls:
        pts = sorted((int(r["shape"].split()[0][2:]), r["tbs"]) for r in dec if r["impl"] == impl)
        ax1.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=impl)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(batches, [str(b) for b in batches])
    ax1.set_xlabel("batch (kv 4096, GQA 32/8, d128, bf16)")
    ax1.set_ylabel("KV read bandwidth (TB/s)")
    ax1.set_title("decode")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    pre = [r for r in rows if r["kind"] == "prefill"]
    shapes = list(dict.fromkeys(r["shape"].split()[0] for r in pre))
    pimpls = list(dict.fromkeys(r["impl"] for r in pre))
    width = 0.8 / len(pimpls)
    for i, impl in enumerate(pimpls):
        vals = [next((r["tflops"] for r in pre if r["impl"] == impl and r["shape"].startswith(s)), 0) for s in shapes]
        ax2.bar([x + i * width for x in range(len(shapes))], vals, width, label=impl)
    ax2.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], [f"{s} causal" for s in shapes])
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("prefill (GQA 32/8, d128, bf16)")
    ax2.grid(axis="y", alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left")
    ax2.set_ylim(0, max(r["tflops"] for r in pre) * 1.35)
    fig.suptitle(f"{data['device']}, torch {data['torch']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
