"""The per-batch metadata of AstrAI's vLLM backend: vLLM's block table as AstrAI's page table.

:class:`AstraiMetadataBuilder` turns vLLM's ``CommonAttentionMetadata`` into one
:class:`AstraiMetadata` per batch, shared by every layer of its KV cache group: a
:class:`~astrai.extension.batch_plan.BatchPlan` over the block table in place
(:func:`~.pages.block_table_plan`), whose masks, Q tiles and gathers each layer reuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (AttentionCGSupport, AttentionMetadata, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)

from ...extension.batch_plan import BatchPlan
from .pages import block_table_plan

__all__ = ["AstraiMetadata", "AstraiMetadataBuilder"]


@dataclass
class AstraiMetadata(AttentionMetadata):
    """One batch: ``plan`` (requests, q/kv lengths, page table) and the tokens it covers."""

    plan: BatchPlan
    num_actual_tokens: int


class AstraiMetadataBuilder(AttentionMetadataBuilder[AstraiMetadata]):
    """Builds :class:`AstraiMetadata` from vLLM's common metadata (see the module docstring).

    CUDA graphs: ``NEVER``. The plan reads the batch's q lengths on the host (the prefill
    kernel's Q tiles, the torch path's padding), which a replayed graph cannot update; vLLM
    then runs attention eagerly between its piecewise graphs. Decode-only graphs over the
    plan's device tensors (``attn_paged_decode`` never synchronises) are the next step,
    waiting for a GPU to test them.
    """

    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None  # the ragged kernels take decodes and prefills in any order

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AstraiMetadata:
        meta = common_attn_metadata
        if meta.causal is not True:
            raise ValueError(f"causal={meta.causal!r}: AstrAI's vLLM backend runs causal decoder attention only")
        batch = meta.num_reqs
        starts = meta.query_start_loc_cpu[: batch + 1].tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        # upper bounds suffice on the host (padding); the masks read the device seq_lens
        kv_host = meta.seq_lens_cpu_upper_bound
        kv_lens = (kv_host if kv_host is not None else meta.seq_lens.cpu())[:batch].tolist()
        plan = block_table_plan(meta.block_table_tensor, meta.query_start_loc, meta.seq_lens, q_lens, kv_lens,
                                self.page_size)
        return AstraiMetadata(plan=plan, num_actual_tokens=meta.num_actual_tokens)
