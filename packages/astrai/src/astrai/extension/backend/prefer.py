"""Measured preference tables: where a plugin's kernel beats the peer the core would use.

A plugin may ship, per op and per arch, the times of its kernel and of a peer (for FP8 GEMM:
``torch._scaled_mm``, the core's ``scaled_mm`` backend; for dense prefill: the torch SDPA
backend) on a set of shape classes, under the op spec's optional manifest key ``prefer``
(docs/plugins.md)::

    "prefer": {"90": {"peer": "scaled_mm", "measured": "NVIDIA H200, commit 1a2b3c4, 2026-11-29",
                      "classes": [{"m": 1024, "n": 8192, "k": 8192, "mode": "promote",
                                   "ours_ms": 0.121, "peer_ms": 0.126}, ...]}}

The policy asks :func:`verdict` for a call's shape: the nearest measured class of the same
mode (distance in log2 of M, N and K) decides, and the verdict carries its reason
("measured 1.04x scaled_mm at 1024x8192x8192 promote"). A table that is not of this form
is a :class:`PreferTableError`; the caller then keeps the peer and shows the message.
Nothing here touches the registry: the table is the raw manifest value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# A class counts as a win for the plugin only when its time is below the peer's; a tie
# keeps the peer (switching implementations then buys nothing).
MIN_RATIO = 1.0


class PreferTableError(ValueError):
    """The ``prefer`` table of a manifest is malformed; the message says where."""


@dataclass(frozen=True)
class MeasuredClass:
    m: int
    n: int
    k: int
    mode: str
    ours_ms: float
    peer_ms: float

    @property
    def ratio(self) -> float:
        """Peer time over ours: > 1 means the plugin is faster."""
        return self.peer_ms / self.ours_ms

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclass(frozen=True)
class PreferTable:
    peer: str
    measured: str
    classes: tuple[MeasuredClass, ...]

    def nearest(self, m: int, n: int, k: int, mode: str) -> MeasuredClass | None:
        """The measured class of ``mode`` closest to (m, n, k) in log2 space; ties go to
        the earlier row (the table's order is the benchmark's)."""
        best, best_d = None, math.inf
        for c in self.classes:
            if c.mode != mode:
                continue
            d = abs(math.log2(m / c.m)) + abs(math.log2(n / c.n)) + abs(math.log2(k / c.k))
            if d < best_d:
                best, best_d = c, d
        return best


def _positive(row: Mapping, key: str, kind: type, where: str):
    value = row.get(key)
    number = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not (number and value > 0 and math.isfinite(value)):
        raise PreferTableError(f"{where}: {key!r} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


def parse_table(raw: object, where: str = "prefer table") -> PreferTable:
    """``raw`` (one arch's entry of ``prefer``) as a :class:`PreferTable`, or raise."""
    if not isinstance(raw, Mapping):
        raise PreferTableError(f"{where} must be a dict, got {type(raw).__name__}: {str(raw)[:120]}")
    peer, measured, rows = raw.get("peer"), raw.get("measured", ""), raw.get("classes")
    if not isinstance(peer, str) or not peer:
        raise PreferTableError(f"{where}: 'peer' must be a backend name, got {peer!r}")
    if not isinstance(measured, str):
        raise PreferTableError(f"{where}: 'measured' must be a string, got {type(measured).__name__}")
    if not isinstance(rows, list) or not rows:
        raise PreferTableError(f"{where}: 'classes' must be a non-empty list")
    classes = []
    for i, row in enumerate(rows):
        at = f"{where} class {i}"
        if not isinstance(row, Mapping):
            raise PreferTableError(f"{at} must be a dict, got {type(row).__name__}")
        mode = row.get("mode")
        if not isinstance(mode, str):
            raise PreferTableError(f"{at}: 'mode' must be a string, got {mode!r}")
        classes.append(MeasuredClass(_positive(row, "m", int, at), _positive(row, "n", int, at),
                                     _positive(row, "k", int, at), mode,
                                     _positive(row, "ours_ms", float, at),
                                     _positive(row, "peer_ms", float, at)))
    return PreferTable(peer, measured, tuple(classes))


def raw_table(prefer: object, sm: int | None) -> object:
    """The entry of ``prefer`` (the manifest value) for ``sm`` as the manifest holds it, keys
    an op's policy reads beside the generic ones included; None when there is none."""
    if prefer is None or sm is None:
        return None
    if not isinstance(prefer, Mapping):
        raise PreferTableError(f"'prefer' must be a dict keyed by arch, got {type(prefer).__name__}")
    return prefer.get(str(sm), prefer.get(sm))


def table_for(prefer: object, sm: int | None) -> PreferTable | None:
    """The table of ``prefer`` (the manifest value) for ``sm``; None when there is none."""
    raw = raw_table(prefer, sm)
    return None if raw is None else parse_table(raw, f"prefer table for sm_{sm}")


@dataclass(frozen=True)
class Verdict:
    plugin_faster: bool
    reason: str


def verdict(prefer: object, sm: int | None, shape: tuple[int, int, int] | None, mode: str) -> Verdict | None:
    """Whether the measured table prefers the plugin for ``shape`` (M, N, K) in ``mode``.

    None: the manifest has no table for ``sm`` (the policy's other rules decide). A
    malformed table, a call without a shape or a mode the table lacks all keep the peer.
    """
    try:
        table = table_for(prefer, sm)
    except PreferTableError as exc:
        return Verdict(False, f"{exc}; the peer is used")
    if table is None:
        return None
    if shape is None:
        return Verdict(False, f"the measured table for sm_{sm} needs the call's M, N, K; "
                              f"{table.peer} is used")
    cls = table.nearest(*shape, mode)
    if cls is None:
        return Verdict(False, f"the measured table for sm_{sm} has no {mode!r} class; {table.peer} is used")
    near = "" if (cls.m, cls.n, cls.k) == tuple(shape) else f" (nearest to {shape[0]}x{shape[1]}x{shape[2]})"
    what = f"measured {cls.ratio:.2f}x {table.peer} at {cls.shape} {mode}{near}"
    if table.measured:
        what += f" [{table.measured}]"
    if cls.ratio > MIN_RATIO:
        return Verdict(True, what)
    return Verdict(False, f"{what}: {table.peer} is faster there")
