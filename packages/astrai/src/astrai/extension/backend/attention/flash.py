"""Attention through flash-attn's ``flash_attn_varlen_func``, when ``flash_attn`` imports.

Every call becomes one varlen call over flat ``[tokens, heads, head_dim]`` tensors:
dense inputs are flattened (``cu_seqlens`` in steps of the sequence length), paged inputs
gather each request's K/V from the cache (``kv_cache.gather_flat``) and use the plan's
``qo_indptr`` and kv prefix sums. flash-attn handles GQA itself, aligns causal masks
bottom-right (the convention of this package) and returns zeros for rows that see no key.

It takes no explicit mask, so it serves mask-free and causal calls only, on CUDA, in
float16 / bfloat16, with head_dim a multiple of 8 up to 256. Of the variants it takes a window
(``window_size=(W, 0 or -1)``, aligned bottom-right like ours), a custom scale and, where its
``flash_attn_varlen_func`` has ``softcap`` (flash-attn >= 2.6), the soft-cap; never sinks.
"""

from __future__ import annotations

import inspect
from types import ModuleType

import torch

from .base import AttentionBackend, AttentionCall
from .variant import PLAIN, missing_features

__all__ = ["FlashAttnBackend"]

try:  # optional dependency: guarded module-level import
    import flash_attn as _flash_attn

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # not installed, or installed but broken (ABI, missing CUDA libs)
    _flash_attn = None
    _IMPORT_ERROR = (
        "flash_attn is not installed"
        if isinstance(exc, ModuleNotFoundError) and exc.name == "flash_attn"
        else f"importing flash_attn failed: {type(exc).__name__}: {exc}"
    )

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


class FlashAttnBackend(AttentionBackend):
    """flash-attn varlen attention. ``module`` is the imported ``flash_attn`` (default:
    the module-level import; tests pass a stand-in providing ``flash_attn_varlen_func``)."""

    name = "flash"

    def __init__(self, module: ModuleType | None = _flash_attn, unavailable: str | None = _IMPORT_ERROR) -> None:
        self.module = module
        self.unavailable = unavailable if module is None else None
        self.variants = ("window_left", "scale") + (("logits_soft_cap",) if _has_softcap(module) else ())

    def check(self, call: AttentionCall) -> str | None:
        if self.module is None:
            return self.unavailable or "flash_attn is not installed"
        if call.device_type != "cuda":
            return f"flash-attn runs on CUDA tensors only, got {call.device}"
        if call.dtype not in _DTYPES:
            return f"flash-attn needs float16 or bfloat16, got {call.dtype}"
        if call.mask_ndim:
            return f"flash-attn takes no explicit mask (got a {call.mask_ndim}D mask): mask-free or causal calls only"
        if call.head_dim % 8 or call.head_dim > _MAX_HEAD_DIM:
            return f"flash-attn needs head_dim a multiple of 8 up to {_MAX_HEAD_DIM}, got {call.head_dim}"
        missing = missing_features(call.features, self.variants)
        if missing:
            return f"flash-attn lacks {', '.join(missing)} (it takes {', '.join(self.variants)})"
        return None

    def fwd_prefill(self, q, k, v, *, kv_cache, layer_id, mask, is_causal, variant=PLAIN):
        if kv_cache is not None:
            plan = kv_cache.active_plan
            q_flat = plan.packed(q, "q")
            k_flat, v_flat = kv_cache.gather_flat(layer_id, plan)
            cu_q, cu_k = plan.qo_indptr, plan.cu_seqlens_kv
            max_q, max_k = plan.max_q_len, plan.max_kv_len
        else:
            b, max_q = q.shape[:2]
            max_k = k.shape[1]
            q_flat = q.reshape(b * max_q, *q.shape[2:])
            k_flat = k.reshape(b * max_k, *k.shape[2:])
            v_flat = v.reshape(b * max_k, *v.shape[2:])
            cu_q = torch.arange(0, (b + 1) * max_q, max_q, dtype=torch.int32, device=q.device)
            cu_k = torch.arange(0, (b + 1) * max_k, max_k, dtype=torch.int32, device=q.device)
        extra = {}
        if variant.window_left >= 0:
            extra["window_size"] = (variant.window_left, 0 if is_causal else -1)
        if variant.logits_soft_cap is not None:
            extra["softcap"] = variant.logits_soft_cap
        out = self.module.flash_attn_varlen_func(
            q_flat,
            k_flat,
            v_flat,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            dropout_p=0.0,
            softmax_scale=variant.softmax_scale(q.shape[-1]),
            causal=bool(is_causal),
            **extra,
        )
        return out.reshape(q.shape)


def _has_softcap(module: ModuleType | None) -> bool:
    """Whether ``module.flash_attn_varlen_func`` takes ``softcap`` (flash-attn >= 2.6)."""
    fn = getattr(module, "flash_attn_varlen_func", None)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # None, or a builtin without a signature
        return False
    return "softcap" in params
