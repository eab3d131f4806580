"""The attention modules' variant and FP8-scale keywords, converted once from the ops' keywords or
from an ``AttentionVariant`` of the backend layer (csrc/entry_utils.h reads them)."""

from __future__ import annotations

import torch

from ..abi import tensor_arg

__all__ = ["kv_scales_arg", "variant_arg", "variant_binding", "variant_kwargs"]


def variant_arg(scale: float | None = None, logits_soft_cap: float | None = None, window_left: int = -1,
                sinks: torch.Tensor | None = None) -> dict:
    """The modules' ``variant`` keyword of the ops' variant keywords: none for plain attention (so a
    plugin built before variants still runs it), else :func:`_binding_variant`'s tuple."""
    if scale is None and logits_soft_cap is None and window_left == -1 and sinks is None:
        return {}
    return _binding_variant(scale, logits_soft_cap, window_left, sinks)


def variant_binding(variant) -> dict:
    """The modules' ``variant`` keyword of ``variant`` (an ``AttentionVariant`` of the backend
    layer, or None), straight from its fields: what the launch plans pass."""
    if variant is None or not variant.features:
        return {}
    _refuse_alibi(variant)
    return _binding_variant(variant.scale, variant.logits_soft_cap, variant.window_left, variant.sinks)


def _binding_variant(scale, logits_soft_cap, window_left, sinks) -> dict:
    """The one conversion to the binding's variant: ``(scale, soft-cap, window_left, sinks)`` with
    0 for an unset scale or soft-cap (csrc/entry_utils.h: set_variant)."""
    return {"variant": (float(scale or 0.0), float(logits_soft_cap or 0.0), int(window_left), tensor_arg(sinks))}


def variant_kwargs(variant) -> dict:
    """The ops' variant keywords of ``variant`` (an ``AttentionVariant`` of the backend layer, or
    None): none for plain attention. For the registered ops' traced calls, whose schema takes the
    fields one by one."""
    if variant is None or not variant.features:
        return {}
    _refuse_alibi(variant)
    return dict(scale=variant.scale, logits_soft_cap=variant.logits_soft_cap, window_left=variant.window_left,
                sinks=variant.sinks)


def _refuse_alibi(variant) -> None:
    if variant.alibi_slopes is not None:  # the CUDA backend passes such calls over (its manifest lacks it)
        raise ValueError("alibi_slopes: the CUDA attention ops take no ALiBi bias (the torch path runs it)")


def kv_scales_arg(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> dict:
    """The paged modules' ``kv_scales`` keyword: none for a 16-bit cache."""
    if k_scale is None and v_scale is None:
        return {}
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale: an FP8 cache needs both k_scale and v_scale")
    return {"kv_scales": (tensor_arg(k_scale), tensor_arg(v_scale))}
