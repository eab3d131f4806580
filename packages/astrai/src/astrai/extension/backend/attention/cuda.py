"""Attention through the astrai-attention plugin's paged kernels.

- decode (one new token per request): ``attn_paged_decode`` over the layer's pages with
  the plan's ``kv_indptr`` / ``kv_indices`` / ``kv_lens`` (split-KV, graph-capturable);
- prefill and mixed batches (any q lengths, ragged): ``attn_paged_prefill`` over the
  packed ``[total_q, Hq, D]`` query with the plan's ``qo_indptr`` and its Q tiles of the
  module's ``Q_TILE_ROWS`` (causal bottom-right per request, or full).

Per batch, the launch is planned once (:mod:`astrai.extension.ops.attention_plan`: split
count from the plugin's C++ planner, workspaces, converted page table), by the first layer's
call and, from then on, by ``PagedKVCache.plan`` through a preparer this backend registers
on the cache; every layer's call then only launches.

A long prefill over FP8 pages, or over pages scattered through the cache, runs the 16-bit
kernels over the step's pages gathered in order (and dequantized) first (:mod:`.ordered_pages`);
shorter ones read the pages in place.

Variants (window, soft-cap, sinks, scale) run in the kernels where the op's manifest states
them (``variants``); the values reach the launch beside the call.

Dense prefill (no cache, no gradients) runs ``attn_prefill`` where the plugin's measured
table for the device's arch (the op's manifest ``prefer`` entry, against the torch path)
says it is faster at the call's size class; elsewhere the backend is passed over with the
measured reason and flash-attn or torch SDPA runs the call (an explicit
``attn_backend(ATTN_BACKEND.CUDA)`` still runs it). Dense decode and calls that need
gradients (no backward kernel) are declined.
"""

from __future__ import annotations

import weakref

import torch

from ...abi import tensor_arg
from ...device import probe_device
from ...kv_cache import BatchPlan, PagedKVCache
from ...op_names import ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL, ATTN_PREFILL
from .. import prefer
from ...ops import attention as attn_ops
from ...ops.attention_args import variant_kwargs
from ...ops.attention_plan import plan_paged_decode, plan_paged_prefill
from ...runtime import current_runtime
from . import ordered_pages
from .base import AttentionBackend, AttentionCall
from .ordered_pages import GatheredPrefill, gather_pays
from .variant import PLAIN, missing_features

__all__ = ["CudaBackend"]


