"""The process's ``Runtime``: the plugin registry plus the resolver, in one explicit object.

Public entry points (``attention``, ``apply_rotary_emb``, the FP8 layer, the ops) look
it up with ``current_runtime()``. It is created from the environment on first use;
``use_runtime(rt)`` swaps in another one for a block (tests, embedding applications).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from .registry import Registry
from .resolver import Decision, Resolver


@dataclass
class Runtime:
    registry: Registry
    resolver: Resolver = field(default_factory=Resolver)

    def explain(self, op: str | None = None) -> list[Decision]:
        """Every backend decision made so far (of ``op``), with its accept/reject trace."""
        return self.resolver.decisions(op)


_override: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("astrai_runtime", default=None)
_process: list[Runtime] = []  # at most one element: the runtime built from the environment
_lock = threading.Lock()


def current_runtime() -> Runtime:
    runtime = _override.get()
    if runtime is not None:
        return runtime
    if not _process:
        with _lock:
            if not _process:
                _process.append(Runtime(Registry.from_environment()))
    return _process[0]


@contextlib.contextmanager
def use_runtime(runtime: Runtime) -> Iterator[Runtime]:
    token = _override.set(runtime)
    try:
        yield runtime
    finally:
        _override.reset(token)
