"""AstrAI's stable public API (re-exports only).

Model code imports from here::

    from astrai.extension import ATTN_BACKEND, attention, attn_backend, apply_rotary_emb
    from astrai.extension import fp8_autocast, DelayedScaling

Direct kernel wrappers that never fall back live in :mod:`astrai.extension.ops`.
"""

from .backend.attention import ATTN_BACKEND, attention, attn_backend
from .backend.fp8_weights import fp8_weight_linear, quantize_weight
from .backend.norm import fused_add_rms_norm, rms_norm, silu_and_mul
from .backend.rotary import apply_rotary_emb, apply_rotary_emb_qk
from .fp8 import DelayedScaling, DynamicScaling, Format, fp8_autocast, fp8_state, is_fp8_autocast_enabled
from .kv_cache import BatchPlan, CacheStateError, PagedKVCache, StaticDecodePlan
from .resolver import BackendUnavailableError, Decision
from .runtime import current_runtime


def explain(op: str | None = None) -> list[Decision]:
    """Every backend decision made so far in this process (of ``op``: "attention",
    "rotary_emb", "fp8_gemm", ...), each with its accept/reject trace; ``print`` them."""
    return current_runtime().explain(op)


__all__ = [
    "ATTN_BACKEND",
    "BackendUnavailableError",
    "BatchPlan",
    "CacheStateError",
    "DelayedScaling",
    "DynamicScaling",
    "Format",
    "PagedKVCache",
    "StaticDecodePlan",
    "apply_rotary_emb",
    "apply_rotary_emb_qk",
    "attention",
    "attn_backend",
    "explain",
    "fp8_autocast",
    "fp8_state",
    "fp8_weight_linear",
    "fused_add_rms_norm",
    "is_fp8_autocast_enabled",
    "quantize_weight",
    "rms_norm",
    "silu_and_mul",
]
