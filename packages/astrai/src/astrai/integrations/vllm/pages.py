"""AstrAI's paged attention over a KV cache that vLLM allocated (no vLLM import here).

vLLM hands a layer's cache over as a tensor whose logical shape is ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` (keys in the first ``head_size`` of the last dim, values in the
second), laid out physically as the backend's ``supported_kv_cache_layouts`` allowed. Its
``transpose(1, 2)`` split in two is AstrAI's pages, ``[num_pages, page_size, kv_heads,
head_dim]`` for K and for V (:func:`page_views`): views with strides, never a copy. The paged
kernels read pages through their strides; the torch path gathers by index.

A batch's block table ``[num_reqs, max_blocks]`` is the kernels' page table as it stands:
``kv_indices`` is the table flattened (a view), ``kv_indptr[b] = b * max_blocks``, and each
row's columns past ``ceil(kv_len / page_size)`` are unused capacity, which
:class:`~astrai.extension.batch_plan.BatchPlan` allows (:func:`block_table_plan`).

- :func:`write_pages`: a step's keys/values into the slots vLLM's ``slot_mapping`` names
  (``page * page_size + offset``; negative slots are padding and skipped), quantized for an
  FP8 cache (``stored = x / scale``, vLLM's and AstrAI's convention alike);
- :func:`attend`: the plan's queries over the pages, causal bottom-right per request (chunked
  prefill and mixed prefill/decode batches alike): the astrai-attention plugin's
  ``attn_paged_decode`` / ``attn_paged_prefill`` where :func:`kernel_unsupported` finds
  nothing missing, else AstrAI's torch path (:func:`~astrai.extension.backend.attention.
  torch_native.planned_sdpa` over the gathered, dequantized pages).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...extension.backend.attention.torch_native import planned_sdpa
from ...extension.backend.attention.variant import AttentionVariant, missing_features
from ...extension.batch_plan import BatchPlan
from ...extension.kv_quant import dequantize, quantize
from ...extension.op_names import ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL

__all__ = ["FP8_CACHE_DTYPES", "attend", "block_table_plan", "cache_storage_dtype", "kernel_unsupported",
           "page_views", "write_pages"]

# vLLM's --kv-cache-dtype values for FP8 and the storage they mean
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pages' element type for vLLM's ``kv_cache_dtype`` string and the model's ``dtype``."""
    if kv_cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype in ("auto", str(dtype).removeprefix("torch.")):
        return dtype
    valid = ", ".join(["auto", str(dtype).removeprefix("torch."), *FP8_CACHE_DTYPES])
    raise ValueError(f"kv_cache_dtype must be one of {valid}, got {kv_cache_dtype!r}")


def page_views(kv_cache: torch.Tensor, head_size: int, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pages ``[num_pages, page_size, kv_heads, head_size]`` of ``storage`` viewing vLLM's
    layer cache (see the module docstring); no copy."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}: expected [num_blocks, kv_heads, "
                         f"block_size, 2 * head_size = {2 * head_size}]")
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    if k.dtype != storage:  # an FP8 cache arrives as bytes: same size, another name
        k, v = k.view(storage), v.view(storage)
    return k, v


def block_table_plan(block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     q_lens_host: Sequence[int], kv_lens_host: Sequence[int], page_size: int) -> BatchPlan:
    """The :class:`BatchPlan` of a vLLM batch: ``block_table [>= B, max_blocks]``, ``query_start_loc
    [>= B + 1]`` and ``seq_lens [>= B]`` (int32, on the device) as the builder got them; the host
    lengths of its ``B = len(q_lens_host)`` requests (``kv_lens_host`` may be upper bounds: the
    masks read the device ``seq_lens``). The page table is the block table's rows, in place."""
    batch = len(q_lens_host)
    if len(kv_lens_host) != batch:
        raise ValueError(f"kv_lens_host has {len(kv_lens_host)} entries for {batch} requests (q_lens_host)")
    if block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}: expected [>= {batch}, max_blocks]")
    width = block_table.shape[1]
    rows = block_table[:batch]
    int32 = torch.int32
    return BatchPlan(
        seq_ids=tuple(range(batch)),
        page_size=page_size,
        qo_indptr=query_start_loc[: batch + 1].to(int32),
        kv_indptr=torch.arange(batch + 1, dtype=int32, device=block_table.device) * width,
        kv_indices=(rows if rows.is_contiguous() else rows.contiguous()).view(-1).to(int32),
        kv_lens=seq_lens[:batch].to(int32),
        q_lens_host=tuple(int(n) for n in q_lens_host),
        kv_lens_host=tuple(int(n) for n in kv_lens_host),
    )


