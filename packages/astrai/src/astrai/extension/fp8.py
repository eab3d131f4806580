"""FP8 strategy layer: ``fp8_autocast``, the scaling recipes and the FP8 linear.

Inside ``fp8_autocast(recipe=...)`` every ``torch.nn.functional.linear`` call (so every
``nn.Linear``) runs its three GEMMs in FP8::

    import torch
    from astrai.extension.fp8 import fp8_autocast, DelayedScaling, Format, fp8_state

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = DelayedScaling(amax_history_len=16, margin=0, fp8_format=Format.HYBRID)
    for step in range(3):
        x, target = torch.randn(32, 64), torch.randn(32, 8)
        with fp8_autocast(recipe=recipe):
            loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()          # dgrad and wgrad in FP8 (E5M2 gradients under HYBRID)
        opt.step()
        opt.zero_grad()
    print(fp8_state(model[0]).input.scale)   # per-weight scaling state, inspectable

Scale convention: a state's ``scale`` is the *dequantization* scale (``x ~ scale * q``).
Quantization passes ``scale.reciprocal()`` (the multiplier) to ``backend.fp8.quantize``;
GEMMs get the product of the two operands' scales. Design notes: docs/fp8.md.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from .backend import fp8 as fp8_backend
from .backend.fp8_torch import FP8_MAX, QUANTIZE_INPUT_DTYPES, capturing
from .device import DeviceInfo, probe_device
from .runtime import Runtime, current_runtime

__all__ = ["Format", "DelayedScaling", "DynamicScaling", "fp8_autocast", "fp8_state",
           "Fp8LinearState", "TensorScaling", "is_fp8_autocast_enabled"]


class Format(enum.Enum):
    """Which FP8 element format each tensor role uses."""

    E4M3 = "e4m3"  # everything in E4M3 (max 448, 3 mantissa bits)
    HYBRID = "hybrid"  # inputs and weights in E4M3, gradients in E5M2 (max 57344, 2 bits)

    @property
    def forward(self) -> str:
        return "e4m3"

    @property
    def backward(self) -> str:
        return "e5m2" if self is Format.HYBRID else "e4m3"


def _check_common(margin: object, fp8_format: object) -> None:
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"margin must be a non-negative int, got {margin!r}")
    if not isinstance(fp8_format, Format):
        raise TypeError(f"fp8_format must be a Format (E4M3 or HYBRID), got {fp8_format!r}")


@dataclass(frozen=True)
class DelayedScaling:
    """Scales from the amax history of earlier steps (TransformerEngine's delayed scaling).

    Each step quantizes with the scale computed at the end of the previous step and
    records its own amax; at the end of the step (exit of the outermost ``fp8_autocast``
    for inputs and weights, end of the backward pass for gradients) the history rolls
    and ``scale = amax * 2**margin / fp8_max`` with ``amax`` the maximum over the history
    (``"max"``) or the step just finished (``"most_recent"``). A zero or non-finite amax
    keeps the previous scale. Scales start at 1.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        _check_common(self.margin, self.fp8_format)
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")


@dataclass(frozen=True)
class DynamicScaling:
    """Current (just-in-time) scaling: every quantization measures its tensor's amax first
    and uses ``scale = amax * 2**margin / fp8_max`` for that tensor. One extra read of the
    tensor per quantization; no history."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_common(self.margin, self.fp8_format)


Recipe = DelayedScaling | DynamicScaling


# -- state ------------------------------------------------------------------------------


class TensorScaling:
    """Scaling state of one tensor role of one weight (``input``, ``weight``, ``grad_output``).

    ``amax_history`` (``[L]`` float32, a fresh tensor per read): ``[0]`` is the current
    step's amax (maximum over the calls of the step so far), ``[1:]`` earlier steps,
    newest first. ``scale`` is the dequantization scale the next quantization uses
    (delayed) or the last one used (dynamic); ``scale_inv`` its reciprocal, the multiplier
    handed to the quantizer. The step's amax lives in a slot of the group's ``pending``
    buffer: the step's first quantization writes its amax straight into it (``amax_slot``),
    later ones fold theirs in (``record``). The end-of-step update rolls the slots into
    the histories; the roles updated together (``input`` and ``weight``) are rows of one
    stacked tensor (``_RoleGroup``). Under delayed scaling ``scale`` and ``scale_inv`` are
    views of that state, which the update rewrites in place (so a CUDA graph that captured
    a step advances it on every replay): clone them to keep a value. A training forward
    keeps a copy of the scales it used for its backward pass.
    """

    def __init__(self, fmt: str, group: _RoleGroup, row: int, window: deque[frozenset[int]] | None = None):
        self.fmt = fmt
        self.scale = self.scale_inv = self._slot = group._zero  # pointed at the group's rows by it
        self.updates = 0  # end-of-step updates applied so far
        # Host-side bookkeeping of the weight cache (``_quantize_weight``): ``epoch``
        # changes whenever the delayed scale may have changed; ``_tokens`` are the weight
        # contents recorded in the step in progress, ``_window`` those of the steps the
        # scale is computed from (None: a role whose contents are not tracked).
        self.epoch = 0
        self._group, self._row = group, row
        self._recorded = False  # the slot holds an amax of this step
        self._ref: torch.Tensor | None = None  # an amax of this step kept by reference
        self._tokens: set[int] = set()
        self._window = window
        # how many of the window's slots hold each content: the window's union is the
        # keys, kept up to date per step instead of rebuilt from all L slots
        self._in_window: dict[int, int] = {}
        self._window_closed = False  # a first update always counts as a change

    def __repr__(self) -> str:
        return (f"TensorScaling(fmt={self.fmt!r}, amax_history={self.amax_history!r}, "
                f"scale={self.scale!r}, scale_inv={self.scale_inv!r}, updates={self.updates})")

    @property
    def amax_history(self) -> torch.Tensor:
        done = self._group.tensors[0][self._row]  # completed steps, newest first
        current = self._slot if self._recorded else self._group._zero  # an abandoned slot is not read
        current = current if self._ref is None else torch.maximum(current, self._ref)
        return torch.cat((current.reshape(1), done[:-1]))

    def scale_for(self, x: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, multiplier)`` to quantize ``x`` with."""
        if isinstance(recipe, DynamicScaling):
            # max|x| is one of the elements: exact in float32 whatever x's dtype
            amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
            usable = amax.nan_to_num(0.0, 0.0)  # zero where amax is zero, inf or NaN
            scale = torch.where(usable > 0, usable * _factor(self.fmt, recipe.margin), 1.0)
            self.scale, self.scale_inv = scale, scale.reciprocal()
        return self.scale, self.scale_inv

    def amax_slot(self) -> torch.Tensor | None:
        """Where the step's first quantization may write its amax directly (then
        ``recorded``); None once the step has an amax."""
        return None if self._recorded else self._slot

    def recorded(self, token: int | None = None) -> None:
        """The slot (``amax_slot``) now holds the step's amax; ``token`` as in ``record``."""
        self._recorded = True
        if token is not None:
            self._tokens.add(token)

    def record(self, amax: torch.Tensor, token: int | None = None, by_ref: bool = False) -> None:
        """Fold ``amax`` (a 0-d float32 tensor, never written to here) into the step's
        amax; ``token`` names the weight content it is of. ``by_ref`` keeps the tensor
        itself (no kernel) for the update to fold in with the others of its batch: for
        amaxes that outlive the step (the cached weight's). Inside a CUDA graph capture the
        folds are captured kernels like any other, reading tensors that outlive the graph's
        replays (a kept amax there is a graph-pinned weight copy's)."""
        if by_ref:
            self._ref = amax if self._ref is None else torch.maximum(self._ref, amax)
        elif self._recorded:
            torch.maximum(self._slot, amax, out=self._slot)
        else:
            self._slot.copy_(amax)
            self._recorded = True
        if token is not None:
            self._tokens.add(token)

    def _forget(self) -> None:
        """Back to no step recorded (``_RoleGroup.reset``); the epoch moves on, so no weight
        copy made before is taken for valid."""
        self.updates = 0
        self.epoch += 1
        self._recorded, self._ref = False, None
        self._tokens = set()
        if self._window is not None:
            self._window.clear()
        self._in_window = {}
        self._window_closed = False

    def _abandon_step(self) -> None:
        """Forget what the step in progress recorded (its backward pass raised): the slot's
        amax is never read again, as the step's first quantization overwrites it."""
        self._recorded, self._ref = False, None
        self._tokens = set()

    def _close_step(self) -> None:
        """After an update: bump ``epoch`` unless the scale provably kept its value.

        The update computes the scale from the amaxes in the window (the history for
        ``"max"``, the newest slot for ``"most_recent"``; zero slots never win the max). For
        a tracked role each slot's amax is a function of the weight contents recorded in
        it, so when the set of contents in the window is the one of the previous update,
        the new scale equals the previous one: the same amax gives the same scale, and an
        unusable amax keeps the previous scale either way.
        """
        self.updates += 1
        self._recorded, self._ref = False, None
        if self._window is None:
            self.epoch += 1
            return
        window, counts = self._window, self._in_window
        left, came = set(), set()  # contents leaving / entering the union
        if len(window) == window.maxlen:
            for token in window[-1]:  # the oldest slot drops out as the new one arrives
                if counts[token] == 1:
                    del counts[token]
                    left.add(token)
                else:
                    counts[token] -= 1
        new = frozenset(self._tokens)
        window.appendleft(new)
        for token in new:
            if token in counts:
                counts[token] += 1
            else:
                counts[token] = 1
                came.add(token)
        self._tokens = set()
        if left != came or not self._window_closed:
            self.epoch += 1
        self._window_closed = True


def _factor(fmt: str, margin: int) -> float:
    return 2.0 ** margin / FP8_MAX[fmt]


# Rows per role in a group's tensors: a role's scale is then 16-byte aligned, as cuBLASLt
# takes scale pointers (the rows between roles stay zero and never change a value).
_ROW = 4


class _RoleGroup:
    """Roles whose delayed-scaling update happens at the same moment, stacked in
    ``tensors``: an ``[R, L]`` history of completed steps, ``[R]`` scales and their
    reciprocals, and an ``[R]`` buffer of the step's amaxes (pending), so an update is one kernel
    (or a handful of tensor ops) for all of them; role ``i`` is row ``_ROW * i``. The update
    writes these in place and the roles hold views of them, so the addresses a captured
    CUDA graph reads stay the state's. After a batched update (``_end_steps``) they are
    rows of the batch's tensors."""

    def __init__(self, fmt: str, roles: int, recipe: Recipe, device: torch.device,
                 tracked: tuple[bool, ...]):
        length = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        window = length if isinstance(recipe, DelayedScaling) and recipe.amax_compute_algo == "max" else 1
        self.fmt = fmt
        self.device = device
        self.rows = _ROW * roles
        self.delayed = isinstance(recipe, DelayedScaling)
        # True once a CUDA graph captured a step of these roles: replays then move the scales
        # without the host knowing, so only weight copies with scales of their own are reused
        self.graphed = False
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._batch: _Batch | None = None  # set while the tensors are rows of a batch's
        self.roles = [TensorScaling(fmt, self, _ROW * i, deque(maxlen=window) if track else None)
                      for i, track in enumerate(tracked)]
        self._use(torch.zeros(self.rows, length, dtype=torch.float32, device=device),
                  torch.ones(self.rows, dtype=torch.float32, device=device),
                  torch.ones(self.rows, dtype=torch.float32, device=device),
                  torch.zeros(self.rows, dtype=torch.float32, device=device))

    def _use(self, hist: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
             pending: torch.Tensor) -> None:
        """Hold these tensors (``[R, L]``, ``[R]`` x 3: the group's own or its rows of a
        batch's) and point the roles at their rows. Under dynamic scaling a role's
        ``scale`` is the last one used, made per call, and stays (1 until the first)."""
        self.tensors = (hist, scale, scale_inv, pending)
        views = zip(*(_role_views(t, len(self.roles)) for t in (scale, scale_inv, pending)))
        for role, (role_scale, role_inv, slot) in zip(self.roles, views):
            if self.delayed or role.scale is self._zero:
                role.scale, role.scale_inv = role_scale, role_inv
            role._slot = slot

    def reset(self) -> None:
        hist, scale, scale_inv, pending = self.tensors
        with torch.no_grad():
            hist.zero_()
            pending.zero_()
            scale.fill_(1.0)
            scale_inv.fill_(1.0)
        for role, (role_scale, role_inv) in zip(self.roles, zip(*(_role_views(t, len(self.roles))
                                                                  for t in (scale, scale_inv)))):
            role.scale, role.scale_inv = role_scale, role_inv
            role._forget()

    def to(self, device: torch.device) -> None:
        last_used = [(role.scale.to(device), role.scale_inv.to(device)) for role in self.roles]
        self._zero, self._batch, self.device = self._zero.to(device), None, device
        self._use(*(t.to(device) for t in self.tensors))
        for role, (scale, scale_inv) in zip(self.roles, last_used):
            if not self.delayed:
                role.scale, role.scale_inv = scale, scale_inv
            if role._ref is not None:
                role._ref = role._ref.to(device)

    def end_step(self, recipe: DelayedScaling) -> None:
        """Roll the histories and compute the next scales (``backend.fp8.scale_update``)."""
        _end_steps([(self, recipe)])


@dataclass(eq=False)
class _Batch:
    """Groups updated together last time: their histories, scales and step amaxes are
    rows of these (``[S, R, L]``, ``[S, R]`` x 3)."""

    groups: tuple[_RoleGroup, ...]
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    # per role index: the ids of the amaxes kept by reference last folded in, and what
    # folding them took (the pending column, the amaxes stacked), reused while the same
    # tensors come back (the cached weights', step after step)
    folds: dict[int, tuple[tuple[int, ...], list, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def stack(cls, groups: list[_RoleGroup]) -> _Batch:
        """Copy the groups' state into stacked tensors and make the groups rows of them."""
        batch = cls(tuple(groups), tuple(torch.stack(parts) for parts in zip(*(g.tensors for g in groups))))
        for group, *rows in zip(groups, *(t.unbind(0) for t in batch.tensors)):
            group._batch = batch
            group._use(*rows)
        return batch


def _end_steps(pairs: list[tuple[_RoleGroup, Recipe]]) -> None:
    """End the step of many role groups: one stacked update per (recipe, format, device,
    shape) instead of one per group, so a region's bookkeeping costs one kernel (the
    plugin's) or about ten ops whatever the number of linears in it. Delayed scaling
    only; values as group by group. The update is in place: groups first updated together
    become rows of one batch (a stacking copy, once), and later updates of the same groups
    write those rows. A step ending while a CUDA graph is captured is the same update,
    captured, so each replay advances the state; it never regroups there (a captured copy
    would leave the state behind, as the roles' views would point at tensors written only
    on replay): groups not already batched together are then updated one by one."""
    buckets: dict[tuple, list[_RoleGroup]] = {}
    for group, recipe in pairs:
        if isinstance(recipe, DelayedScaling):
            key = (recipe, group.fmt, group.device, len(group.roles))
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = [group]
            else:
                bucket.append(group)
    if not buckets:
        return
    runtime = current_runtime()
    for (recipe, fmt, device, _), groups in buckets.items():
        graphing = capturing(device)
        batch = groups[0]._batch
        if len(groups) == 1:
            parts = [(groups, groups[0].tensors, None)]
        elif (batch is not None and len(batch.groups) == len(groups)
              and all(a is b for a, b in zip(batch.groups, groups))):
            parts = [(groups, batch.tensors, batch)]
        elif graphing:
            parts = [([group], group.tensors, None) for group in groups]
        else:
            batch = _Batch.stack(groups)
            parts = [(groups, batch.tensors, batch)]
        factor, most_recent = _factor(fmt, recipe.margin), recipe.amax_compute_algo == "most_recent"
        for members, (hist, scale, scale_inv, pending), fold_batch in parts:
            _fold_refs(members, pending, fold_batch)
            fp8_backend.scale_update(hist, pending, scale, scale_inv, factor, most_recent, runtime)
        for group in groups:
            group.graphed = group.graphed or graphing
            for role in group.roles:
                role._close_step()


def _role_views(values: torch.Tensor, roles: int) -> tuple[torch.Tensor, ...]:
    """A 0-d view per role of a group's ``[R]`` ``values`` (the roles are every ``_ROW``-th
    element): one strided view and one ``unbind``."""
    return values.as_strided((roles,), (_ROW,), values.storage_offset()).unbind(0)


def _fold_refs(groups: list[_RoleGroup], pending: torch.Tensor, batch: _Batch | None = None) -> None:
    """Fold the amaxes kept by reference (``record(by_ref=True)``) into ``pending``, the
    groups' stacked step amaxes: one kernel for a single group, else two per role that has
    any (the cached weights' in inference), whatever the number of groups; one when
    ``batch`` (``pending`` is its own) folded the same tensors last step."""
    count = len(groups)
    for i, role in enumerate(groups[0].roles):
        refs = [group.roles[i]._ref for group in groups]
        ids = tuple(map(id, refs))
        if ids == (_NONE_ID,) * count:
            continue
        if count == 1:
            if role._recorded:
                torch.maximum(role._slot, refs[0], out=role._slot)
            else:
                role._slot.copy_(refs[0])
            continue
        fold = None if batch is None else batch.folds.get(i)
        if fold is not None and fold[0] == ids:  # the same tensors (kept alive by fold[1])
            column, stacked = fold[2], fold[3]
        else:
            zero = groups[0]._zero
            column = pending.view(count, groups[0].rows)[:, role._row]
            stacked = torch.stack([zero if ref is None else ref for ref in refs])
            if batch is not None:
                batch.folds[i] = (ids, refs, column, stacked)
        torch.maximum(column, stacked, out=column)


_NONE_ID = id(None)


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


@dataclass(eq=False)
class Fp8LinearState:
    """FP8 state of one linear weight: a ``TensorScaling`` per tensor role, plus the FP8
    copy of the weight kept between calls while the weight is unchanged."""

    recipe: Recipe
    forward_roles: _RoleGroup = field(repr=False)
    backward_roles: _RoleGroup = field(repr=False)
    _backward_pending: bool = field(default=False, repr=False)
    _weight_cache: _WeightCache | None = field(default=None, repr=False)
    # the cached copies CUDA graphs captured (``cache_weights=True``): they read them on
    # every replay, so they stay alive with the state
    _in_graphs: list[_WeightCache] = field(default_factory=list, repr=False)

    @property
    def input(self) -> TensorScaling:
        return self.forward_roles.roles[0]

    @property
    def weight(self) -> TensorScaling:
        return self.forward_roles.roles[1]

    @property
    def grad_output(self) -> TensorScaling:
        return self.backward_roles.roles[0]

    def __repr__(self) -> str:
        return (f"Fp8LinearState(recipe={self.recipe!r}, input={self.input!r}, "
                f"weight={self.weight!r}, grad_output={self.grad_output!r})")

    @classmethod
    def create(cls, recipe: Recipe, device: torch.device) -> Fp8LinearState:
        fmt = recipe.fp8_format
        return cls(recipe, _RoleGroup(fmt.forward, 2, recipe, device, tracked=(False, True)),
                   _RoleGroup(fmt.backward, 1, recipe, device, tracked=(False,)))

    def clear_weight_cache(self) -> None:
        """Drop the cached FP8 weight (its memory, and any doubt: the next call quantizes)."""
        self._weight_cache = None

    def reset(self) -> None:
        """Forget the scaling history, as if no step had run: amax histories and the
        step's amaxes zeroed, scales back to 1, written in place (a CUDA graph that
        captured steps of this state keeps reading the same tensors); the cached FP8
        weight dropped. For after steps on unrepresentative data: the warm-up of
        ``torch.cuda.make_graphed_callables`` feeds uninitialized output gradients to its
        backward passes, which would otherwise sit in the gradient history."""
        if capturing(self.forward_roles.device):
            raise RuntimeError("Fp8LinearState.reset() inside a CUDA graph capture would run only on "
                               "replay; call it before or after the capture")
        self.forward_roles.reset()
        self.backward_roles.reset()
        self._weight_cache = None

    def to(self, device: torch.device) -> None:
        self.forward_roles.to(device)
        self.backward_roles.to(device)
        self._weight_cache = None

    def end_forward_step(self) -> None:
        _end_steps([(self.forward_roles, self.recipe)])

    def end_backward_step(self) -> None:
        self._backward_pending = False
        _end_steps([(self.backward_roles, self.recipe)])


_STATE_ATTR = "_astrai_fp8_state"


def fp8_state(obj: torch.nn.Module | torch.Tensor) -> Fp8LinearState | None:
    """The FP8 state of a linear module (its ``weight``) or of a weight tensor; None if it
    has not run under ``fp8_autocast`` yet. The state lives on the weight tensor itself."""
    weight = getattr(obj, "weight", None) if isinstance(obj, torch.nn.Module) else obj
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"expected a module with a weight tensor or a tensor, got {type(obj).__name__}")
    return getattr(weight, _STATE_ATTR, None)


def _state_for(weight: torch.Tensor, recipe: Recipe) -> Fp8LinearState:
    state = getattr(weight, _STATE_ATTR, None)
    if state is None or (state.recipe is not recipe and state.recipe != recipe):
        state = Fp8LinearState.create(recipe, weight.device)  # a different recipe starts afresh
        setattr(weight, _STATE_ATTR, state)
    elif state.forward_roles.device != weight.device:  # the module moved since
        state.to(weight.device)
    return state


# -- the FP8 linear ---------------------------------------------------------------------


class _Call(NamedTuple):
    """Where a linear runs: the runtime deciding its backends and its device's facts."""

    runtime: Runtime
    device: DeviceInfo


class _Plan:
    """What a linear's calls of one kind (runtime, device, dtypes, recipe format, shape,
    gradient or not) have in common, decided on the first: the quantize function per
    operand, the GEMM functions and the layout the backward wants. Kept in the runtime's
    resolver (``derived``) beside the functions it holds, so it dies with them: a
    ``Resolver.clear()`` (a plugin found broken) or another runtime decides afresh. The
    backward's GEMM functions are looked up on its first run."""

    __slots__ = ("call", "quantize_x", "quantize_w", "gemm", "k_major", "g_dtype", "quantize_g",
                 "dgrad", "wgrad")

    def __init__(self, call: _Call, x_dtype: torch.dtype, w_dtype: torch.dtype, fmt: str, g_fmt: str,
                 shape: tuple[int, int, int], out_dtype: torch.dtype | None):
        device, runtime = call.device, call.runtime
        self.call = call
        self.quantize_x = fp8_backend.quantizer(device, x_dtype, fmt, runtime)
        self.quantize_w = fp8_backend.quantizer(device, w_dtype, fmt, runtime)
        self.gemm = fp8_backend.gemm_runner(device, fmt, fmt, shape, runtime)
        self.g_dtype = out_dtype  # the gradient's dtype (the output's); None: no backward
        self.k_major = out_dtype is not None and fp8_backend.wants_k_major(device, g_fmt, fmt, runtime=runtime)
        self.quantize_g = self.dgrad = self.wgrad = None


def _plan_for(x2d: torch.Tensor, weight: torch.Tensor, state: Fp8LinearState,
              out_dtype: torch.dtype | None) -> _Plan:
    """The ``_Plan`` of this call; ``out_dtype`` None for a call recording no gradient (its
    plan is shared by every M of a shape class, a training plan's wgrad needs M itself)."""
    m, k = x2d.shape
    n = weight.shape[0]
    fmt, g_fmt = state.forward_roles.fmt, state.backward_roles.fmt
    if torch.compiler.is_compiling():  # decided at trace time, nothing kept
        return _Plan(_Call(current_runtime(), probe_device(x2d.device)), x2d.dtype, weight.dtype, fmt, g_fmt,
                     (m, n, k), out_dtype)
    runtime = current_runtime()
    device = x2d.device
    key = ("fp8_linear", device, x2d.dtype, weight.dtype, fmt, g_fmt, n, k,
           (1 << (m - 1).bit_length()) if out_dtype is None else m, out_dtype)
    derived = runtime.resolver.derived  # emptied with the resolver's decisions
    plan = derived.get(key)
    if plan is None:
        plan = derived[key] = _Plan(_Call(runtime, probe_device(device)), x2d.dtype, weight.dtype, fmt, g_fmt,
                                    (m, n, k), out_dtype)
    return plan


def _quantize(x: torch.Tensor, role: TensorScaling, recipe: Recipe, run, out_layout: int = 0,
              token: int | None = None, keep_amax: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, q_t, scale, amax)`` by ``run`` (a ``backend.fp8.quantizer`` function); the amax
    is recorded in ``role``: written straight into its slot when the step has none yet,
    unless ``keep_amax`` (the caller keeps it beyond the step, so it gets a tensor of its
    own, recorded by reference)."""
    scale, multiplier = role.scale_for(x, recipe)
    slot = None if keep_amax else role.amax_slot()
    q, q_t, amax = run(x, multiplier, out_layout, slot)
    if slot is None:
        role.record(amax, token, by_ref=keep_amax)
    else:
        role.recorded(token)
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


def _forward(x2d, weight, bias, state, plan: _Plan, cache: bool, save_x_t: bool = False,
             save_w_t: bool = False, in_graphs: bool = False):
    """The forward GEMM; also returns the FP8 operands the backward will read (their
    transposes when the backward GEMM wants K-major operands: see ``_Fp8Linear``)."""
    xq, xq_t, sx, _ = _quantize(x2d, state.input, state.recipe, plan.quantize_x, 2 if save_x_t else 0)
    wq, wq_t, sw = _quantize_weight(weight, state, plan.quantize_w, save_w_t, cache, in_graphs)
    y = plan.gemm(xq, wq.t(), sx, sw, bias)
    return y, (xq_t if save_x_t else xq), sx, (wq_t if save_w_t else wq), sw


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ w.T + b`` with forward, dgrad and wgrad GEMMs in FP8.

    Where the backward GEMM wants K-major operands (cuBLASLt, Hopper wgmma), the forward
    quantizes ``x`` and ``W`` into both layouts (one pass in the plugin kernel) and saves
    the transposed copy, so dgrad ``dy @ W`` and wgrad ``dy.T @ x`` read ``[K, N]`` /
    ``[K, M]`` row-major operands without a transpose of their own.
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, state, plan, out_dtype, cache):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        k_major = plan.k_major
        y, x_saved, sx, w_saved, sw = _forward(x2d, weight, bias, state, plan, cache,
                                               save_x_t=k_major and need_dw,
                                               save_w_t=k_major and need_dx, in_graphs=cache)
        if state.forward_roles.delayed and (need_dx or need_dw):
            # the region's update rewrites the live scales in place before the backward runs;
            # the copies sit _ROW apart, 16-byte aligned as cuBLASLt takes scale pointers
            zero = state.forward_roles._zero
            copies = torch.stack((sx, *(zero,) * (_ROW - 1), sw)).unbind(0)
            sx, sw = copies[0], copies[_ROW]
        ctx.save_for_backward(x_saved if need_dw else None, sx, w_saved if need_dx else None, sw)
        ctx.state, ctx.plan = state, plan
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x_saved, sx, w_saved, sw = ctx.saved_tensors
        state, plan = ctx.state, ctx.plan
        k_major = plan.k_major
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if not grad_y.is_contiguous():
            grad_y = grad_y.contiguous()
        dx = dw = db = None
        if need_dx or need_dw:
            layout = (2 if need_dx else 1) if k_major and need_dw else 0
            role = state.grad_output
            gq, gq_t, sg, _ = _quantize(grad_y, role, state.recipe, _grad_quantizer(plan, grad_y.dtype, role.fmt),
                                        layout)
            if not state._backward_pending:  # one history update per backward pass
                _end_with_backward(state)
            m, n = grad_y.shape
            if need_dx:  # [M, N] @ [N, K]
                w_op = w_saved.t() if k_major else w_saved
                dgrad = plan.dgrad
                if dgrad is None:
                    dgrad = plan.dgrad = _backward_gemm(plan, state, (m, w_op.shape[1], n))
                dx = dgrad(gq, w_op, sg, sw, None)
                dx = dx if dx.dtype == x_dtype else dx.to(x_dtype)
            if need_dw:  # [N, M] @ [M, K]
                g_op, x_op = (gq_t, x_saved.t()) if k_major else (gq.t(), x_saved)
                wgrad = plan.wgrad
                if wgrad is None:
                    wgrad = plan.wgrad = _backward_gemm(plan, state, (n, x_op.shape[1], m))
                dw = wgrad(g_op, x_op, sg, sx, None)
                dw = dw if dw.dtype == w_dtype else dw.to(w_dtype)
        if need_db:  # float32 accumulation without a float32 copy of dy
            db = grad_y.sum(0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db, None, None, None, None


def _grad_quantizer(plan: _Plan, dtype: torch.dtype, fmt: str):
    """The plan's quantize function for the gradient (made on the first backward)."""
    if dtype is not plan.g_dtype:  # not the output's dtype: asked for this call
        return fp8_backend.quantizer(plan.call.device, dtype, fmt, plan.call.runtime)
    run = plan.quantize_g
    if run is None:
        run = plan.quantize_g = fp8_backend.quantizer(plan.call.device, dtype, fmt, plan.call.runtime)
    return run


def _backward_gemm(plan: _Plan, state: Fp8LinearState, shape: tuple[int, int, int]):
    """dgrad / wgrad (the gradient's format times the forward's) for ``shape``."""
    call = plan.call
    return fp8_backend.gemm_runner(call.device, state.grad_output.fmt, state.input.fmt, shape, call.runtime)


_pending: dict[int, list[Fp8LinearState]] = {}  # graph task -> states its backward used
_pending_lock = threading.RLock()  # RLock: an abandoned pass is noticed wherever its callback is freed


def _end_with_backward(state: Fp8LinearState) -> None:
    """Have ``state``'s gradient step end when this backward pass ends: one callback per
    pass updates every state it used together (``_end_steps``).

    A pass that raises never runs its callback: the engine frees it unrun, and the states
    the pass used forget the gradient amaxes it recorded (``_abandon_backward_pass``), so
    the next pass neither folds them into its step nor finds the state still pending."""
    state._backward_pending = True
    task = torch._C._current_graph_task_id()
    with _pending_lock:
        states = _pending.get(task)
        if states is None:
            states = _pending[task] = []
            callback = functools.partial(_end_backward_pass, task)
            weakref.finalize(callback, _abandon_backward_pass, task)
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        states.append(state)


def _end_backward_pass(task: int) -> None:
    with _pending_lock:
        states = _pending.pop(task, [])
    for state in states:
        state._backward_pending = False
    _end_steps([(state.backward_roles, state.recipe) for state in states])


def _abandon_backward_pass(task: int) -> None:
    """The callback of ``task`` was freed: after it ran (nothing left to do) or unrun."""
    with _pending_lock:
        states = _pending.pop(task, [])
    for state in states:
        state._backward_pending = False
        for role in state.backward_roles.roles:
            role._abandon_step()


def _fp8_capable(x, weight, bias) -> bool:
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.dtype in QUANTIZE_INPUT_DTYPES and weight.dtype in QUANTIZE_INPUT_DTYPES):
        return False
    if (weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]
            or x.numel() == 0 or weight.numel() == 0 or x.device != weight.device):
        return False
    return bias is None or (isinstance(bias, torch.Tensor) and bias.dtype in QUANTIZE_INPUT_DTYPES
                            and bias.dim() == 1 and bias.shape[0] == weight.shape[0]
                            and bias.device == weight.device)


