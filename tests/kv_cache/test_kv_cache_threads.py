"""PagedKVCache under concurrent use: request threads add, plan, append and release their own
sequences while an engine thread plans and runs batches of whatever is live. The page
accounting stays exact (free + owned = all pages, no page owned twice) and every plan's
device table holds exactly its sequences' pages."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from test_kv_cache import pages_of

from astrai.extension.kv_cache import CacheFullError, PagedKVCache

PAGES, PAGE, HKV, D = 600, 4, 2, 16


def check_accounting(cache, live):
    owned = [p for s in live for p in cache.page_table(s)]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert len(owned) + cache.free_pages == PAGES


def request_thread(cache, tid, rounds, errors):
    rng = random.Random(tid)
    try:
        for r in range(rounds):
            seq = (tid, r)
            cache.add_sequence(seq)
            for _ in range(rng.randint(1, 4)):
                n = rng.choice([1, 1, 1, 7])
                try:
                    plan = cache.plan([seq], [n])
                except CacheFullError:
                    break
                assert pages_of(plan) == [list(cache.page_table(seq))]
                k = torch.randn(n, HKV, D)
                cache.append(0, k, k, plan=plan)
            cache.release(seq)
    except Exception as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(exc)


def engine_thread(cache, live, live_lock, stop, errors):
    rng = random.Random(99)
    try:
        while not stop.is_set():
            with live_lock:
                batch = rng.sample(sorted(live), min(len(live), 4)) if live else []
            if not batch:
                continue
            try:
                plan = cache.plan(batch, [1] * len(batch))
            except CacheFullError:
                continue
            assert pages_of(plan) == [list(cache.page_table(s)) for s in batch]
            k = torch.randn(len(batch), HKV, D)
            cache.append(0, k, k, plan=plan)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)


def test_concurrent_requests_and_engine_keep_page_accounting_exact():
    cache = PagedKVCache(1, PAGES, PAGE, HKV, D, dtype=torch.float32)
    live = {("engine", i) for i in range(6)}  # long-lived sequences the engine keeps decoding
    for s in live:
        cache.add_sequence(s)
    live_lock, stop, errors = threading.Lock(), threading.Event(), []
    engine = threading.Thread(target=engine_thread, args=(cache, live, live_lock, stop, errors))
    requests = [threading.Thread(target=request_thread, args=(cache, t, 40, errors)) for t in range(6)]
    engine.start()
    for t in requests:
        t.start()
    for t in requests:
        t.join()
    stop.set()
    engine.join()
    assert not errors, errors[0]
    assert set(cache.sequences) == live
    check_accounting(cache, live)
    for s in live:
        cache.release(s)
    assert cache.free_pages == PAGES


def test_without_the_lock_the_same_schedule_breaks_the_accounting():
    """The test above can fail: with the lock replaced by a no-op, the same threads (made to
    switch often) corrupt the page accounting or the device table."""
    import contextlib
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        broken = 0
        for _ in range(3):
            cache = PagedKVCache(1, PAGES, PAGE, HKV, D, dtype=torch.float32)
            cache._lock = contextlib.nullcontext()
            errors = []
            threads = [threading.Thread(target=request_thread, args=(cache, t, 30, errors)) for t in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors or cache.free_pages != PAGES or len(set(cache._free)) != len(cache._free):
                broken += 1
        if not broken:
            pytest.skip("the interpreter never switched threads inside plan(): nothing to show here")
    finally:
        sys.setswitchinterval(old)
