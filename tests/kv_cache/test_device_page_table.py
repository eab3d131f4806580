"""The cache's device-resident page table: what the kernels read always equals the host's
page lists, through growth, reuse of rows, changing batches; and a decode step stages
O(batch) values whatever the context length."""

from __future__ import annotations

import random

import pytest
import torch
from test_kv_cache import pages_of

from astrai.extension.device_page_table import DevicePageTable
from astrai.extension.kv_cache import PagedKVCache


def check_plan(cache, plan):
    assert pages_of(plan) == [list(cache.page_table(s)) for s in plan.seq_ids]
    assert plan.kv_lens.tolist() == [cache.seq_len(s) for s in plan.seq_ids]


@pytest.mark.parametrize("seed", range(6))
def test_random_schedule_keeps_device_table_equal_to_host_pages(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 3, 16])
    cache = PagedKVCache(1, 4000, page, 1, 8, dtype=torch.float32, page_order=rng.sample(range(4000), 4000))
    live: list[int] = []
    next_id, last = 0, None
    for _ in range(120):
        action = rng.random()
        if action < 0.15 or not live:  # a request joins (more than the table's first rows)
            cache.add_sequence(next_id)
            live.append(next_id)
            next_id += 1
            continue
        if action < 0.25 and len(live) > 1:  # a request finishes
            gone = live.pop(rng.randrange(len(live)))
            cache.release(gone)
            last = None if last is not None and gone in last else last
            continue
        if action < 0.6 and last is not None:  # the same batch decodes again
            seqs = last
        else:  # a new batch: a random subset in a random order
            seqs = rng.sample(live, rng.randint(1, len(live)))
        q_lens = [1 if rng.random() < 0.7 else rng.randint(1, 40) for _ in seqs]
        plan = cache.plan(seqs, q_lens)
        check_plan(cache, plan)
        last = seqs
    assert next_id > 8  # the table grew rows; and with page 1 it grew columns
    owned = [p for s in live for p in cache.page_table(s)]
    assert sorted(owned) == sorted(set(owned)) and len(owned) + cache.free_pages == 4000


def test_a_decode_step_of_the_same_batch_patches_the_rows_in_place():
    cache = PagedKVCache(1, 64, 4, 1, 8, dtype=torch.float32)
    for s in (0, 1):
        cache.add_sequence(s)
    cache.plan([0, 1], [3, 4])
    first = cache.plan([0, 1], [1, 1])  # 4, 5 tokens: request 1 crosses into a second page
    second = cache.plan([0, 1], [1, 1])
    assert second.kv_indices.data_ptr() == first.kv_indices.data_ptr()  # no regather
    check_plan(cache, second)
    cache.release(0)
    cache.add_sequence(2)
    third = cache.plan([1, 2], [1, 2])  # a new batch: gathered again from the table
    check_plan(cache, third)


def test_decode_stages_o_batch_values_whatever_the_context(monkeypatch):
    staged = []
    original = DevicePageTable.stage

    def recording(self, seq_ids, head):
        flat, parts = original(self, seq_ids, head)
        staged.append(flat.numel())
        return flat, parts

    monkeypatch.setattr(DevicePageTable, "stage", recording)
    sizes = {}
    for context in (64, 4096):
        cache = PagedKVCache(1, 8 * (context // 16 + 4), 16, 1, 8, dtype=torch.float32)
        seqs = list(range(8))
        for s in seqs:
            cache.add_sequence(s)
        cache.plan(seqs, [context - 1] * 8)
        staged.clear()
        for _ in range(32):  # two page boundaries crossed by every request
            check_plan(cache, cache.plan(seqs, [1] * 8))
        sizes[context] = list(staged)
    assert sizes[64] == sizes[4096]
    assert max(sizes[64]) <= 8 * 5 + 2 + 3 * 8  # the plan's arrays + one new page per request
