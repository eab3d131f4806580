"""The ops' names, each stated once: what a plugin manifest declares under ``ops``, what the
registry, the resolver and the ops wrappers key on, and what errors, ``explain`` and
``astrai doctor`` print. The values are part of the plugin ABI (a manifest names its ops by
them) and of what users read: they never change.

``ALL_OPS`` lists every op the project's plugins provide, in the order ``astrai doctor``
shows them (``tests/core/test_op_names.py`` holds it to the manifests and the core's tables).
"""

from __future__ import annotations

# astrai-attention
ATTN_DECODE = "attn_decode"
ATTN_PREFILL = "attn_prefill"
ATTN_PAGED_DECODE = "attn_paged_decode"
ATTN_PAGED_PREFILL = "attn_paged_prefill"
# astrai-elementwise
ROTARY_EMB = "rotary_emb"
ROPE_PAGED_APPEND = "rope_paged_append"
RMS_NORM = "rms_norm"
FUSED_ADD_RMS_NORM = "fused_add_rms_norm"
SILU_AND_MUL = "silu_and_mul"
# astrai-fp8
FP8_QUANTIZE = "fp8_quantize"
FP8_GEMM = "fp8_gemm"
FP8_SCALE_UPDATE = "fp8_scale_update"
FP8_WEIGHT_GEMM = "fp8_weight_gemm"

ALL_OPS = (
    ATTN_DECODE, ATTN_PREFILL, ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL,
    ROTARY_EMB, ROPE_PAGED_APPEND, RMS_NORM, FUSED_ADD_RMS_NORM, SILU_AND_MUL,
    FP8_QUANTIZE, FP8_GEMM, FP8_SCALE_UPDATE, FP8_WEIGHT_GEMM,
)
