"""Which layers wrote each uncommitted plan of a :class:`~astrai.extension.kv_cache.PagedKVCache`.

A plan advances its sequences' lengths at once, before any layer writes; until every layer
has written the plan's new tokens, a later plan over the same sequences would count slots
as cached that some layer never wrote. :class:`StepLog` keeps, for each plan not yet
committed, a bit per layer (set by ``PagedKVCache.mark_written``: an int update per layer
and step) and decides, when a new plan is made, what becomes of the open ones
(:meth:`StepLog.settle`). The cache itself moves the pages and lengths back.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Hashable, Iterator, Sequence

from .batch_plan import BatchPlan

__all__ = ["CacheStateError", "CacheSteps", "OpenStep", "StepLog"]


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


class CacheSteps:
    """The step lifecycle of :class:`~astrai.extension.kv_cache.PagedKVCache` (a base of it:
    the lock, the plans and the undo of pages and lengths are the cache's).

    A plan advances its requests' lengths before any layer writes, so a step
    abandoned after some layers appended (OOM, bad input, Ctrl-C) would leave the other
    layers counting slots they never wrote. The cache keeps a bit per layer for each
    uncommitted plan (:meth:`append` sets it, and kernels that write the pages themselves
    call :meth:`mark_written`) so that no layer ever reads a slot it did not write:

    - ``with cache.step(seq_ids, q_lens) as plan:`` rolls the batch back when the block
      raises (lengths as before, the step's new pages back in the pool) and commits it when
      the block ends with every layer written (else rolls back and raises
      :class:`CacheStateError` naming the layers); :meth:`rollback` undoes the active plan
      by hand.
    - a plain :meth:`plan` commits the previous plans every layer wrote. One that some
      layers wrote and others did not is rolled back, with a ``RuntimeWarning`` naming the
      layers and requests, by the next plan over any of its requests (or their
      :meth:`release`), before that plan counts its tokens: a retry of the step then
      replans the same tokens. Rolling back rather than raising keeps a caller that retries
      working, and the warning shows the step that was lost. Plans over other requests
      leave it open (another thread may still be running it).
    - a plan no layer wrote is taken, by the next plan, as a reservation (metadata
      queries, CUDA-graph capture: as before). A plain plan therefore cannot tell a step
      that died before its first write; :meth:`step` can, and rolls it back.
    """

    @contextlib.contextmanager
    def step(self, seq_ids: Sequence[Hashable], q_lens: Sequence[int], *, into=None) -> Iterator[BatchPlan]:
        """``with cache.step(seq_ids, q_lens) as plan:`` :meth:`plan`, then run the layers in the
        block. Leaving it by an exception (``KeyboardInterrupt`` too) rolls the batch back:
        every request's length returns to what it was, the pages the step took return to the
        pool; the exception propagates. Leaving it normally commits the batch, once every layer
        wrote its tokens; else the batch is rolled back and :class:`CacheStateError` names the
        layers that did not. While the block is open, planning any of its requests again
        raises :class:`CacheStateError`. ``into``: as in :meth:`plan`."""
        with self._lock:
            plan, step = self._plan(tuple(seq_ids), tuple(q_lens), True, into)
        try:
            yield plan
        except BaseException:
            with self._lock:
                if self._steps.is_open(step):
                    self._roll_back(step)
            raise
        with self._lock:
            if not self._steps.is_open(step):  # settled inside the block (rollback(), release())
                return
            if not self._steps.complete(step):
                message = self._steps.describe(step)
                self._roll_back(step)
                raise CacheStateError(f"{message}: the step is rolled back")
            self._steps.close(step)

    def rollback(self) -> bool:
        """Roll the :attr:`active_plan` back while it is uncommitted (its requests' lengths
        return to what they were before it, the pages it took return to the pool, and the
        cache has no active plan); True when it did, False when there was nothing to undo."""
        with self._lock:
            step = self._steps.of_plan(self._active)
            if step is None:
                return False
            self._roll_back(step)
            return True

    def mark_written(self, layer_id: int | None, plan: BatchPlan) -> None:
        """Record that layer ``layer_id`` (None: every layer, e.g. a replayed CUDA graph) wrote
        ``plan``'s new tokens. :meth:`append` does it; a kernel that writes the pages itself
        (an in-kernel append, the fused rotary write) calls this after its launch. One int
        update: no device work."""
        if not self._steps.mark_latest(layer_id, plan):
            with self._lock:
                self._steps.mark(layer_id, plan)

    def _warn_rolled_back(self, step: OpenStep, settled_by: str, stacklevel: int) -> None:
        warnings.warn(f"kv_cache: {self._steps.describe(step)}, a step abandoned half-way: rolled back at "
                      f"{settled_by} (`with kv_cache.step(...)` rolls a failed step back as it fails)",
                      RuntimeWarning, stacklevel=stacklevel)

    def _roll_back(self, step: OpenStep) -> None:
        """Undo ``step``'s plan (see :meth:`rollback`)."""
        self._steps.close(step)
        plan = step.plan
        self._undo(plan.seq_ids, plan.q_lens_host, plan.kv_lens_host)
        if self._active is plan:
            self._active = None


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
