"""Pages a sliding window has left behind, back to the pool (a base of
:class:`~astrai.extension.kv_cache.PagedKVCache`).

``PagedKVCache(..., window=W)`` promises that every layer attends with a window of at most
``W`` (``attention(..., window_left=w)``, ``0 <= w <= W``: a query at position ``p`` sees keys
``j >= p - w``); :func:`shared_window` computes ``W`` from the layers' windows (None when one
layer attends to everything: then nothing can be released). A request of length ``n`` then
needs no key left of ``n - W`` again: its next query sits at ``n``. So each plan, once the
earlier plans over its requests are settled (their lengths are committed: a rollback can
never need a released page back), returns to the pool each request's leading pages whose
every slot lies left of ``n - W``.

Positions stay right without touching any kernel: a released page's column in the
request's page table is kept and points at the **null page**, one page the cache takes out
of the pool when it is built with a window, zeroed in every layer and never handed out or
written. Every backend computes a key's position from its column, so nothing else changes:

- the CUDA kernels (decode and prefill) skip the tiles left of the window and mask scores
  within the first tile; the masked keys of that tile they read are zeros, so ``0 * V``
  stays 0 (a released page, reused by another request or never written, may hold NaN);
- the torch path gathers every column and masks by position (``BatchPlan.keep_mask``); it
  reads zeros there, as it does for padding (which points at column 0);
- CUDA graphs gather the page-table rows as they are (:class:`~.static_plan.StaticDecodePlan`):
  their fixed width counts the null columns, the pool does not.

The alternative, a per-request position offset carried by the plan, would need every kernel
and the torch path to add it; the null page costs one page and no change to any reader.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

__all__ = ["WindowPages", "check_window", "pages_left_behind", "shared_window"]


def check_window(window: object) -> int | None:
    """``window`` if it is None or an int >= 0, else an error naming ``window``."""
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool):
        raise TypeError(f"window must be None or an int >= 0 (the largest window_left of any layer), "
                        f"got {type(window).__name__}")
    if window < 0:
        raise ValueError(f"window must be None or an int >= 0 (the largest window_left of any layer), got {window}")
    return window


def shared_window(window_lefts: Iterable[int]) -> int | None:
    """The cache ``window`` for layers attending with ``window_lefts`` (``attention()``'s
    ``window_left`` of each layer, -1 for a layer that sees every key): the largest of them,
    or None when any is -1 (that layer needs every key) or there are none."""
    windows = list(window_lefts)
    for w in windows:
        if not isinstance(w, int) or isinstance(w, bool) or w < -1:
            raise ValueError(f"window_lefts must be ints >= -1 (-1: no window), got {windows}")
    if not windows or -1 in windows:
        return None
    return max(windows)


def pages_left_behind(length: int, window: int, page_size: int) -> int:
    """Leading pages of a request of ``length`` tokens that no query at ``length`` or later
    reads: pages ``p`` with ``(p + 1) * page_size <= length - window``."""
    return max(length - window, 0) // page_size


class WindowPages:
    """The cache's release of out-of-window pages (see the module docstring). Reads the
    cache's ``window``, ``page_size``, ``k_pages`` / ``v_pages``, ``_free``, ``_pages``,
    ``_lens``, ``_table`` and ``_null_page``; the cache serialises every call."""

    @property
    def null_page(self) -> int | None:
        """The page released columns point at (zeros, never written), None without a window."""
        return self._null_page

    def check_window_left(self, window_left: int) -> None:
        """Raise naming ``window_left`` when a layer attending with it would need keys this
        cache releases (a window wider than the cache's, or none)."""
        if self.window is not None and not 0 <= window_left <= self.window:
            raise ValueError(
                f"window_left={window_left} needs keys the kv_cache releases: it was built with window={self.window} "
                f"(pages left of every layer's window go back to the pool), so every layer must attend with "
                f"0 <= window_left <= {self.window}")

    def _reserve_null_page(self) -> int:
        """Take one page out of the pool for good and zero it in every layer (bytes: FP8 too)."""
        if len(self._free) < 2:
            raise ValueError(f"window={self.window} needs num_pages >= 2 (one page is the null page released "
                             f"pages point at), got {len(self._free)}")
        page = self._free.pop()
        for pages in (self.k_pages, self.v_pages):
            pages.view(torch.uint8)[:, page].zero_()
        return page

    def _drop_left_of_window(self, seq_ids: tuple[Hashable, ...]) -> None:
        """Return each request's pages wholly left of ``length - window`` to the pool, their
        columns pointing at the null page from now on (committed lengths only: call it after
        the plans over ``seq_ids`` are settled)."""
        for s in seq_ids:
            pages = self._pages[s]
            gone = pages_left_behind(self._lens[s], self.window, self.page_size)
            done = self._dropped[s]
            if gone > done:
                self._free.extend(reversed(pages[done:gone]))
                pages[done:gone] = [self._null_page] * (gone - done)
                self._table.add_pages(s, done, pages[done:gone])
                self._dropped[s] = gone
