"""The paged cache's page table, resident on the cache's device and updated incrementally.

Every sequence owns a row of a ``[rows, width]`` int32 table on the device; column ``i`` of
its row is the page holding its tokens ``i * page_size ..``. A batch's kernels read the
rows of its requests, gathered into ``[B, width]`` (``kv_indptr[b] = b * width``). A decode
step then costs O(batch) host work whatever the context length:

- the host records only the pages a step adds (a sequence crossing a page boundary) as
  ``(row, column, page)`` deltas;
- :meth:`DevicePageTable.stage` folds those deltas and the batch's small arrays into one
  host->device copy (pinned, non-blocking on CUDA: no host sync);
- :meth:`DevicePageTable.apply` scatters the deltas into the table and, when the batch is
  the previous one (the usual decode step), into the previous gathered rows in place; a
  new batch gathers its rows from the table on the device (no host loop over pages).

When a sequence outgrows ``width`` the table doubles its width (a device copy). Entries
past a sequence's pages are unused capacity and may hold stale ids; nothing reads them.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

import torch

__all__ = ["DevicePageTable"]

_MIN_WIDTH = 16
_MIN_ROWS = 8


class DevicePageTable:
    """Rows of page ids per sequence on ``device`` (see the module docstring). Not locked:
    the cache serialises every call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.table = torch.zeros((_MIN_ROWS, _MIN_WIDTH), dtype=torch.int32, device=device)
        self._row: dict[Hashable, int] = {}
        self._free_rows: list[int] = list(range(_MIN_ROWS - 1, -1, -1))
        self._delta_pos: list[int] = []  # flat table positions row * width + col, not yet on the device
        self._delta_page: list[int] = []
        self._batch: tuple[Hashable, ...] | None = None  # the requests of the last gathered batch
        self._slot_of_row: dict[int, int] = {}  # their table rows -> batch slots
        self._batch_rows: torch.Tensor | None = None  # [B, width] gathered rows of that batch

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def add(self, seq_id: Hashable) -> None:
        if not self._free_rows:
            rows = self.table.shape[0]
            grown = torch.zeros((2 * rows, self.width), dtype=torch.int32, device=self.device)
            grown[:rows] = self.table
            self.table = grown
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        self._row[seq_id] = self._free_rows.pop()

    def release(self, seq_id: Hashable) -> None:
        row = self._row.pop(seq_id)
        self._free_rows.append(row)
        if row in self._slot_of_row:
            self._forget_batch()

    def add_pages(self, seq_id: Hashable, first_col: int, pages: Sequence[int]) -> None:
        """Record that ``seq_id``'s pages ``first_col ..`` are ``pages`` (applied by the next stage/apply)."""
        end = first_col + len(pages)
        if end > self.width:
            self._grow_width(end)
        base = self._row[seq_id] * self.width + first_col
        self._delta_pos.extend(range(base, base + len(pages)))
        self._delta_page.extend(pages)

    def stage(self, seq_ids: tuple[Hashable, ...], head: list[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One device tensor holding ``head`` (the caller's int32 arrays), then the pending
        deltas and, for a new batch, its rows; and the lengths of those parts. Clears the
        pending deltas (the caller applies them with :meth:`apply` on the staged tensor)."""
        if seq_ids == self._batch:
            # each delta's position in the gathered rows: same column, the request's slot as row
            width, slot_of_row = self.width, self._slot_of_row
            batch_pos = [slot_of_row[p // width] * width + p % width for p in self._delta_pos]
            rows: list[int] = []
        else:
            batch_pos = []
            rows = [self._row[s] for s in seq_ids]
        host = head + self._delta_pos + batch_pos + self._delta_page + rows
        parts = (len(head), len(self._delta_pos), len(batch_pos), len(self._delta_page), len(rows))
        self._delta_pos, self._delta_page = [], []
        flat = torch.frombuffer(array("i", host), dtype=torch.int32)  # far cheaper than torch.tensor(list)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        elif flat.device != self.device:
            flat = flat.to(self.device)
        return flat, parts

    def apply(self, seq_ids: tuple[Hashable, ...], flat: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
        """Scatter the staged deltas; return the batch's ``[B * width]`` page ids (kv_indices)."""
        n_head, n_delta, n_batch, _, n_rows = parts
        delta_pos = flat[n_head:n_head + n_delta]
        batch_pos = flat[n_head + n_delta:n_head + n_delta + n_batch]
        pages = flat[n_head + n_delta + n_batch:n_head + 2 * n_delta + n_batch]
        if n_delta:
            self.table.view(-1).index_put_((delta_pos.long(),), pages)
        if n_rows == 0:  # the previous batch again: patch its gathered rows in place
            if n_batch:
                self._batch_rows.view(-1).index_put_((batch_pos.long(),), pages)
            return self._batch_rows.view(-1)
        rows = flat[flat.shape[0] - n_rows:]
        self._batch_rows = self.table.index_select(0, rows.long())
        self._batch = seq_ids
        self._slot_of_row = {self._row[s]: b for b, s in enumerate(seq_ids)}
        return self._batch_rows.view(-1)

    # -- fixed-address batches (:class:`~.static_plan.StaticDecodePlan`): the caller stages, the table writes

    def row(self, seq_id: Hashable) -> int:
        """The table row of ``seq_id`` (fixed for the sequence's life)."""
        return self._row[seq_id]

    def take_deltas(self, min_width: int) -> tuple[list[int], list[int]]:
        """The pending ``(flat position, page)`` deltas, cleared, once the rows have at least
        ``min_width`` columns (positions count that width); the caller stages them and writes
        them with :meth:`scatter`."""
        if min_width > self.width:
            self._grow_width(min_width)
        pos, pages = self._delta_pos, self._delta_page
        self._delta_pos, self._delta_page = [], []
        return pos, pages

    def scatter(self, pos: torch.Tensor, pages: torch.Tensor) -> None:
        """Write staged deltas (int32 flat positions and page ids on the device) into the table."""
        self.table.view(-1).index_put_((pos,), pages)
        self._forget_batch()  # the gathered rows of the last batch did not get them

    def gather(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``out [len(rows), W] = `` the first ``W`` columns of table rows ``rows`` (one kernel)."""
        torch.index_select(self.table[:, :out.shape[1]], 0, rows, out=out)

    def _forget_batch(self) -> None:
        self._batch, self._slot_of_row, self._batch_rows = None, {}, None

    def _grow_width(self, needed: int) -> None:
        width = self.width
        new_width = max(needed, 2 * width)
        grown = torch.zeros((self.table.shape[0], new_width), dtype=torch.int32, device=self.device)
        grown[:, :width] = self.table
        self.table = grown
        # pending positions were computed with the old width: rebase them
        self._delta_pos = [p // width * new_width + p % width for p in self._delta_pos]
        self._forget_batch()