class CudaBackend(AttentionBackend):
    """The astrai-attention plugin's paged decode / ragged prefill kernels, and its dense
    prefill where measured faster than torch."""

    name = "cuda"

    def check(self, call: AttentionCall) -> str | None:
        if call.device_type != "cuda":
            return f"the CUDA kernels need CUDA tensors, got {call.device}"
        if call.needs_grad:
            return "the CUDA kernels have no backward pass (call needs gradients)"
        if not call.paged:
            if call.mode == "decode":
                return "dense decode runs on torch SDPA (the plugin's decode serves a PagedKVCache)"
            return self._op_unsupported(ATTN_PREFILL, call)
        if call.mask_ndim:
            return "the paged CUDA kernels take no explicit mask"
        op = ATTN_PAGED_DECODE if call.mode == "decode" else ATTN_PAGED_PREFILL
        return self._op_unsupported(op, call) or _unsupported_pages(op, call)

    def slower_than_peer(self, call: AttentionCall) -> str | None:
        """Dense prefill: why torch runs instead, unless the measured table says we are faster.
        The table measured plain attention against SDPA; a window, soft-cap, sinks or ALiBi send torch
        to its masked or explicit path, which it did not measure: the kernel runs those."""
        if call.paged or _beyond_scale(call):
            return None
        verdict = self._measured(call)
        if verdict is None:
            return "attn_prefill: no measured table against torch for this GPU's arch; torch is used"
        return None if verdict.plugin_faster else f"attn_prefill: {verdict.reason}"

    def why_capable(self, call: AttentionCall) -> str | None:
        if call.paged and call.mode != "decode":
            return ordered_pages.explain(call.kv_dtype not in (None, call.dtype), call.kv_dtype or call.dtype)
        if not call.paged and _beyond_scale(call):
            return f"attn_prefill: {', '.join(call.features)} (torch runs them unfused)"
        verdict = None if call.paged else self._measured(call)
        return None if verdict is None else f"attn_prefill: {verdict.reason}"

    @staticmethod
    def _measured(call: AttentionCall) -> prefer.Verdict | None:
        device = probe_device(call.device)
        status = current_runtime().registry.op_status(ATTN_PREFILL, device)
        mode = "masked" if call.mask_ndim else "causal" if call.causal else "full"
        verdict = prefer.verdict(status.spec.prefer, device.sm, (*call.size_class, call.head_dim), mode)
        if verdict is None or not verdict.plugin_faster:
            return verdict
        return _unmeasured_group(status.spec.prefer, device.sm, call) or verdict

    @staticmethod
    def _op_unsupported(op: str, call: AttentionCall) -> str | None:
        status = current_runtime().registry.op_status(op, probe_device(call.device))
        if not status.usable:
            return f"{op}: {status.reason}"
        # dtypes, head dims and variants as the plugin's manifest states them (archs: the registry)
        reason = status.spec.unsupported(str(call.dtype).removeprefix("torch."), call.head_dim)
        missing = missing_features(call.features, status.spec.variants) if reason is None else ()
        if missing:
            takes = ", ".join(status.spec.variants) or "no variant"
            return f"{op} lacks {', '.join(missing)} in this build (it takes {takes})"
        return reason

    def forward(self, call, q, k, v, *, kv_cache=None, layer_id=None, mask=None, is_causal=False, appended=False,
                variant=PLAIN):
        if kv_cache is None:  # dense prefill: the contiguous kernel on the caller's tensors
            return attn_ops.attn_prefill(q, k, v, mask, bool(is_causal), **variant_kwargs(variant))
        if call.mode == "decode" and type(q) is torch.Tensor and not torch.compiler.is_compiling():
            return self._decode_step(q, k, v, kv_cache, layer_id, appended, variant)
        return super().forward(call, q, k, v, kv_cache=kv_cache, layer_id=layer_id, mask=mask, is_causal=is_causal,
                               appended=appended, variant=variant)

    def _decode_step(self, q, k, v, kv_cache: PagedKVCache, layer_id: int, appended: bool,
                     variant=PLAIN) -> torch.Tensor:
        """An eager decode call, validated by the policy layer: the step's keys/values are
        written by the decode launch itself where the compiled module can (one binding call;
        with ``append_last``, one kernel launch)."""
        plan = kv_cache.active_plan
        launch = self._launch(kv_cache, plan, q.shape[2], True)
        cache_args = _layer_args(kv_cache, layer_id)
        q_rows = q if q.shape[1] == 1 else q.reshape(q.shape[1], 1, q.shape[2], q.shape[3])  # packed [1, B, ...]
        if launch.appends and not appended:
            scales = _fp8_scales(kv_cache, layer_id, k, v)
            out = launch.run_eager(q_rows, cache_args, k, v, variant=variant, kv_scales=scales)
            kv_cache.mark_written(layer_id, plan)
        else:
            if not appended:
                kv_cache.append(layer_id, k, v, plan, checked=True)
            out = launch.run_eager(q_rows, cache_args, variant=variant, kv_scales=_fp8_scales(kv_cache, layer_id))
        return out if q_rows is q else out.reshape(q.shape)

    def eager_runner(self, call, q, k, v, kv_cache):
        """``_decode_step`` for a plan's eager decode calls of this kind, with the launch's
        arguments but the data pointers converted once (``PagedDecodeLaunch.runner``)."""
        if kv_cache is None or call.mode != "decode" or q.shape[1] != 1:  # packed [1, B] queries: forward
            return None
        fp8 = kv_cache.kv_dtype != kv_cache.dtype  # FP8 pages: each call passes its layer's scales
        plan = kv_cache.active_plan
        launch = self._launch(kv_cache, plan, q.shape[2], True)
        bound = launch.runner(q, k, v) if launch.appends else launch.runner(q)
        if bound is None:
            return None
        appends = launch.appends
        layers = _LAYER_ARGS.get(kv_cache) or _LAYER_ARGS.setdefault(kv_cache, {})

        def run(q, k, v, kv_cache: PagedKVCache, layer_id: int, appended: bool) -> torch.Tensor:
            cache_args = layers.get(layer_id) or _layer_args(kv_cache, layer_id)
            if appended:
                return bound(q, cache_args, None, None, kv_cache.kv_scales(layer_id) if fp8 else None)
            if appends:  # an FP8 layer's scales are calibrated on its first append, as append() does
                out = bound(q, cache_args, k, v, kv_cache.scales_for_append(layer_id, k, v) if fp8 else None)
                kv_cache.mark_written(layer_id, plan)
                return out
            kv_cache.append(layer_id, k, v, kv_cache.active_plan, checked=True)
            return bound(q, cache_args, None, None, kv_cache.kv_scales(layer_id) if fp8 else None)

        return run

    def fwd_decode(self, q, k, v, *, kv_cache: PagedKVCache | None, layer_id, mask, is_causal,
                   variant=PLAIN) -> torch.Tensor:
        plan = kv_cache.active_plan
        q_rows = plan.packed(q, "q").unsqueeze(1)  # [B, 1, Hq, D], one row per request
        k_pages, v_pages = kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id)
        scales = _fp8_scales(kv_cache, layer_id)
        if torch.compiler.is_compiling():  # the registered op plans inside the traced graph
            k_scale, v_scale = scales or (None, None)
            out = attn_ops.attn_paged_decode(q_rows, k_pages, v_pages, plan.kv_indptr, plan.kv_indices, plan.kv_lens,
                                             k_scale=k_scale, v_scale=v_scale, **variant_kwargs(variant))
        else:
            out = self._launch(kv_cache, plan, q_rows.shape[2], True)(q_rows, k_pages, v_pages, variant=variant,
                                                                      kv_scales=scales)
        return out.reshape(q.shape)

    def fwd_prefill(self, q, k, v, *, kv_cache: PagedKVCache | None, layer_id, mask, is_causal,
                    variant=PLAIN) -> torch.Tensor:
        plan = kv_cache.active_plan
        q_rows = plan.packed(q, "q")  # [total_q, Hq, D]
        k_pages, v_pages = kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id)
        scales = _fp8_scales(kv_cache, layer_id)  # the step's keys are appended by now
        if torch.compiler.is_compiling():  # the Q tiles come from the eager plan (plan() prepares them)
            launch = plan.launches.get(("cuda", "prefill", q_rows.shape[1]))
            tiles = (launch.q_tile_to_batch, launch.q_tile_to_index) if launch is not None else \
                plan.q_tiles(attn_ops.q_tile_rows(q.device))
            k_scale, v_scale = scales or (None, None)
            out = attn_ops.attn_paged_prefill(q_rows, k_pages, v_pages, plan.qo_indptr, plan.kv_indptr,
                                              plan.kv_indices, plan.kv_lens, *tiles, bool(is_causal),
                                              k_scale=k_scale, v_scale=v_scale, **variant_kwargs(variant))
        elif gather_pays(kv_cache, plan, variant.window_left):  # FP8 or scattered pages, a long step
            gathered = GatheredPrefill.of(kv_cache, plan)
            out = gathered.launch(q_rows, *gathered.pages(kv_cache, layer_id, scales), bool(is_causal),
                                  variant=variant)
        else:
            out = self._launch(kv_cache, plan, q_rows.shape[1], False)(q_rows, k_pages, v_pages, bool(is_causal),
                                                                       variant=variant, kv_scales=scales)
        return out.reshape(q.shape)

    @staticmethod
    def _launch(kv_cache: PagedKVCache, plan: BatchPlan, q_heads: int, decode: bool):
        """The batch's launch plan: built by ``kv_cache.plan`` (through the preparer registered
        here on first use), else now, once, by the first layer that needs it."""
        key = ("cuda", "decode" if decode else "prefill", q_heads)
        launch = plan.launches.get(key)
        if launch is None:
            launch = plan.launches[key] = _plan_launch(kv_cache, plan, q_heads, decode)
            kv_cache.add_preparer(key, lambda cache, p: _plan_launch(cache, p, q_heads, decode)
                                  if p.is_decode == decode else None)
        return launch


