"""Decode steps of a :class:`~astrai.extension.kv_cache.PagedKVCache` written into fixed buffers
(:class:`~.static_plan.StaticDecodePlan`), and the write slots of a decode step, which the host
knows from its page lists.

A captured CUDA graph reads its plan at the addresses it was captured with.
``cache.static_decode_plan`` owns such buffers, and ``plan(..., into=static)`` (or ``step``)
writes a decode step of up to ``size`` requests into them in one host->device copy; rows past
the step's requests read and write one token of a pad sequence. ``cache.prepare`` builds the
backends' launches for a capture (``astrai.serve.graphs`` does all of it)::

    >>> import torch
    >>> from astrai.extension.kv_cache import PagedKVCache
    >>> cache = PagedKVCache(num_layers=1, num_pages=16, page_size=16, kv_heads=2, head_dim=64,
    ...                      dtype=torch.float32)
    >>> for seq in ("pad", "a", "b"):
    ...     cache.add_sequence(seq)
    >>> _ = cache.plan(["pad", "a", "b"], [1, 72, 12])        # the pad sequence holds a token
    >>> static = cache.static_decode_plan(size=4, max_pages=8, pad_seq="pad")
    >>> plan = cache.plan(["a", "b"], [1, 1], into=static)
    >>> static.kv_lens.tolist(), plan.kv_lens.tolist()       # two requests and two pad rows; a view
    ([73, 13, 1, 1], [73, 13])
"""

from __future__ import annotations

from collections.abc import Hashable

from .batch_plan import BatchPlan
from .kv_pages import locked as _locked
from .static_plan import StaticDecodePlan

__all__ = ["StaticPlans"]


class StaticPlans:
    """The cache's static decode plans (a base of it). Reads the cache's ``page_size``,
    ``num_pages``, ``device``, ``_pages``, ``_table`` and ``_static_plans``; the cache
    serialises every call."""

    @_locked
    def static_decode_plan(self, size: int, max_pages: int, pad_seq: Hashable) -> StaticDecodePlan:
        """Fixed device buffers for the decode steps of up to ``size`` requests of at most
        ``max_pages`` pages each (``plan(..., into=)`` fills them); the rows past a step's
        requests read and write one token of ``pad_seq``'s first page (a sequence holding at
        least one token, kept for the buffers' life)."""
        for name, value in (("size", size), ("max_pages", max_pages)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._require_seq(pad_seq)
        if not self._pages[pad_seq]:
            raise ValueError(f"pad_seq {pad_seq!r} owns no page: plan a token for it first")
        static = StaticDecodePlan(size, max_pages, self.page_size, pad_seq, self.device)
        self._static_plans.add(static)
        return static

    def _check_static(self, into: object, seq_ids: tuple, q_lens: tuple) -> None:
        if not isinstance(into, StaticDecodePlan) or into not in self._static_plans:
            raise TypeError(f"into must be a StaticDecodePlan of this cache (static_decode_plan), got "
                            f"{type(into).__name__}")
        if q_lens.count(1) != len(q_lens):
            raise ValueError(f"into= takes decode steps (every q_len 1), got q_lens={list(q_lens)}")
        if len(seq_ids) > into.size:
            raise ValueError(f"the decode step has {len(seq_ids)} requests, the static plan holds {into.size}")
        if into.pad_seq not in self._pages:
            raise ValueError(f"the static plan's pad_seq {into.pad_seq!r} was released")

    def _stage_static(self, into: StaticDecodePlan, seq_ids: tuple, kv_lens: tuple[int, ...]) -> BatchPlan:
        """Write the decode step (lengths ``kv_lens`` after it) into ``into``; its plan."""
        pad_slot = self._pages[into.pad_seq][0] * self.page_size
        return into.stage(self._table, seq_ids, kv_lens, self._last_slots(seq_ids, kv_lens), pad_slot)

    def _decode_slots(self, seq_ids: tuple, q_lens: tuple[int, ...], kv_lens: tuple[int, ...]) -> list[int] | None:
        """A decode step's write slots (``BatchPlan.write_index``) from the host page lists:
        O(batch), where deriving them on the device takes a dozen ops. None for other steps
        (their slots are derived on the device) and caches of 2**31 token slots or more
        (the staged copy is int32)."""
        if self.num_pages * self.page_size >= 2**31 or q_lens.count(1) != len(q_lens):
            return None
        return self._last_slots(seq_ids, kv_lens)

    def _last_slots(self, seq_ids: tuple, kv_lens: tuple[int, ...]) -> list[int]:
        """The slot of each request's last token (of length ``kv_lens[b]``)."""
        page, pages = self.page_size, self._pages
        return [pages[s][(n - 1) // page] * page + (n - 1) % page for s, n in zip(seq_ids, kv_lens)]
