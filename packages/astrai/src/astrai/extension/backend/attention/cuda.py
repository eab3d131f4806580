"""Attention through the astrai-attention plugin's paged kernels.

- decode (one new token per request): ``attn_paged_decode`` over the layer's pages with
  the plan's ``kv_indptr`` / ``kv_indices`` / ``kv_lens`` (split-KV, graph-capturable);
- prefill and mixed batches (any q lengths, ragged): ``attn_paged_prefill`` over the
  packed ``[total_q, Hq, D]`` query with the plan's ``qo_indptr`` and 64-row
  ``q_tile_to_batch`` / ``q_tile_to_index`` (causal bottom-right per request, or full).

It serves cache calls only: a call without a :class:`~astrai.extension.kv_cache.PagedKVCache`
(training, or plain dense attention) is declined with a reason, and the policy layer
resolves it by capability (flash-attn, then torch SDPA). No backward kernel exists, so calls
that need gradients are declined too.
"""

from __future__ import annotations

import torch

from ...device import probe_device
from ...kv_cache import PagedKVCache
from ...ops import attention as attn_ops
from ...runtime import current_runtime
from .base import AttentionBackend, AttentionCall

__all__ = ["CudaBackend"]

_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128, 256)


class CudaBackend(AttentionBackend):
    """The astrai-attention plugin's paged decode / ragged prefill kernels."""

    name = "cuda"

    def check(self, call: AttentionCall) -> str | None:
        if call.device_type != "cuda":
            return f"the CUDA kernels need CUDA tensors, got {call.device}"
        if not call.paged:
            return "the CUDA kernels run over a PagedKVCache; calls without a cache resolve by capability"
        if call.needs_grad:
            return "the CUDA kernels have no backward pass (call needs gradients)"
        if call.dtype not in _DTYPES:
            return f"the CUDA kernels need float16 or bfloat16, got {call.dtype}"
        if call.head_dim not in _HEAD_DIMS:
            return f"the CUDA kernels support head_dim 64, 128 or 256, got {call.head_dim}"
        if call.mask_ndim:
            return "the paged CUDA kernels take no explicit mask"
        op = "attn_paged_decode" if call.mode == "decode" else "attn_paged_prefill"
        status = current_runtime().registry.op_status(op, probe_device(call.device))
        if not status.usable:
            return f"{op}: {status.reason}"
        return None

    def fwd_decode(self, q, k, v, *, kv_cache: PagedKVCache | None, layer_id, mask, is_causal) -> torch.Tensor:
        plan = kv_cache.active_plan
        q_rows = plan.packed(q, "q")  # [B, Hq, D], one row per request
        out = attn_ops.attn_paged_decode(q_rows.unsqueeze(1), kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id),
                                         plan.kv_indptr, plan.kv_indices, plan.kv_lens)
        return out.reshape(q.shape)

    def fwd_prefill(self, q, k, v, *, kv_cache: PagedKVCache | None, layer_id, mask, is_causal) -> torch.Tensor:
        plan = kv_cache.active_plan
        out = attn_ops.attn_paged_prefill(plan.packed(q, "q"), kv_cache.k_cache(layer_id),
                                          kv_cache.v_cache(layer_id), plan.qo_indptr, plan.kv_indptr,
                                          plan.kv_indices, plan.kv_lens, plan.q_tile_to_batch,
                                          plan.q_tile_to_index, bool(is_causal))
        return out.reshape(q.shape)
