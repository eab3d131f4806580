"""Checks of decode steps planned into a :class:`~astrai.extension.StaticDecodePlan` (the
CPU and GPU tests share them)."""

from __future__ import annotations

import random

from astrai.extension import BatchPlan


def check_full_rows(cache, static, seq_ids) -> None:
    """The ``size`` rows a graph's kernels read: the requests' (their page tables, lengths,
    slots and positions), then pad rows of one token on the pad sequence's first page."""
    n, pad, size = len(seq_ids), static.size - len(seq_ids), static.size
    pad_page = cache.page_table(static.pad_seq)[0]
    assert static.qo_indptr.tolist() == list(range(size + 1))
    assert static.kv_indptr.tolist() == [b * static.max_pages for b in range(size + 1)]
    assert static.kv_lens.tolist() == [cache.seq_len(s) for s in seq_ids] + [1] * pad
    table = static.kv_indices.view(size, static.max_pages).tolist()
    for b, s in enumerate(seq_ids):
        assert table[b][: len(cache.page_table(s))] == list(cache.page_table(s))
    assert all(row[0] == pad_page for row in table[n:])
    slots = [cache.page_table(s)[(cache.seq_len(s) - 1) // cache.page_size] * cache.page_size
             + (cache.seq_len(s) - 1) % cache.page_size for s in seq_ids]
    assert static.write_index.tolist() == slots + [pad_page * cache.page_size] * pad
    assert static.token_positions.tolist() == [cache.seq_len(s) - 1 for s in seq_ids] + [0] * pad


def random_static_steps(cache, static, ids, steps: int, seed: int, ordinary_between: float = 0.3) -> None:
    """Decode steps of random batches planned into ``static`` (crossing page boundaries now
    and then), each checked, with ordinary plans of random chunks in between; the buffers
    never move."""
    where = [t.data_ptr() for t in (static.kv_indptr, static.kv_indices, static.kv_lens, static.write_index)]
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(ids, rng.randint(1, min(static.size, len(ids))))
        plan = cache.plan(batch, [1] * len(batch), into=static)
        assert plan.kv_lens_host == tuple(cache.seq_len(s) for s in batch)
        assert plan.write_index.tolist() == BatchPlan.write_index.func(plan).tolist()
        check_full_rows(cache, static, batch)
        assert [t.data_ptr() for t in (static.kv_indptr, static.kv_indices, static.kv_lens,
                                       static.write_index)] == where
        if rng.random() < ordinary_between:  # a prefill chunk: it must see the same table
            other = rng.sample(ids, 3)
            eager = cache.plan(other, [rng.randint(1, 5) for _ in other])
            width = eager.kv_indptr[1].item()
            for b, s in enumerate(other):
                pages = list(cache.page_table(s))
                assert eager.kv_indices[b * width: b * width + len(pages)].tolist() == pages
