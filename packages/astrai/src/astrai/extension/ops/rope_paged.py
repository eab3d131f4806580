"""``rope_paged_append``: one decode/prefill step's rotary and KV-cache write in one launch.

``rope_paged_append(q, k, v, k_cache, v_cache, cos, sin, positions, slots, interleaved)``
rotates ``q [T, Hq, D]`` into a new tensor (returned), rotates ``k [T, Hk, D]`` and writes it,
and ``v [T, Hk, D]`` as is, to row ``slots[t]`` of a layer's pages ``k_cache`` / ``v_cache``
``[num_pages, page_size, Hk, D]`` (viewed as ``[num_pages * page_size, Hk, D]``).
``positions [T]`` (int32/int64) pick the rows of ``cos`` / ``sin`` (float32
``[max_pos, rotary_dim // 2]``); ``slots [T]`` are int64. FP8 pages (``float8_e4m3fn`` /
``float8_e5m2``) take the layer's ``k_scale`` / ``v_scale`` (float32 ``[1]`` or ``[Hk]``) and
store ``round_to_fp8(x / scale)``, the bytes ``PagedKVCache.append`` writes. A custom op
(``torch.ops.astrai.rope_paged_append``, mutating the two caches) with a fake
implementation; callers validate (``backend/rope_paged.py`` does).

Call convention (ABI 1): ``module.rope_paged_append(q, k, v, k_cache, v_cache, cos, sin,
positions, slots, q_out, interleaved, stream, kv_scales=None)``.
"""

from __future__ import annotations

import torch

from ..abi import launch, tensor_arg
from ..op_names import ROPE_PAGED_APPEND
from . import _plugin

__all__ = ["rope_paged_append_unchecked"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


@_plugin.plugin_op(f"astrai::{ROPE_PAGED_APPEND}", mutates_args=("k_cache", "v_cache"))
def rope_paged_append_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                slots: torch.Tensor, interleaved: bool, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    module = _plugin.require(ROPE_PAGED_APPEND, q.device)
    q, k, v = _rows(q), _rows(k), _rows(v)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    scales = {} if k_scale is None else {"kv_scales": (tensor_arg(k_scale), tensor_arg(v_scale))}
    launch(q.device, module.rope_paged_append, tensor_arg(q), tensor_arg(k), tensor_arg(v), tensor_arg(k_cache),
           tensor_arg(v_cache), tensor_arg(_rows(cos)), tensor_arg(_rows(sin)), tensor_arg(positions),
           tensor_arg(slots), tensor_arg(q_out), interleaved, **scales)
    return q_out


@rope_paged_append_unchecked.op.register_fake
def _rope_paged_append_fake(q, k, v, k_cache, v_cache, cos, sin, positions, slots, interleaved, k_scale=None,
                            v_scale=None):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
