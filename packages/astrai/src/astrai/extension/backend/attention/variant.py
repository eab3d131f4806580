"""Attention variants: what changes the scores or the softmax beyond mask and causality.

FlashInfer's semantics, for a query at absolute position ``p`` (its row index plus
``kv_len - q_len``: bottom-right aligned, as ``is_causal``):

- ``window_left``: ``-1`` (none) or ``W >= 0``: the query sees keys ``j >= p - W`` only (the
  right side stays ``is_causal``'s: with it, ``p - W <= j <= p``);
- ``logits_soft_cap``: ``None`` or ``c > 0``: a scaled score ``s`` becomes ``c * tanh(s / c)``;
- ``sinks``: ``None`` or float32 ``[q_heads]``: one extra logit per query head in the softmax
  denominator with no value row (gpt-oss);
- ``alibi_slopes``: ``None`` or float32 ``[q_heads]``: head ``h``'s scaled score of key ``j``
  gains ``alibi_slopes[h] * (j - p)`` (ALiBi: BLOOM, MPT), before a soft-cap;
- ``scale``: ``None`` (``1 / sqrt(head_dim)``) or a positive float.

A call's :attr:`AttentionVariant.features` (the names of the arguments that are set) are part of
its :class:`~.base.AttentionCall`: a backend that lacks one is rejected with the reason, so no
backend ever runs a variant it would ignore. The values themselves travel beside the call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["FEATURES", "PLAIN", "AttentionVariant", "alibi_slopes", "check_variant", "missing_features"]

# Every feature by its argument name, in the order explain() lists them.
FEATURES = ("window_left", "logits_soft_cap", "sinks", "alibi_slopes", "scale")


class AttentionVariant(NamedTuple):
    """A validated variant (see the module docstring). ``PLAIN`` is the default attention."""

    window_left: int = -1
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None
    scale: float | None = None
    alibi_slopes: torch.Tensor | None = None

    @property
    def features(self) -> tuple[str, ...]:
        """The names of the arguments that are set, in :data:`FEATURES` order."""
        if self is PLAIN:
            return ()
        set_ = (self.window_left >= 0, self.logits_soft_cap is not None, self.sinks is not None,
                self.alibi_slopes is not None, self.scale is not None)
        return tuple(name for name, on in zip(FEATURES, set_) if on)

    def softmax_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def memo_key(self) -> tuple:
        """What validation depended on: the values, and the head vectors' shape, dtype and device."""
        return (self.window_left, self.logits_soft_cap, self.scale, _facts(self.sinks), _facts(self.alibi_slopes))


PLAIN = AttentionVariant()


def _facts(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.dtype, t.device)


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi's slopes for ``num_heads`` heads as the paper (and BLOOM, MPT) define them: float32
    ``[num_heads]``, ``2^(-8 i / n)`` for ``i = 1 .. n`` with ``n`` the largest power of two
    ``<= num_heads``; the other heads take the odd terms of the sequence for ``2 n``."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * i / n) for i in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


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


def _head_vector(name: str, t: object, q: torch.Tensor) -> None:
    """``t`` must be a float32 ``[q_heads]`` tensor on ``q``'s device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be None or a float32 tensor [q_heads], got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 [q_heads], got dtype {t.dtype}")
    heads = q.shape[-2]
    if tuple(t.shape) != (heads,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected [q_heads] = [{heads}]")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_variant(q: torch.Tensor, window_left: object = -1, logits_soft_cap: object = None,
                  sinks: object = None, scale: object = None, alibi_slopes: object = None) -> AttentionVariant:
    """Validate the variant arguments of ``attention`` against ``q`` ``[..., q_heads, head_dim]``;
    raises ``TypeError`` / ``ValueError`` naming the argument."""
    if window_left == -1 and logits_soft_cap is None and sinks is None and scale is None and alibi_slopes is None:
        return PLAIN
    if isinstance(window_left, bool) or not isinstance(window_left, int):
        raise TypeError(f"window_left must be an int (-1: no window), got {type(window_left).__name__}")
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (no window) or >= 0, got {window_left}")
    cap = None if logits_soft_cap is None else _positive_float("logits_soft_cap", logits_soft_cap)
    scale_ = None if scale is None else _positive_float("scale", scale)
    if sinks is not None:
        _head_vector("sinks", sinks, q)
    if alibi_slopes is not None:
        _head_vector("alibi_slopes", alibi_slopes, q)
    return AttentionVariant(int(window_left), cap, sinks, scale_, alibi_slopes)
