"""Argument checks of ``attention(...)``, run before anything is computed.

:func:`describe_call` raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong
shape, device, value) naming the argument and what was expected, and otherwise returns
the :class:`AttentionCall` the resolver decides on plus the effective ``is_causal``.
"""

from __future__ import annotations

import torch

from ...kv_cache import PagedKVCache
from .base import AttentionCall

__all__ = ["FWD_MODES", "describe_call"]

FWD_MODES = (None, "decode", "prefill")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Size, torch.Size]:
    """Check q/k/v; return the shapes of q and k."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if 0 in qs or 0 in ks:
        name, shape = ("q", qs) if 0 in qs else ("k", ks)
        raise ValueError(f"{name} has an empty dimension: shape {tuple(shape)}")
    dtype = q.dtype
    if dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {dtype}")
    if k.dtype != dtype or v.dtype != dtype:
        name, t = ("k", k) if k.dtype != dtype else ("v", v)
        raise TypeError(f"{name} has dtype {t.dtype} but q has {dtype}: q, k and v must share one dtype")
    device = q.device
    if k.device != device or v.device != device:
        name, t = ("k", k) if k.device != device else ("v", v)
        raise ValueError(f"{name} is on {t.device} but q is on {device}: q, k and v must share one device")
    if vs != ks:
        raise ValueError(f"v has shape {tuple(vs)} but k has {tuple(ks)}: they must match")
    if ks[3] != qs[3]:
        raise ValueError(f"k has head_dim {ks[3]} but q has head_dim {qs[3]}: they must match")
    if qs[2] % ks[2]:
        raise ValueError(
            f"q has {qs[2]} heads, not a multiple of the {ks[2]} kv heads of k/v "
            "(GQA needs q_heads = group * kv_heads)"
        )
    return qs, ks


def _check_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = keep), got dtype {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    b, lq, lkv = q.shape[0], q.shape[1], k.shape[1]
    if tuple(mask.shape) not in ((b, lkv), (b, lq, lkv)):
        raise ValueError(
            f"mask has shape {tuple(mask.shape)}: expected [batch, kv_len] = [{b}, {lkv}] "
            f"or [batch, q_len, kv_len] = [{b}, {lq}, {lkv}]"
        )


def _check_cache(q: torch.Tensor, k: torch.Tensor, kv_cache: object, layer_id: object, fwd: str | None):
    if not isinstance(kv_cache, PagedKVCache):
        raise TypeError(f"kv_cache must be a PagedKVCache or None, got {type(kv_cache).__name__}")
    if layer_id is None:
        raise ValueError("layer_id is required with kv_cache (which layer's keys/values to use)")
    kv_cache.check_layer(layer_id)
    if q.dtype != kv_cache.dtype:
        raise TypeError(f"q has dtype {q.dtype} but kv_cache stores {kv_cache.dtype}")
    if q.device != kv_cache.device:
        raise ValueError(f"q is on {q.device} but kv_cache is on {kv_cache.device}")
    if (k.shape[2], k.shape[3]) != (kv_cache.kv_heads, kv_cache.head_dim):
        raise ValueError(
            f"k has {k.shape[2]} kv heads of head_dim {k.shape[3]} but kv_cache stores "
            f"{kv_cache.kv_heads} kv heads of head_dim {kv_cache.head_dim}"
        )
    plan = kv_cache.active_plan
    plan.check_packable(q.shape, "q")  # raises naming q when q does not hold the plan's new tokens
    if k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"k has shape {tuple(k.shape)}: with kv_cache, k/v hold the new tokens, "
            f"laid out like q {tuple(q.shape[:2])}"
        )
    if fwd == "decode" and not plan.is_decode:
        raise ValueError(
            f"fwd='decode' needs one new token per request, the kv_cache plan adds q_lens={list(plan.q_lens_host)}"
        )
    return plan


def describe_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: PagedKVCache | None,
    layer_id: int | None,
    fwd: str | None,
    mask: torch.Tensor | None,
    is_causal: bool | None,
    features: tuple[str, ...] = (),
) -> tuple[AttentionCall, bool]:
    """Validate the arguments of ``attention``; return ``(call, effective is_causal)``.
    ``features``: those of the call's variant (``check_variant`` validated its values)."""
    qs, ks = _check_qkv(q, k, v)
    if fwd is not None and fwd not in FWD_MODES:
        raise ValueError(f"fwd must be None, 'decode' or 'prefill', got {fwd!r}")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool or None, got {type(is_causal).__name__}")
    if kv_cache is None:
        if layer_id is not None:
            raise ValueError("layer_id was given without kv_cache: it selects a cache layer")
        if ks[0] != qs[0]:
            raise ValueError(f"k has batch {ks[0]} but q has batch {qs[0]}: they must match")
        if mask is not None:
            _check_mask(mask, q, k)
        if fwd == "decode" and qs[1] != 1:
            raise ValueError(f"fwd='decode' needs q with one token per request, got q shape {tuple(qs)}")
        causal = is_causal is True
        decode = fwd == "decode" or (fwd is None and qs[1] == 1)
        page_size = kv_dtype = None
    else:
        if mask is not None:
            raise ValueError(
                "mask is not supported with kv_cache: each request attends to its own cached tokens "
                "(use is_causal to select causal attention)"
            )
        plan = _check_cache(q, k, kv_cache, layer_id, fwd)
        causal = is_causal is not False
        decode = fwd == "decode" or (fwd is None and plan.is_decode)
        page_size = kv_cache.page_size
        kv_dtype = kv_cache.kv_dtype
    call = AttentionCall(
        q.device,
        q.dtype,
        qs[3],
        qs[2],
        ks[2],
        "decode" if decode else "prefill",
        fwd,
        causal,
        0 if mask is None else mask.dim(),
        kv_cache is not None,
        page_size,
        (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled(),
        _size_class(qs, ks) if kv_cache is None and not decode and q.device.type == "cuda" else (),
        "attention",
        features,
        kv_dtype,
    )
    return call, causal


def _size_class(qs: torch.Size, ks: torch.Size) -> tuple[int, int]:
    """(batch x q_len, kv_len), each rounded up to a power of two."""
    return 1 << (qs[0] * qs[1] - 1).bit_length(), 1 << (ks[1] - 1).bit_length()