def _unsupported_pages(op: str, call: AttentionCall) -> str | None:
    """Why the op's kernels cannot read the call's FP8 pages (the manifest's ``kv_dtypes``), or None."""
    if call.kv_dtype is None or call.kv_dtype == call.dtype:
        return None
    kv = str(call.kv_dtype).removeprefix("torch.")
    spec = current_runtime().registry.op_status(op, probe_device(call.device)).spec
    if kv in spec.kv_dtypes:
        return None
    return f"{op} reads {str(call.dtype).removeprefix('torch.')} pages in this build, not {kv}"


def _fp8_scales(kv_cache: PagedKVCache, layer_id: int, k=None, v=None) -> tuple | None:
    """An FP8 cache's scales of the layer for a launch (calibrated on ``k`` / ``v`` where the
    launch appends them and the layer has none yet); None for a 16-bit cache."""
    if kv_cache.kv_dtype == kv_cache.dtype:
        return None
    if k is not None:
        return kv_cache.scales_for_append(layer_id, k, v)
    return kv_cache.kv_scales(layer_id)


def _beyond_scale(call: AttentionCall) -> bool:
    """Whether the call has a variant feature besides a custom scale."""
    return any(f != "scale" for f in call.features)


# Per cache, per layer: the binding arguments of the layer's pages (fixed for the cache's
# life), so a layer's call converts only its own q, k, v and out.
_LAYER_ARGS: weakref.WeakKeyDictionary[PagedKVCache, dict[int, tuple]] = weakref.WeakKeyDictionary()


