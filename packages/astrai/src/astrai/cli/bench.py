"""``astrai bench``: what each op costs a user, and what of it is the GPU's.

Each case builds fresh random inputs and times the public entry point (whatever backend
the resolver picks here) three ways:

- **eager**: per call, calls back to back as a model makes them: what a user measures;
- **graph**: per call, the same calls captured in a CUDA graph and replayed: the GPU's
  time, without the host's (the rate is computed from it);
- **host overhead**: eager minus graph, the Python and launch cost above the kernels.

The timers are ``astrai.timing``'s: the table prints each figure as median ±IQR and, under
it, each timer with its rounds; the JSON keeps every figure's timing under ``timings``.

On a GPU the torch path of the same call is timed eagerly too, for the speed-up. Without
a CUDA device there are neither graphs nor kernels: the cases shrink to CPU sizes, the
table says it times the torch fallbacks, and it has no speed-up column (it would compare
the fallback with itself). The JSON keeps every figure (null where not measured).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from .. import timing
from ..extension.device import probe_device
from ..extension.runtime import current_runtime
from ..extension.ops._plugin import PLUGIN_OF_OP
from .checks import UsageError, check_environment, plugin_names, require, writable
from .doctor import backend_name
from .bench_cases import BENCHMARKS, Case, cases
from .output import reader_may_leave


def select(only: list[str] | None) -> set[str] | None:
    """The benchmarks ``--ops`` names (None: all): each OP is an op doctor lists, or a
    benchmark's name or part of it (``decode``, ``fp8``). A name that selects none is a
    :class:`UsageError` listing the valid ones."""
    if not only:
        return None
    chosen = set()
    valid = (f"valid: a benchmark's name or a word of it ({', '.join(BENCHMARKS)}) or an op it times "
             f"({', '.join(dict.fromkeys(BENCHMARKS.values()))})")
    for op in only:
        if op in PLUGIN_OF_OP:
            found = {name for name, plugin_op in BENCHMARKS.items() if plugin_op == op}
            if not found:
                raise UsageError(f"--ops {op}: astrai bench does not time this op\n{valid}")
        else:
            found = {name for name in BENCHMARKS if op.lower() in name}
            if not op.strip() or not found:
                raise UsageError(f"--ops {op!r} names no benchmark\n{valid}")
        chosen |= found
    return chosen


# resolver choices that run a plugin's CUDA kernel (every other choice is a torch path)
KERNEL_CHOICES = frozenset({"cuda", "plugin"})


@dataclass
class Result:
    name: str
    shape: str
    backend: str  # as doctor names it
    choice: str  # the resolver's name for it
    eager_ms: float  # per call, eager, back to back
    graph_ms: float | None  # per call, replayed in a CUDA graph (None: no CUDA device, or not capturable)
    torch_ms: float | None  # the torch path, eager (None without a CUDA device)
    rate: str
    timings: dict[str, timing.Timing] = field(default_factory=dict)  # each figure's timer, rounds, IQR

    @property
    def host_overhead_ms(self) -> float | None:
        return None if self.graph_ms is None else self.eager_ms - self.graph_ms

    @property
    def speedup(self) -> float | None:
        return None if self.torch_ms is None else self.torch_ms / self.eager_ms

    def to_json(self) -> dict:
        return asdict(self) | {"host_overhead_ms": self.host_overhead_ms, "speedup": self.speedup}


def _backend_of(case: Case, device: torch.device) -> tuple[str, str]:
    """(doctor's name, the resolver's name) of the backend ``case.run`` takes, decided afresh."""
    runtime = current_runtime()
    runtime.resolver.clear()
    case.run()
    decisions = [d for d in runtime.resolver.decisions(case.op) if d.source != "explicit"]
    choice = decisions[-1].chosen if decisions else "torch"
    info = probe_device(device)
    status = runtime.registry.op_status(case.plugin_op, info)
    if choice == "flash":
        return "flash-attn", choice
    return backend_name(case.plugin_op, status, info, kernel=choice in KERNEL_CHOICES), choice


def _rate(case: Case, ms: float) -> str:
    per_second = (case.bytes or case.flops) / ms * 1e3
    unit = "B/s" if case.bytes else "FLOP/s"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if per_second >= scale:
            return f"{per_second / scale:.2f} {prefix}{unit}"
    return f"{per_second:.0f} {unit}"


def run_all(device: torch.device, quick: bool, only: list[str] | None) -> list[Result]:
    """Time the benchmarks ``only`` selects (see :func:`select`; None: all) here."""
    gpu = device.type == "cuda"
    calls, rounds = (20, 10) if gpu and not quick else (5, 5)
    results = []
    chosen = select(only)
    here = cases(device, quick)
    selected = [c for c in here if chosen is None or c.name in chosen]
    if not selected:
        where = f"{device.type}{', --quick' if quick else ''}"
        raise UsageError(f"--ops {' '.join(only)}: {', '.join(sorted(chosen))} is not run here ({where}); "
                         f"the benchmarks run here: {', '.join(dict.fromkeys(c.name for c in here))}")
    for case in track(selected, description="benchmarking", transient=True):
        backend, choice = _backend_of(case, device)
        timings = {"eager_ms": timing.eager(case.run, calls, rounds, warmup=1)}
        if gpu:
            try:
                timings["graph_ms"] = timing.graph(case.run, calls, rounds)
            except RuntimeError:  # not capturable: no graph figure
                pass
            timings["torch_ms"] = timing.eager(case.run_torch, calls, rounds, warmup=1)
        ms = {name: t.ms for name, t in timings.items()}
        rate = _rate(case, ms.get("graph_ms", ms["eager_ms"]))
        results.append(Result(case.name, case.shape, backend, choice, ms["eager_ms"], ms.get("graph_ms"),
                              ms.get("torch_ms"), rate, timings))
    return results


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _cell(r: Result, figure: str) -> str:
    """The figure as median ±IQR where it was timed here, else as a plain number."""
    t = r.timings.get(figure)
    return _us(getattr(r, figure)) if t is None else t.cell()


def render(results: list[Result], device: torch.device, console: Console) -> None:
    gpu = device.type == "cuda"
    where = torch.cuda.get_device_name(device) if gpu else "CPU (no CUDA device): the torch fallbacks"
    table = Table(title=f"astrai bench on {where}")
    columns = ["op", "shape", "backend", "eager us/call"]
    if gpu:
        columns += ["graph us/call", "host overhead us", "rate (graph)", "torch eager us", "speed-up"]
    else:
        columns += ["rate"]
    for column in columns:
        table.add_column(column)
    for r in results:
        row = [r.name, r.shape, r.backend, _cell(r, "eager_ms")]
        if gpu:
            speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
            row += [_cell(r, "graph_ms"), _us(r.host_overhead_ms), r.rate, _cell(r, "torch_ms"), speedup]
        else:
            row += [r.rate]
        table.add_row(*row)
    console.print(table)
    console.print(timing.legend(t for r in results for t in r.timings.values()), soft_wrap=True)
    if gpu:
        console.print("eager: per call as a model makes them; graph: the same calls replayed in a CUDA "
                      "graph (the GPU's time); host overhead: the difference. Speed-up: torch path eager "
                      "over eager.", soft_wrap=True)
    else:
        console.print("[yellow]no CUDA device: this times the torch fallbacks (every op's backend here) "
                      "at small CPU sizes; no kernel, no CUDA graph and no speed-up to report[/yellow]",
                      soft_wrap=True)


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.6 * len(results) + 1.5))
    labels = [f"{r.name}\n{r.shape}" for r in results]
    if all(r.speedup is not None for r in results):
        ax.barh(labels, [r.speedup for r in results])
        ax.axvline(1.0, color="grey", linestyle="--")
        ax.set_xlabel("speed-up over the torch path (eager)")
    else:  # no GPU: the fallbacks' own times, nothing to compare them with
        ax.barh(labels, [r.eager_ms * 1e3 for r in results])
        ax.set_xlabel("eager us per call (torch fallbacks, no CUDA device)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check(args) -> None:
    """Everything ``astrai bench`` can check before the first benchmark."""
    check_environment(plugin_names(current_runtime().registry))
    select(args.ops)
    writable(args.json, "--json")
    writable(args.plot, "--plot")
    if args.plot:
        require("matplotlib", "plot", "--plot")


def main(args) -> int:
    check(args)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    results = run_all(device, args.quick, args.ops)
    with reader_may_leave():
        render(results, device, Console(width=160))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "kernels": device.type == "cuda",
                       "results": [r.to_json() for r in results]}, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0
