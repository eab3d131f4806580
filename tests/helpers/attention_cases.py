"""Helpers for the attention GPU tests, benchmark and sanitizer scripts: seeded inputs whose
edge keys carry weight and paged caches with shuffled page tables (``attention_inputs``),
the float64 reference with its element-wise check (``reference``, ``checks``), and
direct calls into the compiled modules with NaN-poisoned outputs."""

from __future__ import annotations

import torch
from attention_inputs import Paged, dense_inputs, generator, paged_inputs, random_mask, seed_of  # noqa: F401
from checks import assert_attention_close
from reference import attention_ref64

from astrai.extension.abi import dtype_code, stream_handle
from astrai.extension.batch_plan import q_tile_schedule
from astrai.extension.ops import _plugin
from astrai.extension.ops.attention import q_tile_rows
from astrai.extension.ops.attention_args import variant_arg as attn_variant_arg


def abi(t: torch.Tensor | None):
    return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype_code(t))


def rand(shape, dtype, device="cuda", layout="BLHD", gen=None) -> torch.Tensor:
    """Normal random ``[B, L, H, D]`` tensor, stored BLHD or BHLD (a permuted view)."""
    if layout == "BHLD" and len(shape) == 4:
        b, l, h, d = shape
        return torch.randn(b, h, l, d, device=device, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(*shape, device=device, generator=gen).to(dtype)


def reference(q, k, v, mask=None, causal=False, **variant) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(out, magnitude)`` on the inputs' device (``reference.attention_ref64``);
    ``variant``: its window_left / logits_soft_cap / sinks / scale keywords."""
    return attention_ref64(q, k, v, mask, causal, **variant)


def variant_arg(**kw):
    """The modules' positional ``variant`` argument for the keywords of ``attention()`` (None:
    plain), as the ops layer converts them (``ops.attention.variant_arg``)."""
    return attn_variant_arg(**kw).get("variant")


def assert_close(got: torch.Tensor, ref, dtype: torch.dtype, what: str) -> None:
    """Every element of ``got`` within ``dtype`` rounding of the float64 reference
    (``checks.attention_mismatch``)."""
    assert_attention_close(got, ref, dtype, what)


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


def direct_decode(q, k, v, mask=None, variant=None):
    mod = module("attn_decode")
    out = poisoned_like(q)
    splits, ws_o, ws_lse = decode_workspace(mod, q.shape[0], q.shape[2], k.shape[2], q.shape[3], k.shape[1])
    mod.attn_decode(abi(q), abi(k), abi(v), abi(out), abi(mask), splits, abi(ws_o), abi(ws_lse),
                    stream_handle(q.device), variant=variant)
    return out, splits


def direct_prefill(q, k, v, mask=None, causal=False, variant=None):
    mod = module("attn_prefill")
    out = poisoned_like(q)
    mod.attn_prefill(abi(q), abi(k), abi(v), abi(out), abi(mask), causal, stream_handle(q.device), variant=variant)
    return out


def direct_paged_decode(q, cache: Paged, variant=None):
    mod = module("attn_paged_decode")
    out = poisoned_like(q)
    hint = -(-cache.kv_indices.numel() * cache.page // q.shape[0])
    splits, ws_o, ws_lse = decode_workspace(mod, q.shape[0], q.shape[2], cache.k_cache.shape[2], q.shape[3], hint)
    mod.attn_paged_decode(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr),
                          abi(cache.kv_indices), abi(cache.kv_lens), splits, abi(ws_o), abi(ws_lse),
                          stream_handle(q.device), variant=variant)
    return out, splits


def last_rows(cache) -> torch.Tensor:
    """int64 ``[B]``: the cache row (page * page_size + slot) of each request's last position."""
    pos = cache.kv_lens.long() - 1
    pages = cache.kv_indices.long()[cache.kv_indptr.long()[:-1] + torch.div(pos, cache.page, rounding_mode="floor")]
    return pages * cache.page + pos % cache.page


def take_new_tokens(cache):
    """Moves each request's last key/value out of the cache into ``[B, 1, Hkv, D]`` tensors
    and poisons those rows; returns (k_new, v_new, full k_cache, full v_cache)."""
    full = cache.k_cache.clone(), cache.v_cache.clone()
    rows = last_rows(cache)
    k_flat = cache.k_cache.view(-1, *cache.k_cache.shape[2:])
    v_flat = cache.v_cache.view(-1, *cache.v_cache.shape[2:])
    k_new, v_new = k_flat[rows].unsqueeze(1), v_flat[rows].unsqueeze(1)
    k_flat[rows] = float("nan")
    v_flat[rows] = float("nan")
    return k_new, v_new, *full


def direct_paged_decode_appending(q, cache, k_new, v_new, splits=1, in_kernel_merge=False, variant=None):
    """``attn_paged_decode`` with ``append_last`` (k_new / v_new ``[B, 1, Hkv, D]``) into a
    NaN-poisoned out, with ``splits`` splits (merged in the kernel with ``in_kernel_merge``);
    returns (out, the merge's counters or None)."""
    batch, hq, d = q.shape[0], q.shape[2], q.shape[3]
    out = poisoned_like(q)
    ws_o = ws_lse = ws_count = None
    if splits > 1:
        ws_o = torch.empty(splits * batch * hq * d, dtype=torch.float32, device=q.device)
        ws_lse = torch.empty(splits * batch * hq, dtype=torch.float32, device=q.device)
        if in_kernel_merge:
            ws_count = torch.zeros(batch * hq, dtype=torch.int32, device=q.device)
    module("attn_paged_decode").attn_paged_decode(
        abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(cache.kv_indptr), abi(cache.kv_indices),
        abi(cache.kv_lens), splits, abi(ws_o), abi(ws_lse), stream_handle(q.device), abi(ws_count), False,
        abi(k_new), abi(v_new), None, True, variant=variant)
    return out, ws_count


def direct_paged_prefill(q, cache: Paged, q_lens, causal=True, variant=None):
    mod = module("attn_paged_prefill")
    out = poisoned_like(q)
    qo, tb, ti = ragged_plan(q_lens, q.device)
    mod.attn_paged_prefill(abi(q), abi(cache.k_cache), abi(cache.v_cache), abi(out), abi(qo), abi(cache.kv_indptr),
                           abi(cache.kv_indices), abi(cache.kv_lens), abi(tb), abi(ti), causal,
                           stream_handle(q.device), variant=variant)
    return out
