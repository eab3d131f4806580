"""Attention through ``torch.nn.functional.scaled_dot_product_attention``: always available.

- GQA: without a mask, SDPA's ``enable_gqa`` (torch >= 2.5; older torch repeats K/V).
  With a mask, the ``G`` query heads of one kv head are stacked along the query axis
  (``[B, Hkv, G * Lq, D]``), so K/V are never copied per query head.
- Masks are bool, True = keep; a causal call with ``Lq != Lkv`` is bottom-right aligned
  (row ``i`` sees ``j <= i + Lkv - Lq``), expressed as an explicit mask.
- A query row that keeps no key (an all-False mask row, or a causal row with
  ``i + Lkv - Lq < 0``) returns **zeros**, not NaN, and passes no gradient.
- Keys that no query row keeps are zeroed before SDPA, so NaN/Inf garbage in padding
  never reaches the result. (A NaN in a key/value that only *some* rows drop still
  reaches the rows that drop it: ``0 * NaN`` in the probability-value product.)
- Paged calls gather each request's K/V from the cache into ``[B, max_kv, Hkv, D]`` and
  mask the padding; ragged queries are padded to ``[B, max_q, Hq, D]`` the same way.
- Variants (:mod:`.variant`): a window is one more term of the keep mask; a custom scale is
  SDPA's ``scale``; a soft-cap, sinks or ALiBi take :func:`_explicit_attention` (scores
  materialized, float32 or float64 arithmetic), the reference the kernels are tested against.
  ALiBi's bias reads each key's distance from its query's position (``j - p``, never positive
  where causal), so the kept scores stay small whatever the context's length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...kv_cache import BatchPlan, PagedKVCache
from .base import AttentionBackend, AttentionCall
from .variant import PLAIN, AttentionVariant

__all__ = ["TorchNativeBackend", "paged_sdpa", "planned_sdpa", "sdpa"]

_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _causal_mask(lq: int, lkv: int, device: torch.device) -> torch.Tensor:
    """Bool ``[Lq, Lkv]``: row ``i`` keeps ``j <= i + Lkv - Lq``."""
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lkv, device=device)[None, :]
    return cols <= rows + (lkv - lq)


def _window_mask(lq: int, lkv: int, window_left: int, device: torch.device) -> torch.Tensor:
    """Bool ``[Lq, Lkv]``: row ``i`` (absolute position ``i + Lkv - Lq``) keeps ``j >= i + Lkv - Lq - W``."""
    return _key_distance(lq, lkv, device)[0] >= -window_left


def _key_distance(lq: int, lkv: int, device: torch.device) -> torch.Tensor:
    """``[1, Lq, Lkv]``: key ``j``'s distance ``j - p`` from row ``i``'s position ``p = i + Lkv - Lq``."""
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lkv, device=device)[None, :]
    return (cols - rows - (lkv - lq))[None]


def _planned_key_distance(plan: BatchPlan) -> torch.Tensor:
    """``[B, max_q, max_kv]``: :func:`_key_distance` per request of ``plan`` (its new tokens are its
    last ``q_len`` positions)."""
    device = plan.kv_lens.device
    offset = plan.kv_lens.long() - torch.tensor(plan.q_lens_host, device=device)
    rows = torch.arange(plan.max_q_len, device=device)[None, :, None]
    cols = torch.arange(plan.max_kv_len, device=device)[None, None, :]
    return cols - rows - offset[:, None, None]


def _needs_explicit(variant: AttentionVariant) -> bool:
    return variant.logits_soft_cap is not None or variant.sinks is not None or variant.alibi_slopes is not None


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                        variant: AttentionVariant, distance: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with every variant feature, scores materialized: ``[B, H, L, D]`` layout, ``keep``
    None or bool ``[B, Lq, Lkv]``; ``distance`` (with ALiBi) ``[B or 1, Lq, Lkv]``, each key's
    ``j - p``. float64 inputs compute in float64, others in float32. The ``G`` query heads of a
    kv head are stacked along the query axis, as in :func:`_sdpa_masked`."""
    b, hq, lq, d = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    group = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q.reshape(b, hkv, group * lq, d).to(acc) @ k.to(acc).transpose(-1, -2)) * variant.softmax_scale(d)
    if variant.alibi_slopes is not None:
        slopes = variant.alibi_slopes.to(acc).reshape(1, hkv, group, 1, 1)
        bias = slopes * distance.to(acc)[:, None, None]  # [B, Hkv, G, Lq, Lkv]
        scores = (scores.reshape(b, hkv, group, lq, lkv) + bias).reshape(b, hkv, group * lq, lkv)
    cap = variant.logits_soft_cap
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if keep is not None:
        keep_g = keep[:, None, None].expand(b, 1, group, lq, lkv).reshape(b, 1, group * lq, lkv)
        scores = scores.masked_fill(~keep_g, float("-inf"))
    if variant.sinks is not None:
        sink = variant.sinks.to(acc).reshape(1, hkv, group, 1, 1).expand(b, hkv, group, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink.reshape(b, hkv, group * lq, 1)], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if keep is not None:  # rows that keep no key: zeros (without sinks their softmax is NaN)
        probs = torch.where(keep_g.any(dim=-1, keepdim=True), probs, 0.0)
    return (probs @ v.to(acc)).reshape(b, hq, lq, d).to(q.dtype)


