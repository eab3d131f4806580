"""Quantizing through a role's scaling state, and the FP8 copy of a weight kept between
calls while the weight's contents and scale are unchanged."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..backend.fp8_torch import capturing
from .recipes import DelayedScaling, Recipe
from .scaling import TensorScaling

if TYPE_CHECKING:
    from .state import Fp8LinearState


@dataclass(eq=False)
class _WeightCache:
    """The FP8 copy of a weight, valid while the weight's contents and scale are."""

    key: tuple  # data pointer, version counter, dtype, shape, strides, device
    storage: StorageWeakRef  # the storage the key's pointer is into (alive: not reused)
    token: int  # names this content in the scaling bookkeeping
    epoch: int  # the weight role's epoch it was quantized at
    q: torch.Tensor
    q_t: torch.Tensor | None  # the [K, N] copy, made on first need
    amax: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    # its scale is a copy of its own, not a view of the live state the updates rewrite:
    # the copy a CUDA graph may read on every replay (``cache_weights=True``)
    frozen: bool = False


_tokens = itertools.count(1)


def _weight_key(weight: torch.Tensor) -> tuple:
    # in-place updates (optimizer steps, copy_, load_state_dict) bump the version counter;
    # a new tensor behind the parameter (``.data =``, ``.to()``) moves the pointer
    return (weight.data_ptr(), weight._version, weight.dtype, weight.shape, weight.stride(),
            weight.device)


def _quantize(x: torch.Tensor, role: TensorScaling, recipe: Recipe, run, out_layout: int = 0,
              token: int | None = None, keep_amax: bool = False, reuse: str | None = None,
              reuse_t: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, q_t, scale, amax)`` by ``run`` (a ``backend.fp8_runners.quantizer`` function); the amax
    is recorded in ``role``: written straight into its slot when the step has none yet,
    unless ``keep_amax`` (the caller keeps it beyond the step, so it gets a tensor of its
    own, recorded by reference). ``reuse`` / ``reuse_t``: ``q`` / ``q_t`` are read only
    until the next such call (as ``backend.fp8_runners.quantizer`` says)."""
    if isinstance(recipe, DelayedScaling):  # role.scale_for without the call
        scale, multiplier = role.scale, role.scale_inv
    else:
        scale, multiplier = role.scale_for(x, recipe)
    slot = None if keep_amax or role._recorded else role._slot  # role.amax_slot(), inline
    q, q_t, amax = run(x, multiplier, out_layout, slot, role.launch_args, reuse, reuse_t)
    if slot is None:
        role.record(amax, token, by_ref=keep_amax)
    else:  # role.recorded(token), inline
        role._recorded = True
        if token is not None:
            role._tokens.add(token)
    return q, q_t, scale, amax


def _quantize_weight(weight: torch.Tensor, state: Fp8LinearState, run, want_t: bool,
                     cache: bool, in_graphs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(q, q_t or None, scale)`` of the weight, from the cache while it is valid.

    Valid while the weight holds the same contents (``_weight_key``, its storage alive)
    and, under delayed scaling, its scale provably kept its value (``epoch``); a dynamic
    scale is a function of the contents alone. A hit costs no kernel but the step's amax
    record (once per step). In-place writes that bypass the version counter
    (``weight.data.copy_(...)``) are invisible: ``Fp8LinearState.clear_weight_cache``.

    Inside a CUDA graph capture the weight is quantized in the graph (every replay sees
    the weight's changes), unless ``in_graphs`` (``cache_weights=True``: the caller holds
    the weights constant across replays) and a copy made outside the capture with a scale
    of its own (``frozen``) is valid: the graph then reads that copy, kept alive for it.
    Once a graph captured an update of the state (``graphed``), replays move its scale
    behind the host's back: only such frozen copies are used from then on.
    """
    role, recipe = state.weight, state.recipe
    delayed = isinstance(recipe, DelayedScaling)
    entry = state._weight_cache
    layout = 2 if want_t else 0
    graphing = (cache or entry is not None) and capturing(weight.device)
    if graphing:
        cache = False  # nothing made in a capture is kept
        if not (in_graphs and entry is not None and entry.frozen and (entry.q_t is not None or not want_t)):
            entry = None  # a quantize in the graph
    elif state.forward_roles.graphed and not in_graphs:
        state._weight_cache = entry = None
        cache = False
    if entry is None and not cache:  # nothing cached, nothing to keep: quantize
        return _quantize(weight, role, recipe, run, layout, next(_tokens) if delayed else None)[:3]
    key = _weight_key(weight)
    same = entry is not None and entry.key == key and not entry.storage.expired()
    if same and (entry.epoch == role.epoch or (entry.frozen and state.forward_roles.graphed)):
        if graphing and not any(kept is entry for kept in state._in_graphs):
            state._in_graphs.append(entry)  # the graph reads it on every replay
        if want_t and entry.q_t is None:
            entry.q_t = entry.q.t().contiguous()  # the bytes the two-layout quantize writes
        if delayed:
            if entry.token not in role._tokens:
                role.record(entry.amax, entry.token, by_ref=True)
        else:
            role.scale, role.scale_inv = entry.scale, entry.scale_inv
        return entry.q, entry.q_t, entry.scale
    token = entry.token if same else next(_tokens)
    q, q_t, scale, amax = _quantize(weight, role, recipe, run, layout, token if delayed else None,
                                    keep_amax=cache)
    state._weight_cache = None
    if cache:
        frozen = in_graphs or not delayed  # a delayed scale is a view of the live state: copied
        state._weight_cache = _WeightCache(key, StorageWeakRef(weight.untyped_storage()), token,
                                           role.epoch, q, q_t if want_t else None, amax,
                                           scale.clone() if frozen and delayed else scale,
                                           role.scale_inv, frozen)
    return q, (q_t if want_t else None), scale
