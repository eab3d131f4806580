"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A graph reads fixed buffers: the step's tokens, and the plan tensors of the bucket's
:class:`~astrai.extension.StaticDecodePlan` (``kv_indptr``, ``kv_indices``, ``kv_lens``, the
write slots and positions; ``qo_indptr`` is ``0..B`` for every decode step). A real step is
planned straight into them (``kv_cache.step(ids, [1] * n, into=graphs.static_plan(n))``,
which also reserves the pages): one host->device copy and two small kernels, no plan of its
own. Rows past the real batch read and write one token of the pad sequence's first page.

Capture plans are made through the cache's public methods on throw-away sequences of
``max_seq_pages`` pages each (fewer when the free pages do not suffice), so the capture
step's longest request is as long as any real step's: the decode kernel sizes its split-KV
schedule from it, so it is kept no longer than needed. Capture needs an otherwise empty
cache; the engine captures before serving.

On a cache that releases the pages left of its window (``PagedKVCache(window=W)``) a real
step's page table counts the released columns too (they point at the null page), so the
throw-away sequences grow to ``max_seq_pages`` columns a page per plan, releasing as they
go: each holds only the pages of ``W`` keys and a page at once.

Ownership: whatever a graph reads or writes lives as long as the graph. The :class:`_Graph`
that replays it holds its tokens and outputs and the bucket's static plan; the static plan
owns the step metadata and the decode launch's split-K workspaces (a capture step's
``BatchPlan`` is dropped once captured). Each capture is checked before and after
(``StaticDecodePlan.check_graph_safe``): a launch holding memory of its own raises.

An FP8 cache's scales must be set (or calibrated) on every layer before a capture
(:func:`require_kv_scales`): the capture's warm-up step would calibrate them on its filler
tokens, and a graph captured over a layer without scales would replay its calibration. A
graph reads the scale tensors by address; the cache updates them in place only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..extension import BatchPlan, PagedKVCache, StaticDecodePlan, explain
from ..extension.backend.attention import current_attn_backend
from .greedy import greedy_tokens

__all__ = ["DEFAULT_BUCKETS", "DecodeGraphs", "capture_pages", "grow", "held_while_growing",
           "require_kv_scales"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, positions) -> logits [B, vocab]


def _require_graph_safe_attention(cache: PagedKVCache) -> None:
    """The paged decode kernel reads only device metadata; the torch fallback sizes its
    gathers from the plan's host lengths, which a replay would not update. Looks at the
    decisions for calls over caches like ``cache`` (the warm-up step just made one): same
    dtypes (of the pages too) and geometry, and made as the engine's are (a backend forced
    with ``attn_backend`` elsewhere in the process, e.g. a comparison against torch, is not
    the engine's unless one is forced now)."""
    forced = current_attn_backend() is not None
    chosen = {d.chosen for d in explain("attention")
              if d.key.paged and d.key.mode == "decode" and d.key.device.type == "cuda"
              and d.key.dtype == cache.dtype and (d.key.kv_dtype or d.key.dtype) == cache.kv_dtype
              and d.key.head_dim == cache.head_dim and d.key.kv_heads == cache.kv_heads
              and d.key.page_size == cache.page_size and (forced or d.source != "explicit")}
    if chosen - {"cuda"}:
        raise RuntimeError(f"decode attention runs on {sorted(chosen)}, not the CUDA kernels: "
                           "CUDA graphs need the astrai-attention plugin")


def require_kv_scales(cache: PagedKVCache) -> None:
    """Raise ``ValueError`` naming the layers of an FP8 ``cache`` whose scales are not set yet."""
    if cache.kv_dtype == cache.dtype:
        return
    missing = [i for i in range(cache.num_layers) if cache.kv_scales(i) is None]
    if missing:
        raise ValueError(
            f"the FP8 kv_cache has no K/V scales for layers {missing}: set them (set_kv_scales) or calibrate them "
            "on a real prefill step before capturing decode graphs (the capture's warm-up step would calibrate "
            "them on filler tokens)")