def _unmeasured_group(prefer_entry, sm: int, call: AttentionCall) -> prefer.Verdict | None:
    """Why the dense-prefill table does not speak for the call's GQA group, or None. The table
    holds the heads it was measured at (format 1: 32 / 8); a group that is a multiple of that
    one runs the same blocks, repeated per head group. Multi-head attention (one query head per
    K/V head) runs another kernel, and a group the blocks' head slots do not divide leaves
    slots empty: neither was measured."""
    table = prefer.raw_table(prefer_entry, sm)  # verdict() parsed it: a dict
    q_heads, kv_heads = table.get("q_heads", 32), table.get("kv_heads", 8)
    measured = q_heads // kv_heads if isinstance(q_heads, int) and isinstance(kv_heads, int) and kv_heads else 0
    if measured and call.group % measured == 0:
        return None
    return prefer.Verdict(False, f"the measured table for sm_{sm} was measured at heads {q_heads}/{kv_heads} "
                                 f"(GQA group {measured}); heads {call.q_heads}/{call.kv_heads} run other blocks, "
                                 f"not measured: {table.get('peer', 'the peer')} is used")


def _layer_args(kv_cache: PagedKVCache, layer_id: int) -> tuple:
    layers = _LAYER_ARGS.get(kv_cache)
    if layers is None:
        layers = _LAYER_ARGS.setdefault(kv_cache, {})
    found = layers.get(layer_id)
    if found is None:
        found = layers[layer_id] = (tensor_arg(kv_cache.k_cache(layer_id)), tensor_arg(kv_cache.v_cache(layer_id)))
    return found


def _plan_launch(kv_cache: PagedKVCache, plan: BatchPlan, q_heads: int, decode: bool):
    if decode:
        # A decode plan's new tokens are each request's last position by construction, so
        # the kernel can append them through the page table (no write_index to derive).
        return plan_paged_decode(plan.kv_indptr, plan.kv_indices, plan.kv_lens, q_heads=q_heads,
                                 kv_heads=kv_cache.kv_heads, head_dim=kv_cache.head_dim, max_kv_len=plan.max_kv_len,
                                 page_size=kv_cache.page_size, num_pages=kv_cache.num_pages,
                                 append_last=plan.is_decode, slots=lambda: plan.write_index,
                                 kv_bytes=kv_cache.k_cache(0).element_size(),
                                 **({} if plan.static is None else {"workspaces": plan.static.split_workspaces}))
    tiles = plan.q_tiles(attn_ops.q_tile_rows(kv_cache.device))
    return plan_paged_prefill(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, *tiles,
                              total_q=plan.total_q, page_size=kv_cache.page_size, num_pages=kv_cache.num_pages)
