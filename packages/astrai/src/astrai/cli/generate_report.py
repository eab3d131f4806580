"""What ``astrai generate`` prints of its result: the table, the peers' ratios (of those that
ran), the failed and skipped peers with their reasons, the accuracy, the HBM floor and the KV cache."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["count", "print_report"]


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def print_report(console: Console, result: dict) -> None:
    e = result["engine"]
    table = Table(title=f"astrai generate ({result['device']}, attention: {result['attention_backend']})")
    for col in ("run", "TTFT s", "prefill tok/s", "decode tok/s", "step ms", "total s"):
        table.add_column(col, justify="right" if col != "run" else "left")
    table.add_row("astrai", _fmt(e["ttft_mean_s"], ".3f"), _fmt(e["prefill_tokens_per_s"], ",.0f"),
                  _fmt(e["decode_tokens_per_s"], ",.0f"), _fmt(e["decode_step_ms"], ".2f"), _fmt(e["total_s"], ".2f"))
    for p in result["peers"]:
        if p["status"] == "ran":
            table.add_row(escape(p["name"]), _fmt(p["ttft_s"], ".3f"), "-", _fmt(p["decode_tokens_per_s"], ",.0f"), "-",
                          _fmt(p["total_s"], ".2f"))
        else:
            table.add_row(escape(p["name"]), f"[{'red' if p['status'] == 'failed' else 'yellow'}]{p['status']}[/]",
                          "-", "-", "-", "-")
    console.print(table)
    console.print("TTFT: mean over requests, all submitted at once (transformers: its first batch's prefill)")
    for p in result["peers"]:
        if p["status"] == "failed":
            console.print(f"[red]{escape(p['name'])}: failed: {escape(p['failed'])}[/] (no figures: nothing to compare)")
        elif p["status"] == "skipped":
            console.print(f"[yellow]{escape(p['name'])}: skipped ({escape(p['skipped'])})[/]")
        elif p["total_s"]:
            line = f"vs {escape(p['name'])}: astrai {p['total_s'] / e['total_s']:.2f}x faster end to end"
            if p["decode_tokens_per_s"]:
                line += f", {e['decode_tokens_per_s'] / p['decode_tokens_per_s']:.2f}x in decode tokens/s"
            if p["ttft_s"]:
                line += f", TTFT {e['ttft_mean_s'] / p['ttft_s']:.2f}x of its TTFT"
            console.print(line)
    if result.get("accuracy"):
        console.print(accuracy_line(result["accuracy"]))
    if result.get("precision_accuracy"):
        print_precision_accuracy(console, result["precision_accuracy"])
    console.print(floor_line(e["hbm_floor"], e.get("decode_batch_mean")))
    if result.get("weights_bytes"):
        fp8 = " (decoder linears as FP8 copies, their 16-bit weights freed)" if result.get("fp8_weights") else ""
        console.print(f"weights: {_gb(result['weights_bytes'])}{fp8}")
    if result.get("kv_cache"):
        console.print(kv_cache_line(result["kv_cache"]))
    if e["gpu_memory_bytes"]:
        console.print(f"GPU memory (peak allocated): {e['gpu_memory_bytes'] / 2**30:.2f} GiB")


def accuracy_line(acc: dict) -> str:
    """The engine's and each peer's teacher-forced error against the float32 reference, or why there is none."""
    if acc.get("failed"):
        return f"[red]accuracy: not measured: {escape(acc['failed'])}[/]"
    figures = [f"astrai {acc['astrai']:.4g}"]
    for p in acc["peers"]:
        name = escape(p["name"])
        if p["failed"] is not None:
            figures.append(f"[red]{name} failed: {escape(p['failed'])}[/]")
        else:
            figures.append(f"{name} {p['error']:.4g}" + (" (it is the reference)" if p.get("is_reference") else ""))
    return (f"accuracy: relative L2 error of the logits against transformers in float32, teacher-forced on astrai's "
            f"tokens ({acc['requests']} requests, {acc['tokens']} tokens): {', '.join(figures)}")


def print_precision_accuracy(console: Console, acc: dict) -> None:
    """Each precision mode's teacher-forced error against float32, side by side (or why there is none)."""
    if acc.get("failed"):
        console.print(f"[red]accuracy by precision: not measured: {escape(acc['failed'])}[/]")
        return
    table = Table(title=f"accuracy by precision ({acc['dtype']} weights, {acc['requests']} requests, "
                        f"{acc['new_tokens']} new tokens, teacher-forced against float32)")
    for col in ("mode", "relative L2", f"x {acc['modes'][0]['mode']}", "top-1 agreement", "FP8 linears' routes"):
        table.add_column(col, justify="right" if col in ("relative L2", "top-1 agreement") or col.startswith("x ")
                         else "left")
    for row in acc["modes"]:
        routes = ", ".join(f"{name} {n}" for name, n in row.get("routes", {}).items()) or "-"
        if row["failed"] is not None:
            table.add_row(escape(row["mode"]), f"[red]failed: {escape(row['failed'])}[/]", "-", "-", "-")
        else:
            table.add_row(escape(row["mode"]), f"{row['error']:.3g}", _fmt(row["x_base"], ".2f"),
                          f"{row['top1']:.1%}", routes)
    console.print(table)


def floor_line(floor: dict, batch: float | None = None) -> str:
    """The decode step beside its HBM floor (or why the floor is not given)."""
    step = f"decode step {floor['step_ms']:.2f} ms" + (f" (mean batch {batch:.1f})" if batch else "")
    if floor["floor_ms"] is None:
        return f"{step}; HBM floor: {floor['note']}"
    ratio = f": {floor['step_over_floor']:.2f}x the floor" if floor["step_over_floor"] else ""
    return (f"{step}; HBM floor {floor['floor_ms']:.2f} ms ({_gb(floor['weight_bytes'])} of weights + "
            f"{_gb(floor['kv_bytes'])} of KV cache per step at {floor['bandwidth_tb_s']:.3g} TB/s){ratio}")


def kv_cache_line(kv: dict) -> str:
    """The KV cache's storage dtype and size."""
    return (f"KV cache: {kv['dtype'].removeprefix('torch.')}, {kv['pages']} pages of {kv['page_size']} tokens, "
            f"{_gb(kv['bytes'])}")