def _fp8_linear(x, weight, bias, region: _Region) -> torch.Tensor:
    state = _state_for(weight, region.recipe)
    region.touched.setdefault(id(state), state)
    out_dtype = x.dtype
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        out_dtype = torch.get_autocast_dtype(device_type)
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    grad_mode = torch.is_grad_enabled()
    if grad_mode and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        plan = _plan_for(x2d, weight, state, out_dtype)
        y = _Fp8Linear.apply(x2d, weight, bias, state, plan, out_dtype, region.cache_weights is True)
    else:
        plan = _plan_for(x2d, weight, state, None)
        with torch.no_grad() if grad_mode else contextlib.nullcontext():
            y = _forward(x2d, weight, bias, state, plan, region.cache_weights is not False,
                         in_graphs=region.cache_weights is True)[0]
            if y.dtype != out_dtype:
                y = y.to(out_dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


# -- the autocast region ----------------------------------------------------------------


@dataclass
class _Region:
    enabled: bool
    recipe: Recipe
    touched: dict[int, Fp8LinearState]  # shared by a thread's nested regions
    cache_weights: bool | None = None

    def touch(self, state: Fp8LinearState) -> None:
        self.touched.setdefault(id(state), state)


_local = threading.local()


def _stack() -> list[_Region]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class _LinearMode(TorchFunctionMode):
    """Routes ``F.linear`` to the FP8 linear while the innermost region is enabled."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            stack = _stack()
            if stack and stack[-1].enabled:
                x, weight, bias = _linear_args(*args, **kwargs)
                if _fp8_capable(x, weight, bias):
                    return _fp8_linear(x, weight, bias, stack[-1])
        return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):  # noqa: A002 - F.linear's own parameter names
    return input, weight, bias


def is_fp8_autocast_enabled() -> bool:
    """True inside an enabled (innermost) ``fp8_autocast`` region of this thread."""
    stack = _stack()
    return bool(stack) and stack[-1].enabled


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None, *,
                 cache_weights: bool | None = None) -> Iterator[None]:
    """Run ``F.linear`` / ``nn.Linear`` in FP8 inside the block (see the module docstring).

    Regions nest: the innermost decides (``enabled=False`` inside switches FP8 off for
    its block). Delayed-scaling forward states update once, when the outermost region of
    the thread exits; gradient states at the end of each backward pass.
    Linears FP8 can't take (float64, zero-size, mismatched shapes) run unchanged.
    ``cache_weights`` keeps each weight's FP8 copy between calls while the weight and its
    scale are unchanged. The default (None) caches only calls that record no gradient
    (inference), where weights change only through tracked writes; in training an optimizer
    or framework may write through ``param.data``, which the cache cannot see, so there it
    is opt-in (True, e.g. for gradient accumulation). False never caches. Inside a CUDA
    graph capture only True reuses a copy (made before the capture, under True): a
    promise that the weights stay constant across replays, which the graph cannot check;
    otherwise the graph quantizes the weight on every replay.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if cache_weights is not None and not isinstance(cache_weights, bool):
        raise TypeError(f"cache_weights must be a bool or None, got {type(cache_weights).__name__}")
    if recipe is None:
        recipe = DelayedScaling()
    elif not isinstance(recipe, (DelayedScaling, DynamicScaling)):
        raise TypeError(f"recipe must be a DelayedScaling or DynamicScaling, got {type(recipe).__name__}")
    stack = _stack()
    outermost = not stack
    touched = {} if outermost else stack[0].touched
    stack.append(_Region(enabled, recipe, touched, cache_weights))
    mode = _LinearMode() if outermost else None
    try:
        if mode is not None:
            with mode:
                yield
        else:
            yield
    finally:
        stack.pop()
        if outermost:
            _end_steps([(state.forward_roles, state.recipe) for state in touched.values()])
