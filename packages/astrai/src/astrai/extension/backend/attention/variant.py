"""Attention variants: what changes the scores or the softmax beyond mask and causality.

FlashInfer's semantics, for a query at absolute position ``p`` (its row index plus
``kv_len - q_len``: bottom-right aligned, as ``is_causal``):

- ``window_left``: ``-1`` (none) or ``W >= 0``: the query sees keys ``j >= p - W`` only (the
  right side stays ``is_causal``'s: with it, ``p - W <= j <= p``);
- ``logits_soft_cap``: ``None`` or ``c > 0``: a scaled score ``s`` becomes ``c * tanh(s / c)``;
- ``sinks``: ``None`` or float32 ``[q_heads]``: one extra logit per query head in the softmax
  denominator with no value row (gpt-oss);
- ``scale``: ``None`` (``1 / sqrt(head_dim)``) or a positive float.

A call's :attr:`AttentionVariant.features` (the names of the arguments that are set) are part of
its :class:`~.base.AttentionCall`: a backend that lacks one is rejected with the reason, so no
backend ever runs a variant it would ignore. The values themselves travel beside the call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["FEATURES", "PLAIN", "AttentionVariant", "check_variant", "missing_features"]

# Every feature by its argument name, in the order explain() lists them.
FEATURES = ("window_left", "logits_soft_cap", "sinks", "scale")


class AttentionVariant(NamedTuple):
    """A validated variant (see the module docstring). ``PLAIN`` is the default attention."""

    window_left: int = -1
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None
    scale: float | None = None

    @property
    def features(self) -> tuple[str, ...]:
        """The names of the arguments that are set, in :data:`FEATURES` order."""
        if self.window_left < 0 and self.logits_soft_cap is None and self.sinks is None and self.scale is None:
            return ()
        set_ = (self.window_left >= 0, self.logits_soft_cap is not None, self.sinks is not None, self.scale is not None)
        return tuple(name for name, on in zip(FEATURES, set_) if on)

    def softmax_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def memo_key(self) -> tuple:
        """What validation depended on: the values, and the sinks' shape, dtype and device."""
        sinks = self.sinks
        return (self.window_left, self.logits_soft_cap, self.scale,
                None if sinks is None else (type(sinks), sinks.shape, sinks.dtype, sinks.device))


PLAIN = AttentionVariant()


def missing_features(call_features: tuple[str, ...], supported) -> tuple[str, ...]:
    """The features of a call that ``supported`` (a collection of feature names) lacks."""
    return tuple(f for f in call_features if f not in supported)


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be None or a positive float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float, got {value}")
    return value


def check_variant(q: torch.Tensor, window_left: object = -1, logits_soft_cap: object = None,
                  sinks: object = None, scale: object = None) -> AttentionVariant:
    """Validate the variant arguments of ``attention`` against ``q`` ``[..., q_heads, head_dim]``;
    raises ``TypeError`` / ``ValueError`` naming the argument."""
    if window_left == -1 and logits_soft_cap is None and sinks is None and scale is None:
        return PLAIN
    if isinstance(window_left, bool) or not isinstance(window_left, int):
        raise TypeError(f"window_left must be an int (-1: no window), got {type(window_left).__name__}")
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (no window) or >= 0, got {window_left}")
    cap = None if logits_soft_cap is None else _positive_float("logits_soft_cap", logits_soft_cap)
    scale_ = None if scale is None else _positive_float("scale", scale)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks must be None or a float32 tensor [q_heads], got {type(sinks).__name__}")
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks must be float32 [q_heads], got dtype {sinks.dtype}")
        heads = q.shape[-2]
        if tuple(sinks.shape) != (heads,):
            raise ValueError(f"sinks has shape {tuple(sinks.shape)}: expected [q_heads] = [{heads}]")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    return AttentionVariant(int(window_left), cap, sinks, scale_)
