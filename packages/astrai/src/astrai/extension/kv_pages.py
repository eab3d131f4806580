"""The page storage of :class:`~astrai.extension.kv_cache.PagedKVCache`: its layers' pages, the
writes of a step's keys/values into them, the gathers that read them back and an FP8 cache's
per-layer scales. A base of the cache, which builds the storage (``__init__``) and owns the
sequences, pages and plans; this class reads what it built: ``num_layers``, ``num_pages``,
``page_size``, ``kv_heads``, ``head_dim``, ``dtype``, ``kv_dtype``, ``device``, ``active_plan``,
``_k_layers`` / ``_v_layers`` (page views per layer), ``_k_slots`` / ``_v_slots`` (slot views,
bytes for FP8), ``_scales`` (:class:`~astrai.extension.kv_quant.LayerScales` or None),
``_dtype``, ``_steps`` and ``_lock``.
"""

from __future__ import annotations

import functools

import torch

from .batch_plan import BatchPlan
from .kv_quant import dequantize, quantize

__all__ = ["PageStore", "locked"]


def locked(method):
    """Run ``method`` holding the cache's lock (one allocator and page table, many threads)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return call



class PageStore:
    """The cache's page storage (see the module docstring)."""

    # -- layers

    def check_layer(self, layer_id: object) -> int:
        """Return ``layer_id`` if it names a stored layer, else raise naming ``layer_id``."""
        if not isinstance(layer_id, int) or isinstance(layer_id, bool):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id {layer_id} is out of range: the cache holds {self.num_layers} layers")
        return layer_id

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._k_layers[self.check_layer(layer_id)]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._v_layers[self.check_layer(layer_id)]

    @locked
    def kv_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer_id``'s ``(k_scale, v_scale)`` dequantization scales, float32 ``[1]`` or
        ``[kv_heads]`` on the cache's device (live views: change them with :meth:`set_kv_scales`);
        None for an unquantized cache and before the layer's scales are set or calibrated."""
        layer_id = self.check_layer(layer_id)
        return None if self._scales is None else self._scales.get(layer_id)

    @locked
    def scales_for_append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 layer's ``(k_scale, v_scale)`` for a kernel that quantizes ``k`` / ``v`` into
        the pages itself: calibrated on them first where the layer has none, as :meth:`append`
        does, and fixed from then on. None for an unquantized cache."""
        if self._scales is None:
            return None
        return self._scales.for_append(self.check_layer(layer_id), k, v)

    @locked
    def set_kv_scales(self, layer_id: int, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor) -> None:
        """Fix layer ``layer_id``'s dequantization scales (instead of calibrating on its first append).

        Each a positive finite number (every group) or a floating tensor of the granularity's
        shape on the cache's device. Refused (nothing changes) for bad scales, and while the
        layer's pages hold values quantized with its current scales.
        """
        layer_id = self.check_layer(layer_id)
        if self._scales is None:
            raise TypeError(
                f"set_kv_scales needs an FP8 cache: this one stores {self.kv_dtype} (build it with "
                "kv_dtype=torch.float8_e4m3fn or torch.float8_e5m2)")
        self._scales.set(layer_id, k_scale, v_scale)

    # -- writes and reads

    def check_tokens(self, name: str, t: object, plan: BatchPlan, heads: int | None = -1) -> torch.Tensor:
        """``t`` (the plan's new tokens: keys, values or queries) checked against this cache's
        dtype, device and head_dim, and packed to ``[total_q, heads, head_dim]``. ``heads``: the
        head count it must have (-1: the cache's ``kv_heads``; None: any)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != self.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but the kv_cache stores {self.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device} but the kv_cache is on {self.device}")
        heads = self.kv_heads if heads == -1 else heads
        if t.dim() not in (3, 4) or t.shape[-1] != self.head_dim or (heads is not None and t.shape[-2] != heads):
            count = "heads" if heads is None else f"kv_heads={heads}" if heads == self.kv_heads else heads
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected [..., {count}, head_dim={self.head_dim}] "
                             "as the kv_cache stores")
        return plan.packed(t, name)

    @locked
    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, plan: BatchPlan | None = None, *,
               checked: bool = False) -> None:
        """Write layer ``layer_id``'s keys/values of the plan's new tokens into their pages.

        ``k`` / ``v``: ``[total_q, kv_heads, head_dim]``, ``[1, total_q, ...]`` or
        ``[B, L, ...]`` with uniform q lengths (see :meth:`BatchPlan.packed`). ``checked``:
        the caller already validated ``layer_id``, ``k`` and ``v`` against this cache and
        plan (``attention()`` does), so only the write runs.
        """
        plan = self.active_plan if plan is None else plan
        if checked:
            k, v = plan.packed(k, "k"), plan.packed(v, "v")
        else:
            layer_id = self.check_layer(layer_id)
            k = self.check_tokens("k", k, plan)
            v = self.check_tokens("v", v, plan)
        index = plan.write_index
        if self._scales is None:
            self._k_slots[layer_id].index_copy_(0, index, k.detach() if k.requires_grad else k)
            self._v_slots[layer_id].index_copy_(0, index, v.detach() if v.requires_grad else v)
        else:
            k_scale, v_scale = self._scales.for_append(layer_id, k, v)
            self._k_slots[layer_id].index_copy_(0, index, quantize(k, k_scale, self.kv_dtype).view(torch.uint8))
            self._v_slots[layer_id].index_copy_(0, index, quantize(v, v_scale, self.kv_dtype).view(torch.uint8))
        if not self._steps.mark_latest(layer_id, plan):
            self._steps.mark(layer_id, plan)

    def gather_flat(self, layer_id: int, plan: BatchPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of every request, concatenated: ``[total_kv, kv_heads, head_dim]`` each."""
        plan = self.active_plan if plan is None else plan
        index = plan.flat_index
        if self._scales is not None:
            return self._dequantized(layer_id, index)
        return self._flat(self.k_cache(layer_id))[index], self._flat(self.v_cache(layer_id))[index]

    def gather_padded(
        self, layer_id: int, plan: BatchPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, valid)``: ``[B, max_kv, kv_heads, head_dim]`` keys/values and bool ``[B, max_kv]``.

        Positions past a request's length are filler (valid False) and must be masked.
        """
        plan = self.active_plan if plan is None else plan
        index, valid = plan.padded_index
        if self._scales is not None:
            return *self._dequantized(layer_id, index), valid
        return self._flat(self.k_cache(layer_id))[index], self._flat(self.v_cache(layer_id))[index], valid

    def _dequantized(self, layer_id: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 layer's keys/values at the token slots ``index``, gathered as bytes, in :attr:`dtype`."""
        layer_id = self.check_layer(layer_id)
        k_scale, v_scale = self._scales.for_read(layer_id)
        k = self._k_slots[layer_id][index].view(self.kv_dtype)
        v = self._v_slots[layer_id][index].view(self.kv_dtype)
        return dequantize(k, k_scale, self._dtype), dequantize(v, v_scale, self._dtype)

    def _flat(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.view(self.num_pages * self.page_size, self.kv_heads, self.head_dim)
