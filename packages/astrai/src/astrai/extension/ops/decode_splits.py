"""Split-KV planning of the decode ops: the module's split count for a call, and the float32
partials (workspaces) a split launch writes before its combine."""

from __future__ import annotations

import functools

import torch

from ..abi import DTYPE_CODES


@functools.lru_cache(maxsize=None)
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """SMs of ``device``, asked of the driver once per device."""
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())


def fp8_plan_arg(kv_bytes: int) -> dict:
    """``decode_plan``'s keyword for FP8 pages (none for 16-bit ones: older modules lack it)."""
    return {"kv_bytes": 1} if kv_bytes == 1 else {}


def _planned_splits(module, q: torch.Tensor, kv_heads: int, kv_len_hint: int, kv_bytes: int = 2) -> int:
    """The module's split-KV count for ``q [B, 1, Hq, D]`` over ``kv_len_hint`` tokens a request."""
    batch, _, q_heads, head_dim = q.shape
    group = q_heads // kv_heads if kv_heads and q_heads % kv_heads == 0 else 1
    return module.decode_plan(batch, kv_heads, group, head_dim, kv_len_hint, _num_sms(q.device),
                              **fp8_plan_arg(kv_bytes))


def _decode_workspace(module, q: torch.Tensor, kv_heads: int, kv_len_hint: int, kv_bytes: int = 2):
    splits = _planned_splits(module, q, kv_heads, kv_len_hint, kv_bytes)
    return (splits, *_split_workspaces(splits, q.shape[0], q.shape[2], q.shape[3], q.device))


def _split_workspaces(splits: int, batch: int, q_heads: int, head_dim: int, device: torch.device):
    """(ws_o, ws_lse) float32 partials of a split-KV launch; (None, None) without a split."""
    if splits <= 1:
        return None, None
    ws_o = torch.empty(splits * batch * q_heads * head_dim, dtype=torch.float32, device=device)
    ws_lse = torch.empty(splits * batch * q_heads, dtype=torch.float32, device=device)
    return ws_o, ws_lse


def _split_count(module, q: torch.Tensor, k_cache: torch.Tensor, kv_indices: torch.Tensor, num_splits: int) -> int:
    """A paged decode's split-KV count: ``num_splits`` (> 1), planned from shapes (0), else 1."""
    if q.dim() != 4:
        return 1
    if num_splits > 1:
        return num_splits
    if num_splits == 0 and k_cache.dim() == 4 and q.shape[0] > 0:
        # Mean tokens per request from shapes only (graph-capturable): pages * page / batch.
        hint = -(-kv_indices.numel() * k_cache.shape[1] // q.shape[0])
        return _planned_splits(module, q, k_cache.shape[2], hint, k_cache.element_size())
    return 1


def _split_workspace_shapes(splits: int, q_shape: tuple) -> tuple | None:
    """The shapes of what ``_split_workspaces`` allocates for ``q [B, 1, Hq, D]``, with their
    strides and dtype code: ``((ws_o shape, ws_lse shape), (1,), float32's code)``; None
    without a split."""
    if splits <= 1:
        return None
    batch, _, q_heads, head_dim = q_shape
    return ((splits * batch * q_heads * head_dim,), (splits * batch * q_heads,)), (1,), DTYPE_CODES[torch.float32]
