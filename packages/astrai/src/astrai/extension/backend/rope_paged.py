"""Rotary fused with the paged KV-cache write: what ``attention(..., rope=(cos, sin))`` runs first.

``rope_and_append(q, k, v, kv_cache, layer_id, rope, interleaved)`` rotates ``q`` and this
step's new keys ``k`` at their cache positions, writes the rotated keys and ``v`` into the
layer's pages at the plan's slots, and returns the rotated ``q`` (``q``'s shape). On CUDA,
with the astrai-elementwise plugin's ``rope_paged_append`` usable for the dtype, that is one
kernel; otherwise ``apply_rotary_emb_qk`` then ``PagedKVCache.append``. An FP8 cache
(``kv_dtype`` != ``dtype``) takes the kernel where the plugin's manifest states its page dtype
(``kv_dtypes``) and the layer's scales are known (set, or calibrated by an earlier append): the
kernel quantizes with them, the bytes ``append`` writes. A layer's first append over an FP8
cache takes the second route, which calibrates the scales on the rotated keys.

What it needs from the batch plan, per new token in packed query order: the cache slot
(``plan.write_index``, int64 ``[total_q]``) and the token's position in its sequence
(``plan.token_positions``: ``kv_len - q_len + row``), both on the cache's device and made
once per plan.
"""

from __future__ import annotations

import torch

from ..kv_cache import PagedKVCache
from ..op_names import ROPE_PAGED_APPEND
from ..ops import rope_paged as ops_rope_paged
from ..ops.rotary_args import check_freqs, check_positions
from .rotary import apply_rotary_emb_qk, choose, states_pages, with_fallback

__all__ = ["rope_and_append"]


def _kernel_scales(kv_cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor):
    """What the kernel needs to write the layer's pages: ``()`` for 16-bit pages, the layer's
    ``(k_scale, v_scale)`` for FP8 pages the plugin writes once the scales are known; None: the
    torch route (FP8 pages the plugin does not state, or scales still to calibrate)."""
    if kv_cache.kv_dtype == kv_cache.dtype:
        return ()
    if kv_cache.kv_scales(layer) is None or not states_pages(ROPE_PAGED_APPEND, kv_cache.kv_dtype, k.device):
        return None
    return kv_cache.scales_for_append(layer, k, v)


def rope_and_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache | None,
                    layer_id: int | None, rope: tuple[torch.Tensor, torch.Tensor], interleaved: bool = True
                    ) -> torch.Tensor:
    """Rotate ``q`` and ``k`` at the plan's positions, write ``k`` (rotated) and ``v`` into layer
    ``layer_id``'s pages; return the rotated ``q``. Bad arguments raise before any write."""
    if kv_cache is None:
        raise ValueError("rope: the fused rotary + cache write needs kv_cache (without one, call "
                         "apply_rotary_emb_qk before attention)")
    plan = kv_cache.active_plan
    layer = kv_cache.check_layer(layer_id)
    q3 = kv_cache.check_tokens("q", q, plan, heads=None)
    k3 = kv_cache.check_tokens("k", k, plan)
    v3 = kv_cache.check_tokens("v", v, plan)
    positions, slots = plan.token_positions, plan.write_index
    cos, sin = check_freqs(rope, q3, q3.shape[0], positions, "q")
    check_positions(positions, 1, q3.shape[0], cos.shape[0], q3.device)  # on a GPU: with ASTRAI_DEBUG=1

    def torch_path() -> torch.Tensor:
        q_rot, k_rot = apply_rotary_emb_qk(q3, k3, (cos, sin), positions=positions, interleaved=interleaved)
        kv_cache.append(layer, k_rot, v3, plan)
        return q_rot

    needs_grad = torch.is_grad_enabled() and q.requires_grad
    scales = None
    if choose(q3, needs_grad, ROPE_PAGED_APPEND) == "cuda" and not needs_grad:
        scales = _kernel_scales(kv_cache, layer, k3, v3)
    if scales is not None:
        kernel = lambda: ops_rope_paged.rope_paged_append_unchecked(  # noqa: E731
            q3, k3.detach(), v3.detach(), kv_cache.k_cache(layer), kv_cache.v_cache(layer), cos, sin, positions, slots,
            interleaved, *scales)
        q_rot = with_fallback(q.device, kernel, torch_path, ROPE_PAGED_APPEND)
    else:
        q_rot = torch_path()
    kv_cache.mark_written(layer, plan)  # the kernel wrote the pages itself (the torch path's append marks too)
    return q_rot.reshape(q.shape)