def capture_pages(free: int, size: int, max_seq_pages: int, held_pages: int | None = None) -> list[int]:
    """Pages (page-table columns) of each throw-away sequence a graph of ``size`` requests is
    captured with: ``max_seq_pages`` each, or every free page shared out when they are fewer.
    ``held_pages``: the pages one of them holds at once on a cache releasing the pages left of
    its window (None: all of its columns)."""
    held = max_seq_pages if held_pages is None else min(held_pages, max_seq_pages)
    if free >= size * held:
        return [max_seq_pages] * size
    return [free // size + (b < free % size) for b in range(size)]


def held_while_growing(window: int | None, page_size: int) -> int | None:
    """The most pages a throw-away sequence grown by :func:`grow` (then decoded) holds at once
    on a cache releasing the pages left of ``window``: a decode step's, ``ceil((window + 1) /
    page_size) + 1`` (a page per plan from an aligned start holds no more); None: every page."""
    return None if window is None else -(-(window + 1) // page_size) + 1


def grow(cache: PagedKVCache, seq_ids: list, lengths: list[int]) -> None:
    """Plan (reserve: no layer writes) ``lengths`` tokens of the empty ``seq_ids``: in one plan,
    or a page per plan on a cache with a ``window`` (each plan releases the pages left of it)."""
    if cache.window is None:
        cache.plan(seq_ids, lengths)
        return
    done = [0] * len(seq_ids)
    while any(d < n for d, n in zip(done, lengths)):
        todo = [b for b, (d, n) in enumerate(zip(done, lengths)) if d < n]
        q_lens = [min(cache.page_size, lengths[b] - done[b]) for b in todo]
        cache.plan([seq_ids[b] for b in todo], q_lens)
        for b, n in zip(todo, q_lens):
            done[b] += n


class _Graph:
    def __init__(self, size: int, graph: torch.cuda.CUDAGraph, static: StaticDecodePlan, tokens: torch.Tensor,
                 logits: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.size = size
        self.graph = graph
        self.static = static
        self.tokens = tokens
        self.logits = logits
        self.next_tokens = next_tokens


class DecodeGraphs:
    """Captures ``forward`` for every bucket up to ``max_batch_size``; :meth:`run` replays one."""

    def __init__(self, forward: Forward, kv_cache: PagedKVCache, pad_seq, max_batch_size: int,
                 max_seq_pages: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        """``pad_seq``: a sequence of ``kv_cache`` holding a token, kept while the graphs live;
        rows past a step's requests read and write only its first page."""
        require_kv_scales(kv_cache)
        if kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA kv_cache, got one on {kv_cache.device}")
        self.kv_cache = kv_cache
        self.pad_seq = pad_seq
        self.max_seq_pages = max_seq_pages
        sizes = sorted({b for b in buckets if b < max_batch_size} | {max_batch_size})
        self.sizes = tuple(sizes)
        self._graphs: dict[int, _Graph] = {}
        self.replays = 0
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(sizes):  # largest first: the smaller graphs reuse its memory pool
            self._graphs[size] = self._capture(forward, size, pool)

    def bucket(self, batch: int) -> int | None:
        """The smallest captured size holding ``batch`` requests, or None when none does."""
        return next((s for s in self.sizes if s >= batch), None)

    def static_plan(self, batch: int) -> StaticDecodePlan | None:
        """The buffers a decode step of ``batch`` requests is planned into (``into=``) to be
        replayed by :meth:`run`; None when no graph holds that many."""
        size = self.bucket(batch)
        return None if size is None else self._graphs[size].static

    def _capture(self, forward: Forward, size: int, pool) -> _Graph:
        cache = self.kv_cache
        ps = cache.page_size
        free = cache.free_pages
        if free < size or free * ps < 3 * size:
            raise ValueError(f"the kv_cache needs at least {max(size, -(-3 * size // ps))} free pages to capture "
                             f"a decode graph of {size} requests, it has {free}")
        pages = capture_pages(free, size, self.max_seq_pages, held_while_growing(cache.window, ps))
        ids = [("__capture__", size, b) for b in range(size)]
        for s in ids:
            cache.add_sequence(s)
        try:
            grow(cache, ids, [n * ps - 2 for n in pages])
            device = cache.device
            static = cache.static_decode_plan(size, self.max_seq_pages, self.pad_seq)
            tokens = torch.zeros(size, dtype=torch.long, device=device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                # warm-up step (lazy initialisations happen outside the capture), on the buffers
                warm = cache.plan(ids, [1] * size, into=static)
                cache.prepare(warm)
                greedy_tokens(forward(tokens, warm.token_positions))
            torch.cuda.current_stream(device).wait_stream(stream)
            _require_graph_safe_attention(cache)
            plan = cache.plan(ids, [1] * size, into=static)  # a fresh plan of the same buffers
            cache.prepare(plan)  # the decode launch (split count, workspaces), made outside the graph
            static.check_graph_safe(plan)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward(tokens, plan.token_positions)
                next_tokens = greedy_tokens(logits)
            static.check_graph_safe(plan)  # launches first built inside the capture too
        finally:
            for s in ids:
                cache.release(s)
        return _Graph(size, graph, static, tokens, logits, next_tokens)

    def run(self, plan: BatchPlan, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket of ``plan``, a decode step of the real requests planned into its
        buffers (``kv_cache.step(..., into=self.static_plan(n))``); returns views
        ``(next_tokens [n], logits [n, vocab])`` of the graph's outputs, valid until the next
        replay of any bucket (the buckets share one memory pool: another bucket's replay may
        write where this one's outputs lie); copy them to keep them."""
        n = plan.batch_size
        g = self._graphs[self.bucket(n)]
        if plan.kv_lens.data_ptr() != g.static.kv_lens.data_ptr():
            raise ValueError(f"the decode plan of {n} requests was not planned into this graph's buffers: plan it "
                             "with kv_cache.plan(..., into=graphs.static_plan(n))")
        g.tokens[:n].copy_(tokens, non_blocking=True)  # pad rows keep earlier tokens: any id is valid there
        g.graph.replay()
        self.kv_cache.mark_written(None, plan)  # the replay wrote every layer's pages
        self.replays += 1
        return g.next_tokens[:n], g.logits[:n]
