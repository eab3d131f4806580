"""Backend resolution: precedence, a decision cache, and traces that explain each choice.

Callers describe a call with a hashable ``key`` (op, device, dtype, shape class) and
hand over the candidates in default priority order. Each candidate has a ``name`` and
``check(call) -> str | None`` (None: it can run the call; otherwise the reason it can't)
and, optionally, ``why_capable(call) -> str | None``: the trace's reason when it wins, and
``slower_than_peer(call) -> str | None``: a reason to pass over a capable candidate that was
measured slower than a later one for this call (not applied to an explicit selection).

- ``explicit`` (an ``attn_backend(...)`` selection) is strict: that candidate or an error.
- ``preferred`` (the ``ASTR_BACKEND`` environment variable) is tried first, then the rest.
- Otherwise the first capable candidate in priority order wins.

The winner and the full trace are cached under the key, so a repeated call costs one
dict lookup; ``decisions()`` returns the traces for ``explain`` and ``astrai doctor``.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Candidate(Protocol):
    name: str

    def check(self, call: Any) -> str | None: ...


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the call; the message says why."""


@dataclass(frozen=True)
class TraceEntry:
    candidate: str
    accepted: bool
    reason: str

    def __str__(self) -> str:
        return f"{'accept' if self.accepted else 'reject'} {self.candidate}: {self.reason}"


@dataclass(frozen=True)
class Decision:
    op: str
    key: Hashable
    chosen: str | None
    source: str  # "explicit", "env" or "default"
    trace: tuple[TraceEntry, ...]

    def __str__(self) -> str:
        lines = [f"{self.op} {self.key} -> {self.chosen} ({self.source})"]
        lines += [f"  {entry}" for entry in self.trace]
        return "\n".join(lines)


class Resolver:
    def __init__(self) -> None:
        self._cache: dict[Hashable, tuple[Any, Decision]] = {}
        self._lock = threading.Lock()
        # what callers derive from decisions (e.g. the FP8 linear's per-shape functions),
        # emptied with them by clear()
        self.derived: dict[Hashable, Any] = {}
        # counts clear(): a caller that keeps a decision elsewhere keeps this with it, and
        # decides again when it has changed
        self.generation = 0

    def resolve(self, op: str, candidates: Sequence[Candidate], call: Any, key: Hashable,
                *, explicit: str | None = None, preferred: str | None = None) -> Any:
        """The candidate that runs ``call``; raises ``BackendUnavailableError`` if none can."""
        full_key = (op, key, explicit, preferred)
        hit = self._cache.get(full_key)
        if hit is None:
            with self._lock:  # one decision per key, even when many threads arrive at once
                hit = self._cache.get(full_key)
                if hit is None:
                    hit = self._decide(op, candidates, call, key, explicit, preferred)
                    self._cache[full_key] = hit
        winner, decision = hit
        if winner is None:
            raise BackendUnavailableError(
                f"no backend can run {op} for {key}:\n" + "\n".join(f"  {e}" for e in decision.trace))
        return winner

    def _decide(self, op, candidates, call, key, explicit, preferred) -> tuple[Any, Decision]:
        by_name = {c.name: c for c in candidates}
        if explicit is not None:
            order, source = [explicit], "explicit"
        elif preferred is not None:
            order, source = [preferred] + [c.name for c in candidates if c.name != preferred], "env"
        else:
            order, source = [c.name for c in candidates], "default"
        trace: list[TraceEntry] = []
        winner = None
        for name in order:
            candidate = by_name.get(name)
            if candidate is None:
                trace.append(TraceEntry(name, False, f"not a backend of {op}"))
                continue
            reason = candidate.check(call)
            if reason is None and source != "explicit":
                # capable, but measured slower than a later candidate: passed over unless asked for
                slower = getattr(candidate, "slower_than_peer", None)
                reason = slower(call) if slower else None
            if reason is None and winner is None:
                winner = candidate
                why = getattr(candidate, "why_capable", None)  # optional: why it was chosen
                trace.append(TraceEntry(name, True, (why(call) if why else None) or "capable"))
            elif reason is None:
                trace.append(TraceEntry(name, True, f"capable, lower priority than {winner.name}"))
            else:
                trace.append(TraceEntry(name, False, reason))
        decision = Decision(op, key, None if winner is None else winner.name, source, tuple(trace))
        if winner is None and explicit is not None:
            # Strict: an explicit selection never silently switches implementations.
            raise BackendUnavailableError(f"backend {explicit!r} was requested for {op} but cannot run "
                                          f"{key}: {trace[0].reason}")
        return winner, decision

    def decisions(self, op: str | None = None) -> list[Decision]:
        """The cached decisions (optionally of one op), oldest first."""
        return [d for _, d in list(self._cache.values()) if op is None or d.op == op]

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.derived.clear()
            self.generation += 1
