"""Writing the CLI's output to a reader that may stop reading (``astrai doctor --json | head``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Run the block that prints; when the reader closes the pipe early, stop quietly with
    exit status 1 (Python's advice for EPIPE) instead of a ``BrokenPipeError`` traceback."""
    try:
        yield
        sys.stdout.flush()  # inside: a late EPIPE surfaces here, not at interpreter exit
    except BrokenPipeError:
        # the interpreter flushes stdout again at exit: point it at /dev/null first
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise SystemExit(1) from None