def _page_slots(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(slots, page_size, rounding_mode="floor"), slots % page_size


def write_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> None:
    """Write ``key`` / ``value`` ``[>= T, kv_heads, head_dim]`` (the first ``T = len(slot_mapping)``
    rows) into their slots; a negative slot is padding. FP8 pages take ``k_scale`` / ``v_scale``
    (float32, one value or one per KV head)."""
    slots = slot_mapping.long()
    n = slots.shape[0]
    key, value = key[:n], value[:n]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    page, offset = _page_slots(slots, k_pages.shape[1])
    fp8 = k_pages.dtype in FP8_CACHE_DTYPES.values()
    if fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale: FP8 pages need both k_scale and v_scale")
        store, u8 = k_pages.dtype, torch.uint8  # written and read as bytes: index_put_ needs no FP8 kernel
        k_pages.view(u8)[page, offset] = quantize(key, k_scale.reshape(-1).float(), store).view(u8)
        v_pages.view(u8)[page, offset] = quantize(value, v_scale.reshape(-1).float(), store).view(u8)
        return
    k_pages[page, offset] = key.to(k_pages.dtype)
    v_pages[page, offset] = value.to(v_pages.dtype)


def kernel_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int, features: tuple[str, ...],
                       storage: torch.dtype) -> str | None:
    """Why the astrai-attention plugin's paged kernels cannot run a layer on ``device`` (no
    plugin, the dtype, head dim, a variant feature or FP8 pages it lacks), or None."""
    if device.type != "cuda":
        return f"the paged kernels run on CUDA devices, not {device.type}"
    from ...extension.ops import _plugin  # the registry: read on CUDA only

    for op in (ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL):
        status = _plugin.op_status(op, device)
        if not status.usable:
            return f"{op}: {status.reason}"
        reason = status.spec.unsupported(str(dtype).removeprefix("torch."), head_dim)
        if reason is not None:
            return f"{op}: {reason}"
        missing = missing_features(features, status.spec.variants)
        if missing:
            return f"{op} lacks {', '.join(missing)} in this build"
        kv = str(storage).removeprefix("torch.")
        if storage != dtype and kv not in status.spec.kv_dtypes:
            return f"{op} reads {str(dtype).removeprefix('torch.')} pages in this build, not {kv}"
    return None


def attend(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: BatchPlan,
           variant: AttentionVariant, *, kernels: bool, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the plan's new tokens (``q [total_q, Hq, D]``) over their requests'
    pages, after this step's write; returns ``[total_q, Hq, D]`` of ``q``'s dtype. ``kernels``:
    run the plugin's paged kernels (:func:`kernel_unsupported` found nothing missing), else
    the torch path. FP8 pages take ``k_scale`` / ``v_scale``."""
    fp8 = k_pages.dtype in FP8_CACHE_DTYPES.values()
    if fp8:
        k_scale, v_scale = k_scale.reshape(-1).float(), v_scale.reshape(-1).float()
    else:
        k_scale = v_scale = None
    if kernels:
        from ...extension.ops import attention as attn_ops  # the plugin's ops: CUDA only
        from ...extension.ops.attention_args import variant_kwargs

        kwargs = dict(k_scale=k_scale, v_scale=v_scale, **variant_kwargs(variant))
        if plan.is_decode:
            out = attn_ops.attn_paged_decode(q.unsqueeze(1), k_pages, v_pages, plan.kv_indptr, plan.kv_indices,
                                             plan.kv_lens, **kwargs)
            return out.squeeze(1)
        tiles = plan.q_tiles(attn_ops.q_tile_rows(q.device))
        return attn_ops.attn_paged_prefill(q, k_pages, v_pages, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                           plan.kv_lens, *tiles, True, **kwargs)
    index, _ = plan.padded_index  # [B, max_kv] slots, padding masked by keep_mask
    page, offset = _page_slots(index, k_pages.shape[1])
    if fp8:
        store, u8 = k_pages.dtype, torch.uint8
        k = dequantize(k_pages.view(u8)[page, offset].view(store), k_scale, q.dtype)
        v = dequantize(v_pages.view(u8)[page, offset].view(store), v_scale, q.dtype)
    else:
        k, v = k_pages[page, offset], v_pages[page, offset]  # [B, max_kv, Hkv, D]
    return planned_sdpa(q, plan, k, v, True, variant)
