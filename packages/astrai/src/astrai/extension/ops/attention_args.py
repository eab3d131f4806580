"""The attention modules' variant and FP8-scale keywords, converted once from the ops' keywords or
from an ``AttentionVariant`` of the backend layer (csrc/entry_utils.h reads them)."""

from __future__ import annotations

import torch

from ..abi import tensor_arg

__all__ = ["kv_scales_arg", "variant_arg", "variant_binding", "variant_kwargs"]


def variant_arg(scale: float | None = None, logits_soft_cap: float | None = None, window_left: int = -1,
                sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> dict:
    """The modules' ``variant`` keyword of the ops' variant keywords: none for plain attention (so a
    plugin built before variants still runs it), else :func:`_binding_variant`'s tuple."""
    if scale is None and logits_soft_cap is None and window_left == -1 and sinks is None and alibi_slopes is None:
        return {}
    return _binding_variant(scale, logits_soft_cap, window_left, sinks, alibi_slopes)


def variant_binding(variant) -> dict:
    """The modules' ``variant`` keyword of ``variant`` (an ``AttentionVariant`` of the backend
    layer, or None), straight from its fields: what the launch plans pass."""
    if variant is None or not variant.features:
        return {}
    return _binding_variant(variant.scale, variant.logits_soft_cap, variant.window_left, variant.sinks,
                            variant.alibi_slopes)


def _binding_variant(scale, logits_soft_cap, window_left, sinks, alibi_slopes) -> dict:
    """The one conversion to the binding's variant: ``(scale, soft-cap, window_left, sinks)`` with
    0 for an unset scale or soft-cap, and ``alibi_slopes`` as a fifth item where set (so a plugin
    built before ALiBi, whose manifest lacks it, still takes every other variant: csrc/entry_utils.h:
    set_variant)."""
    items = (float(scale or 0.0), float(logits_soft_cap or 0.0), int(window_left), tensor_arg(sinks))
    return {"variant": items if alibi_slopes is None else (*items, tensor_arg(alibi_slopes))}


def variant_kwargs(variant) -> dict:
    """The ops' variant keywords of ``variant`` (an ``AttentionVariant`` of the backend layer, or
    None): none for plain attention. For the registered ops' traced calls, whose schema takes the
    fields one by one."""
    if variant is None or not variant.features:
        return {}
    return dict(scale=variant.scale, logits_soft_cap=variant.logits_soft_cap, window_left=variant.window_left,
                sinks=variant.sinks, alibi_slopes=variant.alibi_slopes)


def kv_scales_arg(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> dict:
    """The paged modules' ``kv_scales`` keyword: none for a 16-bit cache."""
    if k_scale is None and v_scale is None:
        return {}
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale: an FP8 cache needs both k_scale and v_scale")
    return {"kv_scales": (tensor_arg(k_scale), tensor_arg(v_scale))}
