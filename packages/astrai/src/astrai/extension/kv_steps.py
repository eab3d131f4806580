"""Which layers wrote each uncommitted plan of a :class:`~astrai.extension.kv_cache.PagedKVCache`.

A plan advances its sequences' lengths at once, before any layer writes; until every layer
has written the plan's new tokens, a later plan over the same sequences would count slots
as cached that some layer never wrote. :class:`StepLog` keeps, for each plan not yet
committed, a bit per layer (set by ``PagedKVCache.mark_written``: an int update per layer
and step) and decides, when a new plan is made, what becomes of the open ones
(:meth:`StepLog.settle`). The cache itself moves the pages and lengths back.
"""

from __future__ import annotations

from collections.abc import Hashable

from .batch_plan import BatchPlan

__all__ = ["CacheStateError", "OpenStep", "StepLog"]


class CacheStateError(RuntimeError):
    """A plan of the paged cache cannot be made or committed as asked: a ``step()`` over the
    same requests is still open, or a ``step()`` left a layer that never wrote its tokens."""


class OpenStep:
    """One uncommitted plan: ``written`` has bit ``i`` set once layer ``i`` wrote its tokens;
    ``strict`` for a plan of ``PagedKVCache.step()`` (settled by its block alone)."""

    __slots__ = ("plan", "written", "strict")

    def __init__(self, plan: BatchPlan, strict: bool) -> None:
        self.plan = plan
        self.written = 0
        self.strict = strict


class StepLog:
    """The open plans of one cache. Not locked: the cache serialises every call but
    :meth:`mark_latest`, which only sets a bit of the latest plan's step."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.all_layers = (1 << num_layers) - 1
        self.current: OpenStep | None = None  # the latest plan's, while open
        self.open: list[OpenStep] = []

    def start(self, plan: BatchPlan, strict: bool) -> OpenStep:
        step = OpenStep(plan, strict)
        self.open.append(step)
        self.current = step
        return step

    def mark_latest(self, layer_id: int | None, plan: BatchPlan) -> bool:
        """Set the layer's bit when ``plan`` is the latest plan (the usual case); False when not."""
        step = self.current
        if step is None or step.plan is not plan:
            return False
        step.written |= self.all_layers if layer_id is None else (1 << layer_id) & self.all_layers
        return True

    def mark(self, layer_id: int | None, plan: BatchPlan) -> None:
        """Set the layer's bit in ``plan``'s open step, if it has one (else it is committed)."""
        if not self.mark_latest(layer_id, plan):
            step = self.of_plan(plan)  # another thread's plan, made before the latest one
            if step is not None:
                step.written |= self.all_layers if layer_id is None else (1 << layer_id) & self.all_layers

    def complete(self, step: OpenStep) -> bool:
        return step.written == self.all_layers

    def is_open(self, step: OpenStep) -> bool:
        return step in self.open

    def of_plan(self, plan: BatchPlan | None) -> OpenStep | None:
        return next((s for s in self.open if s.plan is plan), None)

    def committable(self, step: OpenStep) -> bool:
        """Every layer wrote it, or none did outside a ``step()`` (a plan used as a reservation)."""
        return step.written == self.all_layers or (step.written == 0 and not step.strict)

    def released(self, seq_id: Hashable) -> OpenStep | None:
        """Before ``seq_id`` is released: commit its open plan if it may be; else return it, to
        be rolled back (at most one open plan holds a sequence: a new plan settles the last)."""
        step = next((s for s in self.open if seq_id in s.plan.seq_ids), None)
        if step is not None and self.committable(step):
            self.close(step)
            return None
        return step

    def close(self, step: OpenStep) -> None:
        self.open.remove(step)
        if self.current is step:
            self.current = None

    def settle(self, seq_ids: tuple[Hashable, ...]) -> list[OpenStep]:
        """Before a plan of ``seq_ids``: commit (close) the open plans every layer wrote and
        those no layer wrote (a plain ``plan()`` used as a reservation: metadata, graph
        capture); return those some layers wrote over any of ``seq_ids``, for the cache to
        roll back. Plans over other sequences stay open (another thread may be running
        them); an open ``step()`` over any of ``seq_ids`` raises (nothing changes)."""
        if not self.open:
            return []
        for step in self.open:
            if step.strict and not self.complete(step) and _overlaps(step, seq_ids):
                raise CacheStateError(
                    f"a step() over requests {list(step.plan.seq_ids)} is still open: leave its block "
                    f"before planning requests {[s for s in seq_ids if s in step.plan.seq_ids]} again")
        undo = []
        for step in list(self.open):
            if self.committable(step):
                self.close(step)
            elif not step.strict and _overlaps(step, seq_ids):
                undo.append(step)
        return undo

    def unwritten(self, step: OpenStep) -> list[int]:
        return [i for i in range(self.num_layers) if not step.written >> i & 1]

    def describe(self, step: OpenStep) -> str:
        """Which layers did not write ``step``'s tokens, and of which requests."""
        plan = step.plan
        missing = self.unwritten(step)
        layers = f"layer {missing[0]}" if len(missing) == 1 else f"layers {_spans(missing)}"
        return (f"{layers} (of {self.num_layers}) did not write the new tokens of requests {list(plan.seq_ids)} "
                f"(q_lens {list(plan.q_lens_host)})")


def _overlaps(step: OpenStep, seq_ids: tuple[Hashable, ...]) -> bool:
    return not set(step.plan.seq_ids).isdisjoint(seq_ids)


def _spans(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (a 32-layer step that failed early names two spans)."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a + 1 else ", ".join(map(str, range(a, b + 1))) for a, b in spans)
