"""The ragged metadata of one batch (:class:`BatchPlan`), built by ``PagedKVCache.plan``.

Device tensors for the kernels, host copies of the lengths for the fallbacks, and the
token addressing (slots into a layer's pages) the torch paths use. Built once per batch,
shared by every layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

__all__ = ["BatchPlan", "q_tile_schedule", "staged_plan"]


def q_tile_schedule(q_lens: tuple[int, ...], tile_rows: int) -> tuple[list[int], list[int]]:
    """(tile -> request, tile -> index inside the request) of ``tile_rows``-row Q tiles, in the
    order their blocks start: the requests last-first, each request's tiles last-first (a causal
    tile's last rows see the most keys). A longest-processing-time order over the whole batch
    was measured slower (16x1024 paged prefill: 0.72-0.76 vs 0.77-0.81x cuDNN, H100) and removed."""
    if all(n == 1 for n in q_lens):  # decode: one tile per request
        return list(range(len(q_lens))), [0] * len(q_lens)
    tiles = [(b, i) for b in reversed(range(len(q_lens))) for i in reversed(range(-(-q_lens[b] // tile_rows)))]
    return [b for b, _ in tiles], [i for _, i in tiles]


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """Ragged metadata for one batch, built once by :meth:`PagedKVCache.plan`.

    Device tensors (int32, on the cache's device):

    - ``qo_indptr [B+1]``: request ``b``'s new tokens are rows
      ``qo_indptr[b]:qo_indptr[b+1]`` of the packed ``[total_q, heads, head_dim]`` query;
    - ``kv_indptr [B+1]`` / ``kv_indices``: request ``b``'s page ids, in token order, start at
      ``kv_indices[kv_indptr[b]]``; its first ``ceil(kv_lens[b] / page_size)`` entries are its
      pages, and the rest of its span ``kv_indptr[b]:kv_indptr[b+1]`` is unused capacity (the
      cache keeps a device-resident table with room to grow, so a step adds only its new
      pages; ``kv_indptr`` is monotone and ``kv_indptr[B] == len(kv_indices)``);
    - ``kv_lens [B]``: tokens in the cache per request, after this step's append;
    - :meth:`q_tiles` ``(tile_rows)``: ``q_tile_to_batch [T]`` / ``q_tile_to_index [T]``, for
      each Q tile of the ragged prefill schedule its request and its tile index inside that
      request; the tile size is the kernels' (the plugin modules' ``Q_TILE_ROWS``).

    Host copies for the fallbacks: ``q_lens_host`` and ``kv_lens_host`` (tuples of int).
    The new tokens of request ``b`` are its last ``q_lens_host[b]`` cache positions.

    ``launches``: what backends built for this batch and reuse in every layer (a kernel
    launch plan: split count, workspaces, converted arguments), by the backend's key; filled
    by :meth:`PagedKVCache.plan` through the cache's preparers, or by a layer's first call.

    ``static``: the :class:`~.static_plan.StaticDecodePlan` whose buffers this plan's tensors
    view (a step planned ``into=`` it), which also owns the memory its launches write (a
    graph captured over the step outlives the plan); None: the plan owns its tensors.
    """

    seq_ids: tuple[Hashable, ...]
    page_size: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    q_lens_host: tuple[int, ...]
    kv_lens_host: tuple[int, ...]
    launches: dict[Hashable, object] = field(default_factory=dict, repr=False)
    static: object = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def batch_size(self) -> int:
        return len(self.q_lens_host)

    @functools.cached_property
    def total_q(self) -> int:
        return sum(self.q_lens_host)

    @functools.cached_property
    def total_kv(self) -> int:
        return sum(self.kv_lens_host)

    @functools.cached_property
    def max_q_len(self) -> int:
        return max(self.q_lens_host)

    @functools.cached_property
    def max_kv_len(self) -> int:
        return max(self.kv_lens_host)

    def memo(self, key: Hashable, build: Callable[[], object]) -> object:
        """``launches[key]``, built by ``build()`` the first time a layer of the batch asks."""
        found = self.launches.get(key)
        if found is None:
            found = self.launches[key] = build()
        return found

    def q_tiles(self, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``(q_tile_to_batch, q_tile_to_index)`` of ``tile_rows``-row Q tiles, on the
        plan's device; built once per plan and tile size (one host->device copy)."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            to_batch, to_index = q_tile_schedule(self.q_lens_host, tile_rows)
            flat = torch.tensor(to_batch + to_index, dtype=torch.int32)
            device = self.qo_indptr.device
            if device.type == "cuda" and not torch.compiler.is_compiling():
                flat = flat.pin_memory().to(device, non_blocking=True)
            elif device.type == "cuda":  # a traced graph holds the copy as a constant (no pinning there)
                flat = flat.to(device)
            return flat[: len(to_batch)], flat[len(to_batch):]
        return self.memo(("q_tiles", tile_rows), build)

    @functools.cached_property
    def is_decode(self) -> bool:
        """True when every request adds exactly one token (a decode step)."""
        return all(n == 1 for n in self.q_lens_host)

    @functools.cached_property
    def uniform_q_len(self) -> int | None:
        """The common q length when all requests add the same number of tokens, else None."""
        first = self.q_lens_host[0]
        return first if all(n == first for n in self.q_lens_host) else None

    # -- token addressing (int64 slots into a layer's pages viewed as [num_pages * page_size, ...])

    def _slots(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat slots of token positions ``pos`` of requests ``seq`` (both int64, same shape)."""
        page_slot = self.kv_indptr.long()[seq] + torch.div(pos, self.page_size, rounding_mode="floor")
        return self.kv_indices.long()[page_slot] * self.page_size + pos % self.page_size

    def _q_lens_device(self) -> torch.Tensor:
        """int64 ``[B]`` q lengths, derived on the device (no host copy: the decode path
        must never synchronise)."""
        return (self.qo_indptr[1:] - self.qo_indptr[:-1]).long()

    def _new_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``(request, position in its sequence)`` of each new token, packed query order
        (``kv_len - q_len + row``), derived on the device (no host sync)."""
        device = self.qo_indptr.device
        q_lens = self._q_lens_device()
        seq = torch.repeat_interleave(torch.arange(self.batch_size, device=device), q_lens, output_size=self.total_q)
        row = torch.arange(self.total_q, device=device) - self.qo_indptr.long()[seq]
        return seq, self.kv_lens.long()[seq] - q_lens[seq] + row

    @functools.cached_property
    def write_index(self) -> torch.Tensor:
        """int64 ``[total_q]``: slot of each new token, in packed query order."""
        return self._slots(*self._new_tokens())

    @functools.cached_property
    def token_positions(self) -> torch.Tensor:
        """int64 ``[total_q]``: each new token's position in its sequence, packed query order."""
        return self._new_tokens()[1]

    @functools.cached_property
    def flat_index(self) -> torch.Tensor:
        """int64 ``[total_kv]``: slots of every cached token, requests concatenated."""
        device = self.kv_lens.device
        kv_lens = self.kv_lens.long()
        seq = torch.repeat_interleave(torch.arange(self.batch_size, device=device), kv_lens, output_size=self.total_kv)
        starts = torch.cumsum(kv_lens, 0) - kv_lens
        pos = torch.arange(self.total_kv, device=device) - starts[seq]
        return self._slots(seq, pos)

    @functools.cached_property
    def padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 ``[B, max_kv]`` slots, bool ``[B, max_kv]`` valid); padding points at slot of token 0."""
        device = self.kv_lens.device
        pos = torch.arange(self.max_kv_len, device=device).expand(self.batch_size, -1)
        valid = pos < self.kv_lens.long()[:, None]
        seq = torch.arange(self.batch_size, device=device)[:, None].expand_as(pos)
        return self._slots(seq, torch.where(valid, pos, 0)), valid

    @functools.cached_property
    def q_padded_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 ``[B, max_q]`` rows of the packed query, bool ``[B, max_q]`` valid); padding -> row 0."""
        device = self.qo_indptr.device
        rows = torch.arange(self.max_q_len, device=device).expand(self.batch_size, -1)
        valid = rows < self._q_lens_device()[:, None]
        return torch.where(valid, self.qo_indptr.long()[:-1, None] + rows, 0), valid

    def keep_mask(self, causal: bool, window_left: int = -1) -> torch.Tensor:
        """Bool ``[B, max_q, max_kv]``: which cached tokens each (padded) query row attends to.

        Request ``b``'s new tokens are its last ``q_len`` positions, so row ``i`` sits at
        position ``i + kv_len - q_len``: with ``causal`` it keeps ``j <= i + kv_len - q_len``,
        with ``window_left = W >= 0`` it keeps ``j >= i + kv_len - q_len - W``; padding keys are
        never kept. Built once per plan, causal flag and window, then shared by every layer.
        """
        name = f"_keep_{causal:d}_{window_left}"
        cached = self.__dict__.get(name)
        if cached is None:
            _, kv_valid = self.padded_index
            device = kv_valid.device
            cached = kv_valid[:, None, :].expand(self.batch_size, self.max_q_len, self.max_kv_len)
            if (causal and self.max_q_len > 1) or window_left >= 0:
                offset = self.kv_lens.long() - torch.tensor(self.q_lens_host, device=device)
                rows = torch.arange(self.max_q_len, device=device)[None, :, None]
                cols = torch.arange(self.max_kv_len, device=device)[None, None, :]
                position = rows + offset[:, None, None]
                if causal and self.max_q_len > 1:
                    cached = cached & (cols <= position)
                if window_left >= 0:
                    cached = cached & (cols >= position - window_left)
            self.__dict__[name] = cached  # frozen dataclass: memoised like the cached properties
        return cached

    @functools.cached_property
    def cu_seqlens_q(self) -> torch.Tensor:
        """int32 ``[B+1]`` prefix sums of q lengths (same values as ``qo_indptr``)."""
        return self.qo_indptr

    @functools.cached_property
    def cu_seqlens_kv(self) -> torch.Tensor:
        """int32 ``[B+1]`` prefix sums of kv lengths (the varlen layout of :attr:`flat_index`)."""
        return torch.nn.functional.pad(torch.cumsum(self.kv_lens, 0, dtype=torch.int32), (1, 0))

    # -- packing of per-token tensors

    def packed(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """View ``t`` of one row per new token as ``[total_q, heads, head_dim]``.

        Accepted: ``[total_q, H, D]``; ``[1, total_q, H, D]`` (packed); ``[B, L, H, D]`` when
        every request adds ``L`` tokens. Anything else is a ``ValueError`` naming ``name``.
        """
        shape = self.check_packable(t.shape, name)
        return t if len(shape) == 3 else t.reshape(self.total_q, shape[2], shape[3])

    def check_packable(self, shape: torch.Size, name: str) -> torch.Size:
        """``shape`` when a tensor of that shape holds one row per new token (see :meth:`packed`),
        else a ``ValueError`` naming ``name``; no tensor is made."""
        if len(shape) == 3 and shape[0] == self.total_q:
            return shape
        if len(shape) == 4 and (
            (shape[0] == 1 and shape[1] == self.total_q)
            or (shape[0] == self.batch_size and shape[1] == self.uniform_q_len)
        ):
            return shape
        raise ValueError(
            f"{name} has shape {tuple(shape)} but the cache's plan adds q_lens={list(self.q_lens_host)} "
            f"(total {self.total_q}) tokens: expected [1, {self.total_q}, heads, head_dim] (packed)"
            + (
                f" or [{self.batch_size}, {self.uniform_q_len}, heads, head_dim]"
                if self.uniform_q_len is not None and self.batch_size > 1
                else ""
            )
        )


def staged_plan(table, seq_ids: tuple, q_lens: tuple[int, ...], kv_lens: tuple[int, ...], page_size: int,
                slots: list[int] | None) -> BatchPlan:
    """The batch's plan with its metadata in one host->device copy through the cache's device
    page table (:class:`~.device_page_table.DevicePageTable`); ``slots``: a decode step's write
    slots when the cache knows them on the host (they become ``write_index``, and the
    positions ``kv_len - 1`` become ``token_positions``), else None."""
    batch = len(seq_ids)
    qo_indptr = [0] * (batch + 1)
    total = 0
    for b, n in enumerate(q_lens):
        total += n
        qo_indptr[b + 1] = total
    width = table.width
    kv_indptr = list(range(0, (batch + 1) * width, width))
    head = [*qo_indptr, *kv_indptr, *kv_lens]
    if slots is not None:
        head += slots
        head += [n - 1 for n in kv_lens]
    flat, parts = table.stage(seq_ids, head)  # one host->device copy
    kv_indices = table.apply(seq_ids, flat, parts)
    views = flat.split_with_sizes([batch + 1, batch + 1, batch, parts[0] - 3 * batch - 2, flat.shape[0] - parts[0]])
    plan = BatchPlan(
        seq_ids=seq_ids,
        page_size=page_size,
        qo_indptr=views[0],
        kv_indptr=views[1],
        kv_indices=kv_indices,
        kv_lens=views[2],
        q_lens_host=q_lens,
        kv_lens_host=kv_lens,
    )
    if slots is not None:  # write_index and token_positions, already known: one conversion instead of 20 ops
        plan.__dict__["write_index"], plan.__dict__["token_positions"] = views[3].long().split(batch)
    return plan
