"""What every attention backend implements, and the call summary backends are chosen by.

A backend plugs into :func:`astrai.extension.attention` by subclassing
:class:`AttentionBackend`:

- ``name``: one of the :class:`~astrai.extension.backend.attention.ATTN_BACKEND` values
  (``"cuda"``, ``"flash"``, ``"torch_native"``);
- ``check(call)``: ``None`` when the backend can run the call, else the reason it can't.
  It sees only the :class:`AttentionCall` (never tensors), so the resolver can cache the
  decision per call class;
- ``fwd_decode`` / ``fwd_prefill``: run a call already validated by the policy layer.

Calling convention of ``fwd_decode`` / ``fwd_prefill`` (keyword arguments after q, k, v):

- without a cache: ``q [B, Lq, Hq, D]``, ``k``/``v`` ``[B, Lkv, Hkv, D]``, ``mask`` None or
  bool (True = keep) ``[B, Lkv]`` / ``[B, Lq, Lkv]``, ``is_causal`` a bool (causal is
  bottom-right aligned: row ``i`` sees ``j <= i + Lkv - Lq``);
- with a cache: the layer's new keys/values were already written by :meth:`forward`;
  ``k``/``v`` are those new tokens (backends read K/V from the cache instead). The batch's
  metadata is ``kv_cache.active_plan`` (a :class:`~astrai.extension.kv_cache.BatchPlan`);
  ``kv_cache.k_cache(layer_id)`` / ``v_cache(layer_id)`` are the layer's pages
  ``[num_pages, page_size, Hkv, D]``. ``q`` is ``[B, L, Hq, D]`` (every request adds ``L``
  tokens) or packed ``[1, total_q, Hq, D]``; ``plan.packed(q, "q")`` gives
  ``[total_q, Hq, D]`` either way. ``mask`` is None; ``is_causal`` is per request, with the
  new tokens at the end of each request's cache.

``variant`` (an :class:`~.variant.AttentionVariant`) carries the window, soft-cap, sinks and
scale of the call (``PLAIN``: none, scale ``1 / sqrt(head_dim)``); ``call.features`` names the
ones that are set, and ``check`` must reject a call with a feature the backend lacks.

The result has ``q``'s shape and dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from ...kv_cache import PagedKVCache
from .variant import PLAIN, AttentionVariant

__all__ = ["AttentionBackend", "AttentionCall"]


class AttentionCall(NamedTuple):
    """The shape class of one ``attention`` call: what backends decide on, and the
    resolver's cache key. Only small, slowly varying facts: never sequence lengths.
    Immutable and hashable (a named tuple: cheap to build on every call)."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int
    mode: str  # "decode" (one new query token per request) or "prefill"
    fwd: str | None  # the caller's hint: None, "decode" or "prefill"
    causal: bool
    mask_ndim: int  # 0 (no mask), 2 or 3
    paged: bool  # a PagedKVCache was given
    page_size: int | None
    needs_grad: bool  # autograd will differentiate through the result
    # dense prefill on CUDA: (query rows, kv length) rounded up to powers of two, for measured
    # preference tables; () for every other call
    size_class: tuple[int, ...] = ()
    op: str = "attention"
    features: tuple[str, ...] = ()  # the variant's arguments that are set (variant.FEATURES)
    kv_dtype: torch.dtype | None = None  # a cache's storage dtype (fp8 caches differ from dtype)

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def group(self) -> int:
        """Query heads per kv head (the GQA ratio)."""
        return self.q_heads // self.kv_heads

    @property
    def training(self) -> bool:
        """A training-style call: no cache and no decode/prefill hint."""
        return self.fwd is None and not self.paged

    def __str__(self) -> str:
        parts = [
            f"{self.mode}",
            f"{self.device}",
            str(self.dtype).replace("torch.", ""),
            f"d{self.head_dim}",
            f"heads {self.q_heads}/{self.kv_heads}",
        ]
        if self.causal:
            parts.append("causal")
        if self.mask_ndim:
            parts.append(f"mask {self.mask_ndim}D")
        if self.paged:
            parts.append(f"paged (page {self.page_size})")
        if self.kv_dtype is not None and self.kv_dtype != self.dtype:
            parts.append(f"kv {str(self.kv_dtype).replace('torch.', '')}")
        if self.needs_grad:
            parts.append("grad")
        parts.extend(self.features)
        return " ".join(parts)


class AttentionBackend(ABC):
    """One implementation of attention. Subclasses set ``name`` and implement
    ``check`` and ``fwd_prefill`` (and ``fwd_decode`` where decode has a path of its own); see the
    module docstring."""

    name: str = ""

    @abstractmethod
    def check(self, call: AttentionCall) -> str | None:
        """None when this backend can run ``call``; otherwise the reason it can't."""

    def fwd_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv_cache: PagedKVCache | None,
        layer_id: int | None,
        mask: torch.Tensor | None,
        is_causal: bool,
        variant: AttentionVariant = PLAIN,
    ) -> torch.Tensor:
        """Attention for one new query token per request: by default the prefill of that one
        token (a backend with a kernel of its own for decode overrides it)."""
        return self.fwd_prefill(q, k, v, kv_cache=kv_cache, layer_id=layer_id, mask=mask, is_causal=is_causal,
                                variant=variant)

    @abstractmethod
    def fwd_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv_cache: PagedKVCache | None,
        layer_id: int | None,
        mask: torch.Tensor | None,
        is_causal: bool,
        variant: AttentionVariant = PLAIN,
    ) -> torch.Tensor:
        """Attention for any number of query tokens per request."""

    def forward(
        self,
        call: AttentionCall,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        kv_cache: PagedKVCache | None = None,
        layer_id: int | None = None,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        appended: bool = False,
        variant: AttentionVariant = PLAIN,
    ) -> torch.Tensor:
        """Write the new tokens to the cache (if any, unless ``appended``: already written), then
        run decode or prefill by ``call.mode``."""
        if kv_cache is not None and not appended:
            kv_cache.append(layer_id, k, v, checked=True)  # the policy layer validated k, v, layer_id
        run = self.fwd_decode if call.mode == "decode" else self.fwd_prefill
        return run(q, k, v, kv_cache=kv_cache, layer_id=layer_id, mask=mask, is_causal=is_causal, variant=variant)

    def eager_runner(self, call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: PagedKVCache | None):
        """Optional: what this backend runs for eager calls like this one (plain tensors of the
        same shapes, dtypes and devices; with a cache, also the same strides and plan; never for a
        call with variant features), the
        per-call work reduced to a launch: ``run(q, k, v, kv_cache, layer_id, appended)`` doing
        what :meth:`forward` does. None (the default): the policy calls :meth:`forward`."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
