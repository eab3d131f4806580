"""torch.profiler view of a training step across threads, for diag_fp8_step_threads.py:
per thread what it spends per step, the handoffs between the calling thread and autograd's
device thread around ``backward()``, and the gaps between the device thread's ops."""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from astrai.extension._fp8 import linear as linear_mod


@contextlib.contextmanager
def patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def profile_threads(step, steps: int, threaded: bool) -> None:
    """torch.profiler (CPU events) of ``steps`` steps: per thread what it spends, the
    handoffs between the calling thread and the device thread, and the gaps."""
    def marked_step():
        with record_function("diag::step"):
            step()

    def pass_end(self, _call=linear_mod._PassEnd.__call__):
        with record_function("diag::pass_end"):
            _call(self)

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.set_multithreading_enabled(threaded))
        stack.enter_context(patched(linear_mod._PassEnd, "__call__", pass_end))
        stack.enter_context(patched(torch.Tensor, "backward", _marked_backward(torch.Tensor.backward)))
        for _ in range(5):
            marked_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            for _ in range(steps):
                marked_step()
            torch.cuda.synchronize()
    events = list(prof.events())
    report_threads(events, steps, threaded)


def _marked_backward(backward):
    def marked(self, *args, **kwargs):
        with record_function("diag::backward"):
            return backward(self, *args, **kwargs)
    return marked


def _span(e) -> tuple[float, float]:
    return e.time_range.start, e.time_range.end


def report_threads(events, steps: int, threaded: bool) -> None:
    title = "backward on the device thread" if threaded else "one thread"
    print(f"\n== torch.profiler, {title}: {steps} steps (us per step; profiler overhead included)")
    by_thread = defaultdict(list)
    for e in events:
        by_thread[e.thread].append(e)
    main = next((t for t, es in by_thread.items() if any(e.name == "diag::step" for e in es)), None)
    for tid, es in sorted(by_thread.items(), key=lambda kv: kv[0] != main):
        top = [e for e in es if e.cpu_parent is None]
        total = sum(e.time_range.end - e.time_range.start for e in top)
        selfs = defaultdict(float)
        for e in es:
            selfs[e.name] += e.self_cpu_time_total
        busiest = sorted(selfs.items(), key=lambda kv: -kv[1])[:10]
        role = "calling thread" if tid == main else "other thread"
        print(f"thread {tid} ({role}): {len(es) / steps:.1f} events, top-level ranges {total / steps:.1f} us per step;"
              " self us per step:")
        print("    " + ", ".join(f"{name[:48]} {t / steps:.1f}" for name, t in busiest))
    ends = [e for e in events if e.name == "diag::pass_end"]
    if ends:
        where = {e.thread for e in ends}
        print(f"_PassEnd ran on thread(s) {sorted(where)} ({'calling' if where == {main} else 'other'}), "
              f"{statistics.mean(e.time_range.end - e.time_range.start for e in ends):.1f} us each")
    if main is None:
        return
    backwards = sorted((e for e in by_thread[main] if e.name == "diag::backward"), key=lambda e: e.time_range.start)
    stepped = sorted((e for e in by_thread[main] if e.name == "diag::step"), key=lambda e: e.time_range.start)
    others = sorted((e for t, es in by_thread.items() if t != main for e in es if e.cpu_parent is None),
                    key=lambda e: e.time_range.start)
    stats = defaultdict(list)
    gaps = defaultdict(list)
    for i, b in enumerate(backwards):
        b0, b1 = _span(b)
        inside = [e for e in others if b0 <= e.time_range.start < b1]
        after_end = stepped[i + 1].time_range.start if i + 1 < len(stepped) else float("inf")
        late = [e for e in others if b1 <= e.time_range.start < after_end]
        stats["backward() wall"].append(b1 - b0)
        if stepped:
            stats["forward (step start to backward())"].append(b0 - stepped[i].time_range.start)
        stats["other threads: ops after backward() returned"].append(sum(e.time_range.end - e.time_range.start
                                                                          for e in late))
        if not inside:
            continue
        stats["handoff in: backward() to the first device-thread op"].append(inside[0].time_range.start - b0)
        last_end = max(e.time_range.end for e in inside)
        stats["handoff out: last device-thread op to backward() return"].append(b1 - last_end)
        busy = sum(e.time_range.end - e.time_range.start for e in inside)
        stats["device thread: top-level ops"].append(busy)
        stats["device thread: between its ops"].append(last_end - inside[0].time_range.start - busy)
        for prev, nxt in zip(inside, inside[1:]):
            gaps[f"{prev.name[:44]} -> {nxt.name[:44]}"].append(nxt.time_range.start - prev.time_range.end)
    nodes, python = defaultdict(float), []
    for e in events:  # every thread: on the calling one in one-thread mode
        if e.name.startswith("autograd::engine::evaluate_function"):
            nodes[e.name.split(": ", 1)[-1]] += e.time_range.end - e.time_range.start
            if "_Fp8LinearBackward" in e.name:
                kids = sum(c.time_range.end - c.time_range.start for c in e.cpu_children)
                python.append(e.time_range.end - e.time_range.start - kids)
    if python:
        stats["_Fp8LinearBackward node: outside its child ops"] = python
    print("  autograd nodes (us per step): " + ", ".join(f"{name[:40]} {t / steps:.1f}" for name, t in nodes.items()))
    for label, values in stats.items():
        print(f"  {label:<58} {statistics.mean(values):8.1f}  (median {statistics.median(values):.1f},"
              f" max {max(values):.1f})")
    if gaps:
        print("  gaps between the device thread's top-level ops, largest first (mean us):")
        for label, values in sorted(gaps.items(), key=lambda kv: -statistics.mean(kv[1]))[:8]:
            print(f"    {label:<92} {statistics.mean(values):8.1f}")
