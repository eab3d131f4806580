"""One attention layer of AstrAI's vLLM backend: the page write and the attention.

vLLM calls :meth:`AstraiAttentionImpl.do_kv_cache_update` with the step's keys/values and its
``slot_mapping``, then :meth:`AstraiAttentionImpl.forward` with the queries and the batch's
:class:`~.metadata.AstraiMetadata`; both read and write the layer's cache through AstrAI page
views of it (:func:`~.pages.page_views`), never a copy. The layer's variant (scale, window,
soft-cap, sinks, ALiBi slopes) is fixed at construction; the plugin's kernels run it on CUDA where they can
(decided at the first forward, said once in the log where they cannot), AstrAI's torch path
everywhere else.
"""

from __future__ import annotations

import logging
import math

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from ...extension.backend.attention.variant import check_variant
from .metadata import AstraiMetadata
from .pages import attend, cache_storage_dtype, kernel_unsupported, page_views, write_pages

__all__ = ["AstraiAttentionImpl"]

_log = logging.getLogger(__name__)


class AstraiAttentionImpl(AttentionImpl[AstraiMetadata]):
    """AstrAI paged attention for one vLLM layer (see the module docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise ValueError(f"alibi_slopes has {len(alibi_slopes)} slopes: expected one per head ({num_heads})")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"attn_type={attn_type!r}: AstrAI's vLLM backend runs decoder self-attention only")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (GQA groups)")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks has shape {tuple(sinks.shape)}: expected [num_heads] = [{num_heads}]")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None  # vLLM passes 0 / None for none
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.sinks = sinks  # a parameter the model loads later: read (as float32) at forward
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self._runs: dict[tuple, tuple] = {}  # (device, dtype) -> (variant, kernels?), fixed once weights load

    # -- the variant and where it runs

    def _run_for(self, q: torch.Tensor) -> tuple:
        key = (q.device, q.dtype)
        found = self._runs.get(key)
        if found is None:
            sinks = None if self.sinks is None else self.sinks.detach().to(device=q.device, dtype=torch.float32)
            slopes = None if self.alibi_slopes is None else self.alibi_slopes.to(q.device)
            default = abs(self.scale - 1.0 / math.sqrt(self.head_size)) <= 1e-7 * self.scale
            variant = check_variant(q, window_left=-1 if self.sliding_window is None else self.sliding_window - 1,
                                    logits_soft_cap=self.logits_soft_cap, sinks=sinks,
                                    scale=None if default else self.scale, alibi_slopes=slopes)
            storage = cache_storage_dtype(self.kv_cache_dtype, q.dtype)
            reason = kernel_unsupported(q.device, q.dtype, self.head_size, variant.features, storage)
            if reason is not None and q.device.type == "cuda":
                _log.warning("AstrAI attention runs the torch path on %s: %s", q.device, reason)
            found = self._runs[key] = (variant, reason is None, storage)
        return found

    # -- vLLM's calls

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write the step's keys/values into the layer's pages (vLLM calls it before forward)."""
        if kv_cache.numel() == 0:  # the profiling run's empty cache
            return
        storage = cache_storage_dtype(self.kv_cache_dtype, key.dtype)
        k_pages, v_pages = page_views(kv_cache, self.head_size, storage)
        write_pages(k_pages, v_pages, key, value, slot_mapping, layer._k_scale, layer._v_scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AstraiMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the batch's queries ``[num_tokens, num_heads, head_size]`` over the
        layer's pages, into ``output`` (same shape; rows past the batch's tokens untouched)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("output_scale: AstrAI's vLLM backend has no fused output quantization")
        if attn_metadata is None:  # the profiling run
            return output
        plan = attn_metadata.plan
        q = query[: plan.total_q]
        variant, kernels, storage = self._run_for(q)
        k_pages, v_pages = page_views(kv_cache, self.head_size, storage)
        out = attend(q, k_pages, v_pages, plan, variant, kernels=kernels, k_scale=layer._k_scale,
                     v_scale=layer._v_scale)
        output[: plan.total_q].view(plan.total_q, self.num_heads, self.head_size).copy_(out)
        return output
