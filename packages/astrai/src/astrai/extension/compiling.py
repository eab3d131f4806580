"""torch.compile support that costs nothing at import time."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def assume_constant_result(fn: F) -> F:
    """``torch._dynamo.assume_constant_result`` without importing ``torch._dynamo``.

    Importing dynamo pulls in inductor and sympy (0.7 s to 6 s) and the decorator only
    marks ``fn`` for dynamo to read when it traces a call; so the mark is made here and
    dynamo is imported only when something is compiled. ``tests/core/test_import_time.py``
    checks the mark is still the one dynamo's decorator makes.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # what torch._dynamo.decorators.assume_constant_result sets
    return fn
