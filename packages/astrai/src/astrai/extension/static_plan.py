"""Decode plans at fixed device addresses, for CUDA graphs: :class:`StaticDecodePlan`.

A captured graph reads its batch's metadata from the addresses it was captured with. A
:class:`StaticDecodePlan` owns those tensors for decode steps of up to ``size`` requests of
at most ``max_pages`` pages each, and ``PagedKVCache.plan(..., into=static)`` writes a step
into them instead of building a plan of its own:

- one host->device copy of what the host knows: lengths, table rows, write slots,
  positions, and the page-table entries the step adds;
- one scatter of those entries into the cache's device page table (only when the step
  adds pages) and one gather of the requests' rows into ``kv_indices``.

Three launches a step, where refilling a captured plan from an ordinary one took about 40.
Rows past the step's requests (the graph's bucket is larger) read and write one token of
the pad sequence's first page. The page table is laid out as the cache's own plans are
(``kv_indptr[b] = b * max_pages``); ``qo_indptr`` is ``0 .. size`` for every decode step.

Ownership: a graph captured over a step replays long after that step's :class:`BatchPlan`
is gone, so everything the graph reads or writes must outlive the plan. The static plan owns
it all: the metadata buffers above, and the split-KV workspaces of the decode launches made
over its steps (:meth:`split_workspaces`, kept for the static plan's life, never handed back
to the allocator while a graph may write them). A step's plan owns nothing a replay touches.
:meth:`check_graph_safe` says so of a plan's launches before and after a capture, and raises
naming the tensor where a launch holds memory of its own.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from collections.abc import Hashable

import torch

from .batch_plan import BatchPlan
from .device_page_table import DevicePageTable

__all__ = ["StaticDecodePlan"]

class StaticDecodePlan:
    """Fixed-address tensors of decode plans of up to ``size`` requests (see the module
    docstring); made by ``PagedKVCache.static_decode_plan``, filled by its ``plan(..., into=)``,
    which returns a plan of the step's requests whose tensors are views of these buffers. A
    graph is captured with a step of ``size`` requests: its kernels then read every row."""

    def __init__(self, size: int, max_pages: int, page_size: int, pad_seq: Hashable, device: torch.device) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("StaticDecodePlan stages int64 values in the host's byte order, read as little-endian")
        self.size, self.max_pages, self.page_size, self.pad_seq = size, max_pages, page_size, pad_seq
        self.delta_room = 2 * size  # a decode step adds a page and releases one per request at most
        # int32 words: qo_indptr, kv_indptr (fixed); then what each step stages: kv_lens, table rows,
        # padding to 8 bytes, int64 write slots and positions, page-table deltas (positions, pages)
        fixed = 2 * (size + 1)
        lens_at, rows_at = fixed, fixed + size
        wide_at = rows_at + size + (rows_at + size) % 2
        deltas_at = wide_at + 4 * size
        words = torch.zeros(deltas_at + 2 * self.delta_room, dtype=torch.int32, device=device)
        steps = torch.arange(size + 1, dtype=torch.int32)
        words[:fixed].copy_(torch.cat([steps, steps * max_pages]))
        self._words, self._staged_at = words, lens_at
        self.qo_indptr, self.kv_indptr = words[:size + 1], words[size + 1:fixed]
        self.kv_lens, self._rows = words[lens_at:rows_at], words[rows_at:rows_at + size]
        wide = words[wide_at:deltas_at].view(torch.int64)
        self.write_index, self.token_positions = wide[:size], wide[size:]
        self._deltas_at = deltas_at
        self.kv_indices = torch.zeros(size * max_pages, dtype=torch.int32, device=device)
        self._workspaces: list[tuple[torch.Tensor, torch.Tensor]] = []  # every pair handed out, newest last

    def split_workspaces(self, splits: int, batch: int, q_heads: int, head_dim: int,
                         device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(ws_o, ws_lse)``: the float32 split-KV partials of a decode launch over a step of
        this plan (``_split_workspaces``' sizes), as views of buffers this plan keeps; (None,
        None) without a split. A larger need allocates a larger pair and keeps the older ones
        too: a graph captured earlier still writes them."""
        if splits <= 1:
            return None, None
        o_size, lse_size = splits * batch * q_heads * head_dim, splits * batch * q_heads
        if not self._workspaces or self._workspaces[-1][0].numel() < o_size \
                or self._workspaces[-1][1].numel() < lse_size:
            grown = max(o_size, self._workspaces[-1][0].numel() if self._workspaces else 0)
            grown_lse = max(lse_size, self._workspaces[-1][1].numel() if self._workspaces else 0)
            self._workspaces.append((torch.empty(grown, dtype=torch.float32, device=device),
                                     torch.empty(grown_lse, dtype=torch.float32, device=device)))
        ws_o, ws_lse = self._workspaces[-1]
        return ws_o[:o_size], ws_lse[:lse_size]

    def check_graph_safe(self, plan: BatchPlan) -> None:
        """Raise ``RuntimeError`` where a launch of ``plan`` (a step of this static plan) holds
        device memory that this static plan does not own: a graph captured over the step
        would replay into it after the plan, and with it that memory, is gone."""
        if plan.static is not self:
            raise ValueError("plan is not a step of this static plan: plan it with kv_cache.plan(..., into=static)")
        owned = {t.untyped_storage().data_ptr() for t in (self._words, self.kv_indices)}
        owned.update(t.untyped_storage().data_ptr() for pair in self._workspaces for t in pair)
        for key, launch in plan.launches.items():
            for name, t in _device_tensors(launch):
                if t.untyped_storage().data_ptr() not in owned:
                    raise RuntimeError(
                        f"the launch {key!r} of a static decode step holds its own {name} "
                        f"({t.numel() * t.element_size()} bytes): a CUDA graph captured over the step would "
                        "write it after the step's plan has freed it; the launch must take it from the "
                        "StaticDecodePlan (split_workspaces)")

    def stage(self, table: DevicePageTable, seq_ids: tuple[Hashable, ...], kv_lens: tuple[int, ...],
              slots: list[int], pad_slot: int) -> BatchPlan:
        """Write the decode step of ``seq_ids`` (lengths ``kv_lens`` after it, write slots
        ``slots``) and its pad rows into the buffers; return the step's plan. ``ValueError``
        (nothing written) when the step does not fit."""
        n, size = len(seq_ids), self.size
        pages = max(-(-kv // self.page_size) for kv in kv_lens)
        if n > size or pages > self.max_pages:
            raise ValueError(f"the decode step ({n} requests, up to {pages} pages each) does not fit the static "
                             f"plan ({size} requests, {self.max_pages} pages each)")
        pad = size - n
        rows = [table.row(s) for s in seq_ids] + [table.row(self.pad_seq)] * pad
        delta_pos, delta_pages = table.take_deltas(self.max_pages)
        fits = len(delta_pos) <= self.delta_room
        narrow = [*kv_lens, *[1] * pad, *rows]
        if (self._staged_at + len(narrow)) % 2:  # the int64 words start 8-byte aligned
            narrow.append(0)
        head = bytearray(array("i", narrow))
        head += array("q", [*slots, *[pad_slot] * pad, *(kv - 1 for kv in kv_lens), *[0] * pad])
        if fits:
            head += array("i", delta_pos + [0] * (self.delta_room - len(delta_pos)) + delta_pages)
        host = torch.frombuffer(head, dtype=torch.int32)
        if self._words.device.type == "cuda":
            host = host.pin_memory()
        staged = self._words[self._staged_at:self._staged_at + host.numel()]
        staged.copy_(host, non_blocking=True)
        if delta_pos:
            if fits:
                at = self._deltas_at
                table.scatter(self._words[at:at + len(delta_pos)],
                              self._words[at + self.delta_room:at + self.delta_room + len(delta_pages)])
            else:  # more than a decode step adds (never from a plan): a copy of their own
                both = torch.tensor(delta_pos + delta_pages, dtype=torch.int32).to(self._words.device)
                table.scatter(both[:len(delta_pos)], both[len(delta_pos):])
        table.gather(self._rows, self.kv_indices.view(size, self.max_pages))
        return self._plan_of(tuple(seq_ids), tuple(kv_lens))

    def _plan_of(self, seq_ids: tuple, kv_lens: tuple[int, ...]) -> BatchPlan:
        """The plan of the first ``len(seq_ids)`` rows: views of the buffers."""
        n = len(seq_ids)
        plan = BatchPlan(seq_ids=seq_ids, page_size=self.page_size, qo_indptr=self.qo_indptr[:n + 1],
                         kv_indptr=self.kv_indptr[:n + 1], kv_indices=self.kv_indices[:n * self.max_pages],
                         kv_lens=self.kv_lens[:n], q_lens_host=(1,) * n, kv_lens_host=kv_lens, static=self)
        plan.__dict__["write_index"] = self.write_index[:n]
        plan.__dict__["token_positions"] = self.token_positions[:n]
        return plan


def _device_tensors(launch) -> list[tuple[str, torch.Tensor]]:
    """The tensors a launch object holds, by field name: a dataclass's tensor fields, a
    tensor, or a tuple of tensors (what backends keep in ``BatchPlan.launches``)."""
    if isinstance(launch, torch.Tensor):
        return [("tensor", launch)]
    if isinstance(launch, tuple):
        return [(f"[{i}]", t) for i, t in enumerate(launch) if isinstance(t, torch.Tensor)]
    if dataclasses.is_dataclass(launch):
        return [(f.name, v) for f in dataclasses.fields(launch)
                if isinstance(v := getattr(launch, f.name), torch.Tensor)]
    return []
