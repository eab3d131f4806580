"""Seeded attention inputs, dense or in paged caches, whose edge keys carry visible weight.

With plain Gaussian inputs every key holds ~1/kv_len of the softmax: at kv 32768 a kernel
that drops the last key moves the output by ~1e-5, under bf16 rounding, so no tolerance
can see it. Here each (request, kv head) gets a random unit direction ``c``: the queries
lean towards it (``q += LEAN * c``) and the edge keys (the first, the last, the first slot
of the last page) point along it (``k += key_weight(kv_len) * c``), so that each takes
about ``SHARE`` of a typical row's softmax; over the rows (the query's own component
along ``c`` varies) the share spreads from ~0 to most of the row. Dropping, repeating or
misplacing an edge key then moves some rows by far more than rounding, while the other
keys still carry most of the weight.

Everything is drawn from a generator seeded by the case's parameters (``seed_of``), on the
device the tensors live on, so a case is the same on every run.
"""

from __future__ import annotations

import math
import zlib

import torch

LEAN = 3.0
SHARE = 0.05


def seed_of(*params) -> int:
    return zlib.crc32(repr(params).encode())


def generator(seed: int, device="cuda") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(gen: torch.Generator, shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device)


def directions(gen: torch.Generator, batch: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """One random unit vector per (request, kv head): ``[B, Hkv, D]`` float32."""
    c = randn(gen, (batch, kv_heads, head_dim))
    return c / c.norm(dim=-1, keepdim=True)


def lean_queries(q: torch.Tensor, c: torch.Tensor) -> None:
    """q ``[B, L, Hq, D]`` float32, in place: every head leans towards its kv head's direction."""
    q += LEAN * c.repeat_interleave(q.shape[2] // c.shape[1], dim=1)[:, None]


def key_weight(kv_len: int, head_dim: int) -> float:
    """Length along ``c`` that gives a key ~SHARE of a typical row over ``kv_len`` keys: its
    score is ``weight / sqrt(D) * (LEAN + N(0, 1))`` against ``N(0, 1 + LEAN^2 / D)`` for the
    others."""
    others = kv_len * math.exp((1 + LEAN**2 / head_dim) / 2)
    score = max(1.0, math.log(SHARE / (1 - SHARE) * others))
    return score * math.sqrt(head_dim) / LEAN


def edge_positions(kv_len: int, page: int | None = None) -> list[int]:
    """The first key, the last, and (paged) the first slot of the last page."""
    edges = {0, kv_len - 1}
    if page:
        edges.add((kv_len - 1) // page * page)
    return sorted(edges)


def weight_keys(k: torch.Tensor, c: torch.Tensor, page: int | None = None) -> None:
    """k ``[B, Lkv, Hkv, D]`` float32, in place: the edge keys point along ``c``."""
    kv_len = k.shape[1]
    k[:, edge_positions(kv_len, page)] += key_weight(kv_len, k.shape[3]) * c[:, None]


def store(x: torch.Tensor, dtype: torch.dtype, layout: str = "BLHD") -> torch.Tensor:
    """``x [B, L, H, D]`` in ``dtype``, stored BLHD or BHLD (a permuted view)."""
    x = x.to(dtype)
    return x.transpose(1, 2).contiguous().transpose(1, 2) if layout == "BHLD" else x


def dense_inputs(b, lq, lkv, hq, hkv, d, dtype, layout="BLHD", device="cuda", seed=0):
    """q ``[B, Lq, Hq, D]``, k/v ``[B, Lkv, Hkv, D]`` with weighted edge keys."""
    gen = generator(seed, device)
    c = directions(gen, b, hkv, d)
    q, k, v = randn(gen, (b, lq, hq, d)), randn(gen, (b, lkv, hkv, d)), randn(gen, (b, lkv, hkv, d))
    lean_queries(q, c)
    weight_keys(k, c)
    return store(q, dtype, layout), store(k, dtype, layout), store(v, dtype, layout)


def random_mask(gen: torch.Generator, shape, keep: float = 0.7) -> torch.Tensor:
    """Bool mask (True = keep) where every row keeps its first key."""
    m = torch.rand(*shape, generator=gen, device=gen.device) < keep
    m[..., 0] = True
    return m


def page_order(num_pages: int, order: str, gen: torch.Generator) -> torch.Tensor:
    if order == "shuffled":
        return torch.randperm(num_pages, generator=gen)
    perm = torch.arange(num_pages)
    if order == "half":
        half = num_pages // 2
        perm[half:] = half + torch.randperm(num_pages - half, generator=gen)
    elif order != "in_order":
        raise ValueError(f"order must be 'shuffled', 'in_order' or 'half', got {order!r}")
    return perm


class Paged:
    """A paged cache ``[P, page, Hkv, D]`` holding per-request K/V in shuffled pages; every
    slot no request owns (the rest of each last page, the spare pages) is NaN, so a kernel
    reading past a request's length fails. With ``directions`` (``[B, Hkv, D]``), each
    request's edge keys are weighted (see the module docstring). ``order``: "shuffled", or
    "in_order" (pages handed out in order, as a fresh cache does), or "half" (the first half
    of the pages in order, the rest shuffled)."""

    def __init__(self, kv_lens, page, hkv, d, dtype, device="cuda", spare_pages=3, seed=None, directions=None,
                 order="shuffled"):
        self.kv_lens_host = list(kv_lens)
        self.page = page
        seed = seed_of("paged", tuple(kv_lens), page, hkv, d, dtype, spare_pages) if seed is None else seed
        gen = generator(seed, device)
        counts = [-(-n // page) for n in kv_lens]
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        num_pages = indptr[-1] + spare_pages
        perm = page_order(num_pages, order, torch.Generator().manual_seed(seed))[: indptr[-1]]
        self.k_cache = torch.full((num_pages, page, hkv, d), math.nan, dtype=dtype, device=device)
        self.v_cache = torch.full((num_pages, page, hkv, d), math.nan, dtype=dtype, device=device)
        for b, n in enumerate(kv_lens):
            k, v = randn(gen, (1, n, hkv, d)), randn(gen, (1, n, hkv, d))
            if directions is not None:
                weight_keys(k, directions[b:b + 1], page)
            slots = self._slots(perm[indptr[b]: indptr[b + 1]], n).to(device)
            self.k_cache.view(-1, hkv, d)[slots] = k[0].to(dtype)
            self.v_cache.view(-1, hkv, d)[slots] = v[0].to(dtype)
        self.kv_indptr = torch.tensor(indptr, dtype=torch.int32, device=device)
        self.kv_indices = perm.to(torch.int32).to(device)
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)

    def _slots(self, pages: torch.Tensor, n: int) -> torch.Tensor:
        return (pages[:, None] * self.page + torch.arange(self.page)).flatten()[:n]

    def gather(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's K/V as contiguous ``[kv_len, Hkv, D]``."""
        n = self.kv_lens_host[b]
        pages = self.kv_indices[self.kv_indptr[b]: self.kv_indptr[b + 1]].long()
        k = self.k_cache[pages].flatten(0, 1)[:n]
        v = self.v_cache[pages].flatten(0, 1)[:n]
        return k, v


def paged_inputs(kv_lens, page, hq, hkv, d, dtype, q_lens=None, device="cuda", seed=0, order="shuffled"):
    """(q, cache): decode queries ``[B, 1, Hq, D]`` (``q_lens`` None) or ragged prefill rows
    ``[sum(q_lens), Hq, D]``, leaning towards the directions of their request's edge keys."""
    gen = generator(seed, device)
    c = directions(gen, len(kv_lens), hkv, d)
    cache = Paged(kv_lens, page, hkv, d, dtype, device, seed=seed + 1, directions=c, order=order)
    if q_lens is None:
        q = randn(gen, (len(kv_lens), 1, hq, d))
        lean_queries(q, c)
        return q.to(dtype), cache
    q = randn(gen, (sum(q_lens), hq, d))
    start = 0
    for b, n in enumerate(q_lens):
        lean_queries(q[None, start:start + n], c[b:b + 1])
        start += n
    return q.to(dtype), cache
