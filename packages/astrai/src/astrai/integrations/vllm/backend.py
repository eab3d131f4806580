"""AstrAI's attention backend for vLLM: what it takes, and what it refuses with the reason.

vLLM asks the backend class at selection time (``validate_configuration``, the ``supports_*``
methods); a configuration AstrAI lacks is refused there with the reason, never run wrong.
Taken: decoder self-attention, fp16 / bf16 (and fp32 off CUDA: the torch path), GQA, any
block size, FP8 KV (``fp8``, ``fp8_e4m3``, ``fp8_e5m2`` with the layer's per-tensor
``k_scale`` / ``v_scale``), sliding window, logit soft-cap, sinks, ALiBi, chunked prefill and
mixed prefill/decode batches. On CUDA the astrai-attention plugin's paged kernels must run
the layer (head dims 64 / 128 / 256, the dtypes and FP8 pages its manifest states, sm_80+):
a GPU it cannot serve is refused rather than served by the torch path's gathers. Refused
everywhere: MLA, sparse and encoder / cross attention, non-causal attention,
per-head quantization scales, context parallelism (DCP / PCP), batch invariance, R-SWA and
multimodal prefix attention, and query lengths the device changes behind the host's back
(adaptive verification): the plan reads the host's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.v1.kv_cache_layout import KVCacheLayout

from .pages import FP8_CACHE_DTYPES, kernel_unsupported

__all__ = ["AstraiAttentionBackend", "NAME"]

# The registry slot AstrAI registers in (vllm --attention-backend CUSTOM)
NAME = "CUSTOM"


class AstraiAttentionBackend(AttentionBackend):
    """vLLM's view of AstrAI's paged attention (see the module docstring)."""

    forward_includes_kv_cache_update = False  # do_kv_cache_update writes the pages first
    accept_output_buffer = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls():
        from .impl import AstraiAttentionImpl

        return AstraiAttentionImpl

    @staticmethod
    def get_builder_cls():
        from .metadata import AstraiMetadataBuilder

        return AstraiMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # the kernels take any page size

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # AstrAI's pages are [page, slot, head, dim]: slot-major blocks first; head-major ones
        # are read through their strides as well
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the plan's Q tiles and padding come from the host's q lengths

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # connectors copy pages in the layouts of vLLM's own backends; not tested here

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is None or capability.major >= 8  # the plugin's archs: sm_80 and newer

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        """On a CUDA device: why the astrai-attention plugin's kernels cannot run the layer
        (no plugin, dtype, head dim, FP8 pages, sinks), or None; elsewhere None (torch)."""
        if device_capability is None or not torch.cuda.is_available():
            return None
        storage = FP8_CACHE_DTYPES.get(kv_cache_dtype or "auto", dtype)
        features = ("sinks",) if has_sink else ()
        reason = kernel_unsupported(torch.device("cuda", torch.cuda.current_device()), dtype, head_size, features,
                                    storage)
        return None if reason is None else f"AstrAI: {reason}"
