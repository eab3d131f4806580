"""Float64 references for attention and rotary, written for clarity, not speed.

Shared by the CPU tests and the GPU tests (``tests/gpu``): both import ``reference``.
"""

from __future__ import annotations

import math

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    *,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in float64. ``q [B, Lq, Hq, D]``, ``k``/``v`` ``[B, Lkv, Hkv, D]``;
    query head ``h`` reads kv head ``h // (Hq // Hkv)``. ``mask`` bool (True = keep)
    ``[B, Lkv]`` or ``[B, Lq, Lkv]``; causal is bottom-right aligned (row ``i`` keeps
    ``j <= i + Lkv - Lq``). Rows that keep no key are zeros; masked-out keys and values are
    never read. Returns float64 ``[B, Lq, Hq, D]``.

    Variants: ``window_left = W >= 0`` keeps ``j >= i + Lkv - Lq - W``; scores ``s = scale * q.k``
    (``scale`` default ``1/sqrt(D)``) become ``c * tanh(s / c)`` with ``logits_soft_cap = c``;
    ``sinks[h]`` adds ``exp(sinks[h])`` to head ``h``'s softmax denominator; ``alibi_slopes[h]``
    adds ``alibi_slopes[h] * (j - (i + Lkv - Lq))`` to head ``h``'s scaled scores, before the cap."""
    q, k, v = (t.detach().to(torch.float64).cpu() for t in (q, k, v))
    b, lq, hq, d = q.shape
    lkv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    keep = torch.ones(b, lq, lkv, dtype=torch.bool)
    if mask is not None:
        mask = mask.cpu()
        keep &= mask[:, None, :] if mask.dim() == 2 else mask
    i = torch.arange(lq)[:, None]
    j = torch.arange(lkv)[None, :]
    if is_causal:
        keep &= j <= i + (lkv - lq)
    if window_left >= 0:
        keep &= j >= i + (lkv - lq) - window_left
    has_key = keep.any(dim=-1, keepdim=True)  # [B, Lq, 1]
    out = torch.zeros(b, lq, hq, d, dtype=torch.float64)
    scale = 1 / math.sqrt(d) if scale is None else scale
    for h in range(hq):
        kh, vh = k[:, :, h // group], v[:, :, h // group]  # [B, Lkv, D]
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], kh) * scale
        if alibi_slopes is not None:
            scores = scores + float(alibi_slopes[h]) * (j - i - (lkv - lq)).to(torch.float64)
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~keep, float("-inf"))
        # Masked-out keys/values are never read (not even as 0 * NaN); rows without a key
        # are zeros; NaN/Inf at kept positions propagate.
        if sinks is None:
            probs = torch.where(has_key, torch.softmax(scores, dim=-1), 0.0)
        else:
            sink = float(sinks[h])
            top = torch.maximum(scores.amax(dim=-1, keepdim=True), torch.tensor(sink, dtype=torch.float64))
            e = torch.exp(scores - top)
            probs = e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
        terms = torch.where(keep[..., None], probs[..., None] * vh[:, None, :, :], 0.0)  # [B, Lq, Lkv, D]
        out[:, :, h] = terms.sum(dim=2)
    return out


def attention_ref64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    *,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_ref`` computed with float64 matmuls on the inputs' device (fast enough for
    the GPU tests' long sequences), with the scale of its rounding errors: returns
    ``(out, magnitude)``, both float64 ``[B, Lq, Hq, D]``, ``magnitude = sum_j p_j |v_j|``
    (see ``checks.attention_mismatch``). Values at masked-out positions must be finite.
    The variant arguments as in :func:`attention_ref`."""
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    b, lq, hq, d = q.shape
    lkv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    keep = torch.ones(b, lq, lkv, dtype=torch.bool, device=q.device)
    if mask is not None:
        mask = mask.to(q.device)
        keep &= mask[:, None, :] if mask.dim() == 2 else mask
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lkv, device=q.device)[None, :]
    if is_causal:
        keep &= j <= i + (lkv - lq)
    if window_left >= 0:
        keep &= j >= i + (lkv - lq) - window_left
    # [B, Hkv, G * Lq, D] against [B, Hkv, Lkv, D]: head h reads kv head h // group
    qh = q.permute(0, 2, 1, 3).reshape(b, hkv, group * lq, d)
    kh, vh = (t.permute(0, 2, 1, 3).contiguous() for t in (k, v))
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = (qh @ kh.transpose(-1, -2)).view(b, hkv, group, lq, lkv) * scale
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(q.device, torch.float64).view(1, hkv, group, 1, 1)
        scores = scores + slopes * (j - i - (lkv - lq)).to(torch.float64)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    keep = keep[:, None, None]
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        sink = sinks.to(q.device, torch.float64).view(1, hkv, group, 1, 1).expand(b, hkv, group, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.where(keep.any(dim=-1, keepdim=True), probs, 0.0)  # rows without a key: 0
    probs = probs.view(b, hkv, group * lq, lkv)

    def heads_last(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(b, hq, lq, d).permute(0, 2, 1, 3)

    return heads_last(probs @ vh), heads_last(probs @ vh.abs())


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on interleaved pairs, in float64: ``x [B, L, H, D]``, ``cos``/``sin`` ``[L, D/2]``."""
    x = x.detach().to(torch.float64).cpu()
    c = cos.detach().to(torch.float64).cpu()[None, :, None, :]
    s = sin.detach().to(torch.float64).cpu()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard RoPE tables (float32 ``[seq, head_dim // 2]``) for positions ``offset..offset+seq-1``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(offset, offset + seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``torch.testing.assert_close`` tolerances for results computed in ``dtype``."""
    return {
        torch.float64: dict(atol=1e-10, rtol=1e-10),
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    }[dtype]


def random_qkv(b=2, lq=6, lkv=6, hq=8, hkv=2, d=32, dtype=torch.float32, seed=0):
    """Seeded q, k, v of shapes [b, lq, hq, d], [b, lkv, hkv, d] (twice)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=g).to(dtype) for n, h in ((lq, hq), (lkv, hkv), (lkv, hkv)))
