"""Helpers for the attention GPU tests, benchmark and sanitizer script: random inputs,
a float32 GPU reference, paged caches with shuffled page tables, and direct calls into
the compiled modules with poisoned outputs."""

from __future__ import annotations

import math

import torch

from astrai.extension.abi import dtype_code, stream_handle
from astrai.extension.batch_plan import q_tile_schedule
from astrai.extension.ops import _plugin
from astrai.extension.ops.attention import q_tile_rows


def abi(t: torch.Tensor | None):
    return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype_code(t))


def rand(shape, dtype, device="cuda", layout="BLHD", gen=None) -> torch.Tensor:
    """Normal random ``[B, L, H, D]`` tensor, stored BLHD or BHLD (a permuted view)."""
    if layout == "BHLD" and len(shape) == 4:
        b, l, h, d = shape
        return torch.randn(b, h, l, d, device=device, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(*shape, device=device, generator=gen).to(dtype)


def reference(q, k, v, mask=None, causal=False) -> torch.Tensor:
    """float32 attention on the GPU: q ``[B, Lq, Hq, D]``, k/v ``[B, Lkv, Hkv, D]``, mask bool
    ``[B, Lkv]`` / ``[B, Lq, Lkv]`` (True = keep), bottom-right causal; empty rows -> 0."""
    b, lq, hq, d = q.shape
    lkv, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    out = torch.empty(b, lq, hq, d, dtype=torch.float32, device=q.device)
    keep = torch.ones(lq, lkv, dtype=torch.bool, device=q.device)
    if causal:
        keep &= torch.arange(lkv, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lkv - lq)
    for i in range(b):
        kk = k[i].float().repeat_interleave(g, dim=1)
        vv = v[i].float().repeat_interleave(g, dim=1)
        row_keep = keep
        if mask is not None:
            row_keep = keep & (mask[i][None, :] if mask.dim() == 2 else mask[i])
        s = torch.einsum("ihd,jhd->hij", q[i].float(), kk) / math.sqrt(d)
        s = s.masked_fill(~row_keep[None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[i] = torch.einsum("hij,jhd->ihd", p, vv)
    return out


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> float:
    """Every element finite, relative L2 error and max error under the dtype's tolerance."""
    got = got.float()
    assert torch.isfinite(got).all(), f"{what}: non-finite output (unwritten or NaN)"
    rel = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    err = (got - ref).abs().max().item()
    tol_rel, tol_abs = (1.2e-2, 6e-2) if dtype == torch.bfloat16 else (4e-3, 1.5e-2)
    assert rel < tol_rel and err < tol_abs, f"{what}: rel {rel:.2e} max {err:.2e}"
    return rel


class Paged:
    """A paged cache ``[P, page, Hkv, D]`` holding per-request K/V in shuffled pages."""

    def __init__(self, kv_lens, page, hkv, d, dtype, device="cuda", spare_pages=3):
        self.kv_lens_host = list(kv_lens)
        self.page = page
        counts = [-(-n // page) for n in kv_lens]
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        num_pages = indptr[-1] + spare_pages
        perm = torch.randperm(num_pages, device="cpu")[: indptr[-1]]
        self.k_cache = torch.randn(num_pages, page, hkv, d, device=device).to(dtype)
        self.v_cache = torch.randn(num_pages, page, hkv, d, device=device).to(dtype)
        self.kv_indptr = torch.tensor(indptr, dtype=torch.int32, device=device)
        self.kv_indices = perm.to(torch.int32).to(device)
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)

    def gather(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's K/V as contiguous ``[kv_len, Hkv, D]``."""
        n = self.kv_lens_host[b]
        pages = self.kv_indices[self.kv_indptr[b]: self.kv_indptr[b + 1]].long()
        k = self.k_cache[pages].flatten(0, 1)[:n]
        v = self.v_cache[pages].flatten(0, 1)[:n]
        return k, v


def ragged_plan(q_lens, device="cuda"):
    """qo_indptr, q_tile_to_batch, q_tile_to_index for ragged q lengths (the module's Q tiles)."""
    indptr = [0]
    for n in q_lens:
        indptr.append(indptr[-1] + n)
    tb, ti = q_tile_schedule(tuple(q_lens), q_tile_rows(device))
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(indptr), as_t(tb), as_t(ti)


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


def module(op: str, device="cuda"):
    return _plugin.require(op, torch.device(device))


def decode_workspace(mod, batch, q_heads, kv_heads, head_dim, kv_hint, device="cuda"):
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = mod.decode_plan(batch, kv_heads, q_heads // kv_heads, head_dim, kv_hint, sms)
    ws_o = torch.empty(splits * batch * q_heads * head_dim, dtype=torch.float32, device=device)
    ws_lse = torch.empty(splits * batch * q_heads, dtype=torch.float32, device=device)
    return splits, ws_o, ws_lse


def direct_decode(q, k, v, mask=None):
    mod = module("attn_decode")
    out = poisoned_like(q)
    splits, ws_o, ws_lse = decode_workspace(mod, q.shape[0], q.shape[2], k.shape[2], q.shape[3], k.shape[1])
    mod.attn_decode(abi(q), abi(k), abi(v), abi(out), abi(mask), splits, abi(ws_o), abi(ws_lse),
                    stream_handle(q.device))
    return out, splits


def direct_prefill(q, k, v, mask=None, causal=False):
    mod = module("attn_prefill")
    out = poisoned_like(q)
    mod.attn_prefill(abi(q), abi(k), abi(v), abi(out), abi(mask), causal, stream_handle(q.device))
    return out


def direct_paged_decode(q, cache: Paged):
    mod = module("attn_paged_decode")
    out = poisoned_like(q)
    hint = -(-cache.kv_indices.numel() * cache.page // q.shape[0])
    splits, ws_o, ws_lse = decode_workspace(mod, q.shape[0], q.shape[2], cache.k_cache.shape[2], q.shape[3], hint)
    mod.attn_paged_decode(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),
                          abi(cache.kv_indices), abi(cache.kv_lens), splits, abi(ws_o), abi(ws_lse),
                          stream_handle(q.device))
    return out, splits


def direct_paged_prefill(q, cache: Paged, q_lens, causal=True):
    mod = module("attn_paged_prefill")
    out = poisoned_like(q)
    qo, tb, ti = ragged_plan(q_lens, q.device)
    mod.attn_paged_prefill(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(qo), abi(cache.kv_indptr),
                           abi(cache.kv_indices), abi(cache.kv_lens), abi(tb), abi(ti), causal,
                           stream_handle(q.device))
    return out
