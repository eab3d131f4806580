"""Environment variables read on every call, at the cost of a dict lookup.

The public calls read ``ASTR_BACKEND`` and ``ASTRAI_DEBUG`` each time, so a change made
through ``os.environ`` applies to the next call. ``os.environ.get`` costs about 0.7 us (it
encodes the name, and an unset variable raises and catches a ``KeyError``): more than a
decode kernel's launch. CPython's ``os.environ`` keeps the encoded variables in a plain
dict that every change through ``os.environ`` updates; a reader looks its variable up
there, and falls back to ``os.environ.get`` where that dict is missing, and while torch
compiles (dynamo traces ``os.environ`` but not a bound ``dict.get``). A reader's ``raw()``
returns the variable as that dict holds it (or ``read()`` where there is none), for eager
code that only needs to notice a change: one C call, no Python frame.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

__all__ = ["env_reader"]


def env_reader(name: str) -> Callable[[], str | None]:
    """A function returning ``os.environ.get(name)``, cheaply."""
    data = getattr(os.environ, "_data", None)
    encodekey = getattr(os.environ, "encodekey", None)
    decodevalue = getattr(os.environ, "decodevalue", None)
    if type(data) is not dict or encodekey is None or decodevalue is None:
        def fallback() -> str | None:
            return os.environ.get(name)

        fallback.raw = fallback
        return fallback
    get = data.get
    key = encodekey(name)

    def read() -> str | None:
        if torch.compiler.is_compiling():
            return os.environ.get(name)
        raw = get(key)
        return None if raw is None else decodevalue(raw)

    read.raw = functools.partial(get, key)
    return read
