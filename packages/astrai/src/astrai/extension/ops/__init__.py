"""Direct kernel wrappers: each runs exactly its plugin kernel or raises.

``attn_prefill(q, k, v, is_causal=True)`` means "run this CUDA kernel", never "attention
on the best available backend": when the plugin is missing or can't run here, the call
raises ``RuntimeError`` naming the plugin and the install command. Use the public
entry points in :mod:`astrai.extension` for dispatch with fallbacks.
"""

from .attention import attn_decode, attn_paged_decode, attn_paged_prefill, attn_prefill
from .fp8 import fp8_gemm, fp8_quantize, mm_fp8, quantize
from .norm import fused_add_rms_norm, rms_norm, silu_and_mul
from .rotary import rotary_emb

__all__ = [
    "attn_decode",
    "attn_paged_decode",
    "attn_paged_prefill",
    "attn_prefill",
    "fp8_gemm",
    "fp8_quantize",
    "fused_add_rms_norm",
    "mm_fp8",
    "quantize",
    "rms_norm",
    "rotary_emb",
    "silu_and_mul",
]
