"""FP8 storage for the paged KV cache: the formats, the scales and the two conversions.

A quantized cache stores one byte per value::

    stored      = round_to_fp8(x / scale)        # nearest even, saturated to +-fp8 max
    dequantized = stored.to(float32) * scale

Saturation is explicit (a clamp before the cast), so an overflowing or infinite ``x``
becomes ``+-max`` in both formats, never inf or NaN; a NaN ``x`` stays NaN. ``scale`` is a
float32 dequantization scale per layer, for K and for V, per tensor (``[1]``) or per KV head
(``[kv_heads]``). The error bound is stated (and tested) in docs/kv_cache_fp8.md.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_KV_DTYPES", "SCALE_GRANULARITIES", "LayerScales", "calibrated_scale", "check_kv_dtype",
           "check_scale", "dequantize", "quantize"]

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_GRANULARITIES = ("tensor", "head")
_FP8_MAX = {dtype: float(torch.finfo(dtype).max) for dtype in FP8_KV_DTYPES}
# the smallest scale calibration returns: x / scale stays a float32 number for any x <= fp8 max * scale
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny


def check_kv_dtype(kv_dtype: object, dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for ``PagedKVCache(dtype=dtype, kv_dtype=kv_dtype)``: ``dtype`` itself
    for None (or ``dtype``: an unquantized cache), else one of :data:`FP8_KV_DTYPES`."""
    if kv_dtype is None or kv_dtype == dtype:
        return dtype
    if kv_dtype in FP8_KV_DTYPES:
        return kv_dtype
    valid = ", ".join(["None", str(dtype), *map(str, FP8_KV_DTYPES)])
    raise TypeError(f"kv_dtype must be one of {valid}, got {kv_dtype!r}")


def check_granularity(granularity: object) -> str:
    if granularity not in SCALE_GRANULARITIES:
        raise ValueError(f"kv_scale_granularity must be one of {SCALE_GRANULARITIES}, got {granularity!r}")
    return granularity


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    """``[G]`` -> ``[G, 1]``: broadcasts over ``[..., kv_heads, head_dim]`` for G = 1 or kv_heads."""
    return scale.view(-1, 1)


def quantize(x: torch.Tensor, scale: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """``round_to_fp8(x / scale)`` saturated; ``x [..., kv_heads, head_dim]``, ``scale`` float32 ``[G]``."""
    limit = _FP8_MAX[kv_dtype]
    # a float32 scale of dim >= 1 takes part in type promotion: a bf16/fp16 x is divided in float32
    return (x.detach() / _per_head(scale)).clamp_(-limit, limit).to(kv_dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stored.to(float32) * scale`` in ``dtype``; ``stored`` fp8 ``[..., kv_heads, head_dim]``."""
    return (stored.to(torch.float32) * _per_head(scale)).to(dtype)


def calibrated_scale(x: torch.Tensor, granularity: str, kv_dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[G]``: ``amax(|x|) / fp8 max`` over the finite values of ``x [..., kv_heads,
    head_dim]``, per tensor or per KV head. A group without a nonzero finite value gets the
    unit scale ``1 / fp8 max`` (values up to 1 keep full precision); none is below float32's
    smallest normal number."""
    magnitude = x.detach().abs().to(torch.float32).nan_to_num_(0.0, posinf=0.0)
    if granularity == "tensor":
        amax = magnitude.amax().reshape(1)
    else:
        amax = magnitude.amax(dim=[d for d in range(x.dim()) if d != x.dim() - 2])
    amax = torch.where(amax > 0, amax, 1.0)
    return (amax / _FP8_MAX[kv_dtype]).clamp_(min=_SMALLEST_SCALE)


def check_scale(name: str, value: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``value`` (a number, or a floating tensor of ``shape`` on ``device``; ``[1]`` also takes a
    0-d tensor) as float32 ``shape``; every element finite and > 0, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a float or a torch.Tensor, got {type(value).__name__}")
    if isinstance(value, torch.Tensor):
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the kv_cache is on {device}")
        if tuple(value.shape) != shape and not (shape == (1,) and value.dim() == 0):
            raise ValueError(f"{name} has shape {tuple(value.shape)}: expected {shape}")
        scale = value.detach().to(torch.float32).reshape(shape)
    else:
        scale = torch.full(shape, float(value), dtype=torch.float32, device=device)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"{name} must be finite and > 0 (in float32), got {scale.tolist()}")
    return scale


class LayerScales:
    """Per-layer K and V dequantization scales of an FP8 cache, and whether a layer's pages hold
    values quantized with them (then they may not change). The caller holds the cache's lock."""

    def __init__(self, num_layers: int, kv_heads: int, granularity: str, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.granularity = granularity
        self.kv_dtype = kv_dtype
        self.shape = (1,) if granularity == "tensor" else (kv_heads,)
        # one [num_layers, G] tensor each: a kernel can take every layer's scales as one pointer
        self.k = torch.ones(num_layers, *self.shape, dtype=torch.float32, device=device)
        self.v = torch.ones_like(self.k)
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)
        self._known = [False] * num_layers  # set, or calibrated by the first append
        self._written = [False] * num_layers

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self._k_layers[layer], self._v_layers[layer]) if self._known[layer] else None

    def for_read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k_layers[layer], self._v_layers[layer]

    def set(self, layer: int, k_scale: object, v_scale: object) -> None:
        device = self.k.device
        k = check_scale("k_scale", k_scale, self.shape, device)
        v = check_scale("v_scale", v_scale, self.shape, device)
        if self._written[layer]:
            raise RuntimeError(
                f"layer {layer} already stores values quantized with its scales: set them before the layer's "
                "first append, or once every sequence holding tokens is released")
        self._k_layers[layer].copy_(k)
        self._v_layers[layer].copy_(v)
        self._known[layer] = True

    def for_append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's scales, calibrated from ``k`` / ``v`` first when none is known yet."""
        if not self._known[layer]:
            self._k_layers[layer].copy_(calibrated_scale(k, self.granularity, self.kv_dtype))
            self._v_layers[layer].copy_(calibrated_scale(v, self.granularity, self.kv_dtype))
            self._known[layer] = True
        self._written[layer] = True
        return self._k_layers[layer], self._v_layers[layer]

    def forget_writes(self) -> None:
        """No sequence holds tokens any more: what the pages store is dead, scales may change."""
        self._written = [False] * len(self._written)
