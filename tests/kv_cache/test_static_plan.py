"""Decode steps planned into fixed buffers (what a CUDA graph reads): every row the kernels
read equals an ordinary plan's, pad rows touch only the pad sequence's first page, the
buffers never move, and a step that does not fit changes nothing."""

from __future__ import annotations

import doctest
import random

import pytest
import torch
from static_plans import check_full_rows, random_static_steps
from test_kv_cache import pages_of

from astrai.extension import BatchPlan, PagedKVCache, StaticDecodePlan
from astrai.extension.device_page_table import DevicePageTable

PAGE = 4


def cache_with_pad(num_pages=120, page=PAGE, window=None, seed=0):
    order = random.Random(seed).sample(range(num_pages), num_pages)  # scattered page tables
    cache = PagedKVCache(1, num_pages, page, 1, 8, dtype=torch.float32, page_order=order, window=window)
    cache.add_sequence("pad")
    cache.plan(["pad"], [1])
    return cache


def test_a_static_step_equals_an_ordinary_plan_of_the_same_requests():
    cache = cache_with_pad()
    static = cache.static_decode_plan(4, 6, "pad")
    ids = ["a", "b", "c"]
    for s, n in zip(ids, [9, 1, 14]):
        cache.add_sequence(s)
        cache.plan([s], [n])
    plan = cache.plan(ids, [1, 1, 1], into=static)
    assert cache.active_plan is plan and plan.kv_lens_host == (10, 2, 15) and plan.is_decode
    assert pages_of(plan) == [list(cache.page_table(s)) for s in ids]
    assert plan.kv_lens.tolist() == [10, 2, 15]
    assert plan.write_index.tolist() == BatchPlan.write_index.func(plan).tolist()
    assert plan.token_positions.tolist() == [9, 1, 14] == BatchPlan.token_positions.func(plan).tolist()
    check_full_rows(cache, static, ids)
    assert not plan.launches  # the backends' preparations are the caller's (prepare)


def test_the_buffers_stay_put_while_requests_grow_pages_and_the_table_grows():
    cache = cache_with_pad(num_pages=400)
    static = cache.static_decode_plan(8, 30, "pad")
    ids = list(range(12))  # more sequences than the table's first rows
    for s in ids:
        cache.add_sequence(s)
        cache.plan([s], [1 + 3 * s])
    random_static_steps(cache, static, ids, steps=40, seed=1)


def test_a_step_that_does_not_fit_changes_nothing():
    cache = cache_with_pad()
    static = cache.static_decode_plan(2, 3, "pad")
    for s, n in (("a", 12), ("b", 3), ("c", 3)):
        cache.add_sequence(s)
        cache.plan([s], [n])
    free = cache.free_pages
    with pytest.raises(ValueError, match=r"does not fit the static plan \(2 requests, 3 pages each\)"):
        cache.plan(["a"], [1], into=static)  # 13 tokens: a fourth page
    assert cache.seq_len("a") == 12 and cache.free_pages == free
    with pytest.raises(ValueError, match="the static plan holds 2"):
        cache.plan(["a", "b", "c"], [1, 1, 1], into=static)
    with pytest.raises(ValueError, match="into= takes decode steps"):
        cache.plan(["b"], [2], into=static)
    other = cache_with_pad().static_decode_plan(2, 3, "pad")
    with pytest.raises(TypeError, match="StaticDecodePlan of this cache"):
        cache.plan(["b"], [1], into=other)
    assert cache.seq_len("b") == 3 and cache.free_pages == free
    plan = cache.plan(["b", "c"], [1, 1], into=static)  # still usable
    check_full_rows(cache, static, plan.seq_ids)


def test_bad_static_plan_arguments_are_named():
    cache = cache_with_pad()
    cache.add_sequence("empty")
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        cache.static_decode_plan(0, 4, "pad")
    with pytest.raises(ValueError, match="max_pages must be an int >= 1"):
        cache.static_decode_plan(2, 1.5, "pad")
    with pytest.raises(KeyError, match="'nobody' is not in the cache"):
        cache.static_decode_plan(2, 4, "nobody")
    with pytest.raises(ValueError, match="owns no page"):
        cache.static_decode_plan(2, 4, "empty")
    static = cache.static_decode_plan(2, 4, "pad")
    cache.add_sequence("a")
    cache.plan(["a"], [2])
    cache.release("pad")
    with pytest.raises(ValueError, match="pad_seq 'pad' was released"):
        cache.plan(["a"], [1], into=static)


def test_a_failed_static_step_rolls_back_and_the_retry_stages_the_same_tokens():
    cache = cache_with_pad()
    static = cache.static_decode_plan(2, 8, "pad")
    cache.add_sequence("a")
    cache.plan(["a"], [PAGE])  # the next token opens a page
    with pytest.raises(RuntimeError, match="boom"):
        with cache.step(["a"], [1], into=static):
            raise RuntimeError("boom")
    assert cache.seq_len("a") == PAGE and len(cache.page_table("a")) == 1
    with cache.step(["a"], [1], into=static) as plan:
        cache.mark_written(None, plan)
    assert cache.seq_len("a") == PAGE + 1 and pages_of(plan) == [list(cache.page_table("a"))]
    check_full_rows(cache, static, ["a"])


def test_a_window_cache_stages_its_released_columns_as_the_null_page():
    cache = cache_with_pad(window=2 * PAGE)
    static = cache.static_decode_plan(2, 10, "pad")
    cache.add_sequence("a")
    cache.plan(["a"], [3 * PAGE])
    for _ in range(2 * PAGE):
        plan = cache.plan(["a"], [1], into=static)
        assert pages_of(plan) == [list(cache.page_table("a"))]
    assert cache.page_table("a")[0] == cache.null_page  # released left of the window, staged as it is
    check_full_rows(cache, static, ["a"])


def test_more_pending_entries_than_a_decode_step_adds_take_a_copy_of_their_own():
    table = DevicePageTable(torch.device("cpu"))
    static = StaticDecodePlan(2, 40, PAGE, "pad", torch.device("cpu"))
    for s in ("pad", "a"):
        table.add(s)
    table.add_pages("pad", 0, [7])
    table.add_pages("a", 0, list(range(100, 130)))  # 31 pending entries, room for 4
    plan = static.stage(table, ("a",), (30 * PAGE,), [129 * PAGE + 3], 7 * PAGE)
    assert plan.kv_indices.tolist()[:30] == list(range(100, 130))
    assert static.kv_indices.view(2, 40)[1, 0].item() == 7
    assert plan.write_index.tolist() == [129 * PAGE + 3] and plan.token_positions.tolist() == [30 * PAGE - 1]


def test_an_ordinary_plan_of_the_same_batch_after_static_steps_sees_their_pages():
    cache = cache_with_pad()
    static = cache.static_decode_plan(2, 8, "pad")
    for s in ("a", "b"):
        cache.add_sequence(s)
    cache.plan(["a", "b"], [PAGE - 1, 2])
    cache.plan(["a", "b"], [1, 1])  # ordinary: gathers the batch's rows
    cache.plan(["a", "b"], [1, 1], into=static)  # "a" opens its second page
    plan = cache.plan(["a", "b"], [1, 1])  # the same batch again, ordinarily
    assert len(cache.page_table("a")) == 2
    assert pages_of(plan) == [list(cache.page_table(s)) for s in ("a", "b")]


def test_docstring_example_runs():
    from astrai.extension import kv_static

    result = doctest.testmod(kv_static)
    assert result.attempted >= 5 and result.failed == 0
