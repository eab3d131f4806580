"""PagedKVCache and BatchPlan: metadata, writes/reads, paged attention vs contiguous."""

import doctest
import random

import pytest
import torch
from reference import attention_ref, tolerance

from astrai.extension.backend.attention import ATTN_BACKEND, attention, attn_backend
from astrai.extension.backend.attention.torch_native import sdpa
from astrai.extension import kv_cache as kv_cache_module
from astrai.extension.kv_cache import BatchPlan, CacheFullError, PagedKVCache

HQ, HKV, D = 8, 2, 64


def shuffled(n, seed):
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def make_cache(page_size, num_pages=None, layers=2, seed=0, dtype=torch.float32):
    num_pages = num_pages or (600 // page_size + 8)
    return PagedKVCache(layers, num_pages, page_size, HKV, D, dtype=dtype, page_order=shuffled(num_pages, seed))


class History:
    """Contiguous copies of every token written, per (layer, sequence), to compare against."""

    def __init__(self, layers, seqs):
        self.k = {(l, s): torch.empty(0, HKV, D) for l in range(layers) for s in seqs}
        self.v = dict(self.k)

    def add(self, layer, seq, k, v):
        self.k[layer, seq] = torch.cat([self.k[layer, seq], k])
        self.v[layer, seq] = torch.cat([self.v[layer, seq], v])


def step(cache, history, seqs, q_lens, gen, packed=True):
    """One batch: plan once, then every layer appends and attends. Returns per-layer (q, out)."""
    plan = cache.plan(seqs, q_lens)
    total = plan.total_q
    results = []
    for layer in range(cache.num_layers):
        q = torch.randn(total, HQ, D, generator=gen)
        k = torch.randn(total, HKV, D, generator=gen)
        v = torch.randn(total, HKV, D, generator=gen)
        for b, s in enumerate(seqs):
            rows = slice(plan.qo_indptr[b], plan.qo_indptr[b + 1])
            history.add(layer, s, k[rows], v[rows])
        if packed:
            args = (q[None], k[None], v[None])
        else:
            n = plan.uniform_q_len
            args = tuple(t.view(len(seqs), n, *t.shape[1:]) for t in (q, k, v))
        with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
            out = attention(*args, kv_cache=cache, layer_id=layer)
        assert out.shape == args[0].shape
        results.append((q, out.reshape(total, HQ, D)))
    return plan, results


def check_against_contiguous(plan, results, history, seqs):
    for layer, (q, out) in enumerate(results):
        assert torch.isfinite(out).all()
        for b, s in enumerate(seqs):
            rows = slice(plan.qo_indptr[b], plan.qo_indptr[b + 1])
            k, v = history.k[layer, s][None], history.v[layer, s][None]
            assert k.shape[1] == plan.kv_lens_host[b]
            qb = q[rows][None]
            expected = attention_ref(qb, k, v, is_causal=True)[0]
            torch.testing.assert_close(out[rows].double(), expected, **tolerance(torch.float32))
            # and the dense fallback on the contiguous K/V agrees too
            torch.testing.assert_close(out[rows], sdpa(qb, k, v, is_causal=True)[0], atol=1e-5, rtol=1e-5)


def pages_of(plan):
    """Each request's page ids as the kernels read them: ceil(kv_len / page) entries from
    kv_indptr[b], inside the request's span (kv_indptr monotone, ending at len(kv_indices))."""
    indptr, indices = plan.kv_indptr.tolist(), plan.kv_indices.tolist()
    assert indptr[0] == 0 and indptr[-1] == len(indices)
    assert all(a <= b for a, b in zip(indptr, indptr[1:]))
    out = []
    for b, n in enumerate(plan.kv_lens.tolist()):
        used = -(-n // plan.page_size)
        assert indptr[b] + used <= indptr[b + 1]
        out.append(indices[indptr[b]:indptr[b] + used])
    return out


def test_plan_metadata_of_the_spec_example():
    cache = PagedKVCache(1, 32, 16, HKV, D, dtype=torch.float32, page_order=shuffled(32, 1))
    for s in "abc":
        cache.add_sequence(s)
    plan = cache.plan(["a", "b", "c"], [70, 10, 130])
    assert plan.qo_indptr.tolist() == [0, 70, 80, 210]
    to_batch, to_index = plan.q_tiles(64)  # the kernels' tile size, Q_TILE_ROWS of the plugin modules
    # the order the blocks start in: the requests last-first, each request's tiles last-first
    assert to_batch.tolist() == [2, 2, 2, 1, 0, 0] and to_index.tolist() == [2, 1, 0, 0, 1, 0]
    assert [t.tolist() for t in plan.q_tiles(128)] == [[2, 2, 1, 0], [1, 0, 0, 0]]
    assert plan.q_tiles(64)[0] is to_batch  # built once per tile size
    assert plan.kv_lens.tolist() == [70, 10, 130]
    order = shuffled(32, 1)
    want = [order[:5], order[5:6], order[6:15]]  # ceil(70/16), ceil(10/16), ceil(130/16) pages
    assert pages_of(plan) == want
    assert [cache.page_table(s) for s in "abc"] == [tuple(p) for p in want]
    for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, to_batch, to_index):
        assert t.dtype == torch.int32 and t.device == cache.device
    assert plan.q_lens_host == (70, 10, 130) and plan.kv_lens_host == (70, 10, 130)
    assert (plan.total_q, plan.max_q_len, plan.is_decode) == (210, 130, False)
    # the next decode step: one token each, lengths advance, a new page only where one filled up
    cache.plan(["a", "b", "c"], [1, 1, 1])
    plan = cache.active_plan
    assert plan.kv_lens.tolist() == [71, 11, 131] and plan.is_decode
    assert pages_of(plan) == want
    assert [t.tolist() for t in plan.q_tiles(64)] == [[0, 1, 2], [0, 0, 0]]


def test_a_decode_steps_write_slots_are_those_the_device_derives():
    """A decode plan's write slots come from the host page lists (O(batch)); every step, across
    page boundaries and batch changes, they equal the device derivation from the page table."""
    cache = PagedKVCache(1, 64, 4, HKV, D, dtype=torch.float32, page_order=shuffled(64, 3))
    for s in "abcd":
        cache.add_sequence(s)
    cache.plan(["a", "b", "c"], [5, 1, 8])
    batches = [["a", "b", "c"]] * 6 + [["c", "a"]] * 3 + [["d"]] + [["a", "b", "c", "d"]] * 5
    for ids in batches:
        plan = cache.plan(ids, [1] * len(ids))
        assert "write_index" in plan.__dict__  # made by plan() itself
        derived = BatchPlan.write_index.func(plan)
        assert plan.write_index.dtype == torch.int64 and plan.write_index.device == cache.device
        assert plan.write_index.tolist() == derived.tolist()
        page = [cache.page_table(s)[(cache.seq_len(s) - 1) // 4] for s in ids]
        assert plan.write_index.tolist() == [p * 4 + (cache.seq_len(s) - 1) % 4 for p, s in zip(page, ids)]
    prefill = cache.plan(["a", "d"], [3, 1])
    assert "write_index" not in prefill.__dict__  # other steps derive theirs on the device
    assert prefill.write_index.tolist() == BatchPlan.write_index.func(prefill).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_ragged_prefill_then_decode_matches_contiguous(page_size):
    seqs = ["a", "b", "c"]
    cache = make_cache(page_size, seed=page_size)
    history = History(cache.num_layers, seqs)
    for s in seqs:
        cache.add_sequence(s)
    gen = torch.Generator().manual_seed(page_size)
    # prefill with ragged q lengths; then chunked prefill (q_len != kv_len); then decode steps
    for q_lens in ([70, 10, 130], [3, 17, 1], [1, 1, 1], [1, 1, 1]):
        plan, results = step(cache, history, seqs, q_lens, gen)
        check_against_contiguous(plan, results, history, seqs)
    assert plan.is_decode and plan.kv_lens_host == (75, 29, 133)
    # pages are not contiguous: the page table really is shuffled
    assert cache.page_table("a") != tuple(sorted(cache.page_table("a")))


def test_uniform_batch_layout_matches_packed():
    seqs = [0, 1]
    results = {}
    for packed in (True, False):
        cache = make_cache(4, seed=9)
        history = History(cache.num_layers, seqs)
        for s in seqs:
            cache.add_sequence(s)
        gen = torch.Generator().manual_seed(5)
        outs = []
        for q_lens in ([12, 12], [1, 1]):
            plan, res = step(cache, history, seqs, q_lens, gen, packed=packed)
            check_against_contiguous(plan, res, history, seqs)
            outs.append(res)
        results[packed] = outs
    for a, b in zip(results[True], results[False]):
        for (_, oa), (_, ob) in zip(a, b):
            torch.testing.assert_close(oa, ob)


def test_decode_fwd_flag_and_non_causal_prefill():
    cache = make_cache(16, layers=1)
    cache.add_sequence("x")
    gen = torch.Generator().manual_seed(1)
    plan = cache.plan(["x"], [20])
    q, k, v = (torch.randn(1, 20, h, D, generator=gen) for h in (HQ, HKV, HKV))
    out = attention(q, k, v, kv_cache=cache, layer_id=0, fwd="prefill", is_causal=False)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v), **tolerance(torch.float32))
    cache.plan(["x"], [1])
    q1, k1, v1 = (torch.randn(1, 1, h, D, generator=gen) for h in (HQ, HKV, HKV))
    out = attention(q1, k1, v1, kv_cache=cache, layer_id=0, fwd="decode")
    expected = attention_ref(q1, torch.cat([k, k1], 1), torch.cat([v, v1], 1))
    torch.testing.assert_close(out.double(), expected, **tolerance(torch.float32))


def test_writes_land_in_the_pages_and_gather_reads_them_back():
    cache = make_cache(3, layers=2, seed=4)
    for s in ("p", "q"):
        cache.add_sequence(s)
    gen = torch.Generator().manual_seed(0)
    plan = cache.plan(["p", "q"], [5, 2])
    k = torch.randn(7, HKV, D, generator=gen)
    v = torch.randn(7, HKV, D, generator=gen)
    cache.append(1, k, v)
    flat_k, flat_v = cache.gather_flat(1)
    torch.testing.assert_close(flat_k, k)
    torch.testing.assert_close(flat_v, v)
    pk, pv, valid = cache.gather_padded(1)
    assert valid.tolist() == [[True] * 5, [True, True, False, False, False]]
    torch.testing.assert_close(pk[1, :2], k[5:])
    # token t of sequence "p" lives in page page_table[t // 3], slot t % 3
    pages = cache.page_table("p")
    for t in range(5):
        torch.testing.assert_close(cache.k_cache(1)[pages[t // 3], t % 3], k[t])
    assert plan.cu_seqlens_kv.tolist() == [0, 5, 7]


def test_allocator_errors_and_release():
    cache = PagedKVCache(2, 4, 2, HKV, D, dtype=torch.float32)
    cache.add_sequence("a")
    cache.add_sequence("b")
    with pytest.raises(ValueError, match="seq_id 'a' is already"):
        cache.add_sequence("a")
    with pytest.raises(KeyError, match="seq_id 'zz' is not in the cache"):
        cache.plan(["a", "zz"], [1, 1])
    with pytest.raises(ValueError, match="seq_ids has duplicates"):
        cache.plan(["a", "a"], [1, 1])
    with pytest.raises(ValueError, match="q_lens has 1 entries but seq_ids has 2"):
        cache.plan(["a", "b"], [1])
    with pytest.raises(ValueError, match="q_lens must be ints >= 1"):
        cache.plan(["a"], [0])
    with pytest.raises(RuntimeError, match="no active plan"):
        cache.active_plan
    cache.plan(["a"], [5])  # 3 pages of 2
    with pytest.raises(CacheFullError, match="needs 2 more pages of 2 tokens, 1 of 4 are free"):
        cache.plan(["a", "b"], [1, 3])
    assert cache.seq_len("a") == 5 and cache.seq_len("b") == 0 and cache.free_pages == 1  # nothing reserved
    cache.release("a")
    assert cache.free_pages == 4 and cache.sequences == ("b",)
    with pytest.raises(RuntimeError, match="no active plan"):
        cache.active_plan  # the plan referenced a released sequence
    plan = cache.plan(["b"], [8])
    assert [len(p) for p in pages_of(plan)] == [4]
    assert sorted(cache.page_table("b")) == [0, 1, 2, 3]  # a's pages came back and went to b
    with pytest.raises(ValueError, match="layer_id 2 is out of range: the cache holds 2 layers"):
        cache.k_cache(2)
    with pytest.raises(ValueError, match="layer_id -1 is out of range"):
        cache.append(-1, torch.randn(8, HKV, D), torch.randn(8, HKV, D))
    with pytest.raises(ValueError, match=r"k has shape \(7, 2, 64\)"):
        cache.append(0, torch.randn(7, HKV, D), torch.randn(7, HKV, D))
    with pytest.raises(TypeError, match="v has dtype torch.float64"):
        cache.append(0, torch.randn(8, HKV, D), torch.randn(8, HKV, D, dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(page_size=0), ValueError, "page_size must be >= 1"),
        (dict(num_layers=1.5), TypeError, "num_layers must be an int"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating"),
        (dict(page_order=[0, 0, 1, 2]), ValueError, "page_order must be a permutation"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    args = dict(num_layers=1, num_pages=4, page_size=2, kv_heads=HKV, head_dim=D) | kwargs
    with pytest.raises(error, match=match):
        PagedKVCache(**args)


def test_plan_is_frozen():
    cache = PagedKVCache(1, 4, 2, HKV, D, dtype=torch.float32)
    cache.add_sequence(0)
    plan = cache.plan([0], [3])
    assert isinstance(plan, BatchPlan)
    with pytest.raises(AttributeError):
        plan.kv_lens = None


def test_docstring_example_runs():
    result = doctest.testmod(kv_cache_module)
    assert result.attempted >= 5 and result.failed == 0


def test_keep_mask_is_built_once_per_plan():
    cache = PagedKVCache(1, 8, 2, HKV, D, dtype=torch.float32)
    for s in (0, 1):
        cache.add_sequence(s)
    cache.plan([0, 1], [2, 1])
    plan = cache.plan([0, 1], [3, 1])  # kv_lens 5 and 2
    keep = plan.keep_mask(causal=True)
    assert keep is plan.keep_mask(causal=True)
    assert keep[0].tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    assert keep[1, 0].tolist() == [True, True, False, False, False]  # rows 1, 2 of request 1 are padding
    assert plan.keep_mask(causal=False)[0].all() and plan.keep_mask(causal=False)[1, 0].tolist() == [True, True] + [False] * 3
    index, valid = plan.q_padded_index
    assert index.tolist() == [[0, 1, 2], [3, 0, 0]] and valid.tolist() == [[True] * 3, [True, False, False]]


def test_q_tiles_start_with_the_last_request_and_each_requests_last_tile():
    from astrai.extension.batch_plan import q_tile_schedule

    tb, ti = q_tile_schedule((70, 10, 130, 64), 64)
    assert list(zip(tb, ti)) == [(3, 0), (2, 2), (2, 1), (2, 0), (1, 0), (0, 1), (0, 0)]
    assert q_tile_schedule((1, 1, 1), 64) == ([0, 1, 2], [0, 0, 0])  # decode: one tile per request, as is