_WIDE = (torch.float32, torch.float64)  # sums that need no wider accumulator


def _finite_on_cpu(q: torch.Tensor, k: torch.Tensor) -> bool:
    """False for CPU inputs holding NaN/Inf: torch's CPU SDPA kernels return zeros instead of
    NaN for such rows, so they take a plain softmax. (A host check is free on the CPU; CUDA
    tensors skip it so the call never synchronises.) A float32 sum per tensor is NaN or Inf
    when any element is; a finite sum that overflows only sends the call to the plain path.
    (Cheaper than isfinite().all(): two reductions instead of four ops.)"""
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return True
    if q.dtype in _WIDE:
        return math.isfinite(q.sum().item() + k.sum().item())
    return math.isfinite(q.sum(dtype=torch.float32).item() + k.sum(dtype=torch.float32).item())


def _sdpa_no_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, finite: bool,
                  scale: float | None = None) -> torch.Tensor:
    """``[B, H, L, D]`` layout; ``is_causal`` only when Lq == Lkv (top-left == bottom-right);
    ``finite``: what :func:`_finite_on_cpu` said of q and k (asked before the transposes:
    sums over the caller's contiguous tensors are cheaper than over the views)."""
    if not finite:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))  # plain softmax: NaN stays NaN
        if is_causal:
            scores = scores.masked_fill(~_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v
    group = q.shape[1] // k.shape[1]
    if group > 1 and _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True, scale=scale)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                 variant: AttentionVariant = PLAIN, distance: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, L, D]`` layout with a bool ``keep`` of shape ``[B, Lq, Lkv]`` (``distance``: ALiBi's,
    see :func:`_explicit_attention`)."""
    if _needs_explicit(variant):
        return _explicit_attention(q, k, v, keep, variant, distance)
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    has_key = keep.any(dim=-1)  # [B, Lq]
    # Rows without any key would be NaN: let them attend to everything, zero them after.
    keep = keep | ~has_key[..., None]
    # Stack the G query heads of each kv head along the query axis: [B, Hkv, G*Lq, D].
    qg = q.reshape(b, hkv, group * lq, d)
    mask = keep[:, None, None].expand(b, 1, group, lq, keep.shape[-1]).reshape(b, 1, group * lq, keep.shape[-1])
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=variant.scale).reshape(b, hq, lq, d)
    return torch.where(has_key[:, None, :, None], out, 0.0)  # not a product: NaN * 0 is NaN


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """Dense attention in the public layout: ``q [B, Lq, Hq, D]``, ``k``/``v`` ``[B, Lkv, Hkv, D]``.

    ``mask``: None or bool ``[B, Lkv]`` / ``[B, Lq, Lkv]`` (True = keep). Returns
    ``[B, Lq, Hq, D]``. Arguments are assumed validated.
    """
    b, lq, _, _ = q.shape
    lkv = k.shape[1]
    causal = is_causal and lq > 1
    window = variant.window_left >= 0
    distance = None if variant.alibi_slopes is None else _key_distance(lq, lkv, q.device)
    if _needs_explicit(variant) and mask is None and not causal and not window:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return _explicit_attention(qt, kt, vt, None, variant, distance).transpose(1, 2)
    if mask is None and not window and not _needs_explicit(variant) and (not causal or lq == lkv):
        finite = _finite_on_cpu(q, k)
        out = _sdpa_no_mask(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, finite, variant.scale)
    else:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        keep = torch.ones(b, lq, lkv, dtype=torch.bool, device=q.device)
        if mask is not None:
            keep = keep & (mask[:, None, :] if mask.dim() == 2 else mask)
            # Keys no query keeps (padding) never enter the result: zero them, so NaN/Inf
            # garbage there can't leak through SDPA's additive mask (NaN + -inf = NaN).
            dropped = ~keep.any(dim=1)[:, None, :, None]  # [B, 1, Lkv, 1] in the BHLD view
            kt, vt = kt.masked_fill(dropped, 0), vt.masked_fill(dropped, 0)
        if causal:
            keep = keep & _causal_mask(lq, lkv, q.device)
        if window:
            keep = keep & _window_mask(lq, lkv, variant.window_left, q.device)
        out = _sdpa_masked(qt, kt, vt, keep, variant, distance)
    return out.transpose(1, 2)


def paged_sdpa(q: torch.Tensor, kv_cache: PagedKVCache, layer_id: int, is_causal: bool,
               variant: AttentionVariant = PLAIN) -> torch.Tensor:
    """Attention of the plan's new tokens over the cache (after this step's append).

    ``q`` as the backend contract allows (``[B, L, Hq, D]`` or packed); returns ``q``'s shape.
    """
    plan = kv_cache.active_plan
    k, v, _ = kv_cache.gather_padded(layer_id, plan)  # [B, max_kv, Hkv, D]
    return planned_sdpa(q, plan, k, v, is_causal, variant)


def planned_sdpa(q: torch.Tensor, plan: BatchPlan, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 variant: AttentionVariant = PLAIN) -> torch.Tensor:
    """Attention of ``plan``'s new tokens over its requests' keys/values gathered as
    ``plan.padded_index`` orders them (``k`` / ``v`` ``[B, max_kv, Hkv, D]``, padding masked):
    the torch path of a paged call over any page storage (a :class:`PagedKVCache`, or pages
    another engine owns). ``q`` as :func:`paged_sdpa`'s; returns ``q``'s shape."""
    qp = plan.packed(q, "q")  # [total_q, Hq, D]
    uniform = plan.uniform_q_len is not None
    if uniform:
        q_pad = qp.reshape(plan.batch_size, plan.max_q_len, *qp.shape[1:])
    else:
        index, q_valid = plan.q_padded_index
        q_pad = qp[index]  # [B, max_q, Hq, D]
    keep = plan.keep_mask(is_causal, variant.window_left)
    distance = None if variant.alibi_slopes is None else _planned_key_distance(plan)
    out = _sdpa_masked(q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep, variant,
                       distance).transpose(1, 2)
    out = out.reshape(plan.total_q, *out.shape[2:]) if uniform else out[q_valid]
    return out.reshape(q.shape)


class TorchNativeBackend(AttentionBackend):
    """SDPA over dense or gathered K/V; runs every call the policy layer accepts, every variant
    feature included."""

    name = "torch_native"

    def check(self, call: AttentionCall) -> str | None:
        return None

    def forward(self, call, q, k, v, *, kv_cache=None, layer_id=None, mask=None, is_causal=False, appended=False,
                variant=PLAIN):
        if kv_cache is None:  # dense: straight to SDPA (the common tiny call pays no dispatch)
            return sdpa(q, k, v, mask, is_causal, variant)
        return super().forward(call, q, k, v, kv_cache=kv_cache, layer_id=layer_id, mask=mask, is_causal=is_causal,
                               appended=appended, variant=variant)

    def eager_runner(self, call, q, k, v, kv_cache):
        """Dense calls without a mask (causal only where Lq == Lkv): ``sdpa``'s path with its
        decisions made once; a CPU call still checks q and k for NaN/Inf every time."""
        lq, lkv = q.shape[1], k.shape[1]
        causal = call.causal and lq > 1
        if kv_cache is not None or call.mask_ndim or (causal and lq != lkv) or not _HAS_ENABLE_GQA:
            return None
        check = q.device.type == "cpu"
        wide = q.dtype in _WIDE
        gqa = q.shape[2] != k.shape[2]
        f32 = torch.float32

        def run(q, k, v, kv_cache, layer_id, appended):
            if check and not math.isfinite(q.sum().item() + k.sum().item() if wide else
                                           q.sum(dtype=f32).item() + k.sum(dtype=f32).item()):
                return sdpa(q, k, v, None, causal)  # the plain softmax, which keeps NaN
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, enable_gqa=gqa).transpose(1, 2)

        return run

    def fwd_prefill(self, q, k, v, *, kv_cache, layer_id, mask, is_causal, variant=PLAIN):
        if kv_cache is not None:
            return paged_sdpa(q, kv_cache, layer_id, is_causal, variant)
        return sdpa(q, k, v, mask, is_causal, variant)
