"""Per-role scaling state (``TensorScaling``), the role groups updated together at the end
of a step, and that update, batched across groups (``_end_steps``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..backend import fp8_runners
from ..backend.fp8_torch import FP8_MAX, capturing
from ..runtime import current_runtime
from .recipes import DelayedScaling, Recipe, DynamicScaling


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
        self.launch_args: dict = {}  # what the quantize launch derives from this role's tensors

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
        self.launch_args: dict = {}  # what the update's launch derives from these tensors
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
        """Roll the histories and compute the next scales (``backend.fp8_runners.scale_update``)."""
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
    launch_args: dict = field(default_factory=dict)  # as ``_RoleGroup.launch_args``

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
    if len(pairs) == 1:  # one linear, or one backward pass through one: no grouping
        group, recipe = pairs[0]
        if isinstance(recipe, DelayedScaling):
            _update_group(group, recipe, current_runtime())
        return
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
    for (recipe, _, _, _), groups in buckets.items():
        _update(groups[0], recipe, groups, runtime)


def _update_group(group: _RoleGroup, recipe: DelayedScaling, runtime) -> None:
    """``_update`` of a single group (one linear's step): its own tensors, no batch."""
    graphing = capturing(group.device)
    hist, scale, scale_inv, pending = group.tensors
    _fold_refs([group], pending)
    fp8_runners.scale_update(hist, pending, scale, scale_inv, _factor(group.fmt, recipe.margin),
                             recipe.amax_compute_algo == "most_recent", runtime, group.launch_args)
    if graphing:
        group.graphed = True
    for role in group.roles:
        role._close_step()


def _update(first: _RoleGroup, recipe: DelayedScaling, groups: list[_RoleGroup], runtime) -> None:
    """The in-place update of ``groups`` (one bucket of ``_end_steps``; ``first`` is
    ``groups[0]``)."""
    if len(groups) == 1:
        _update_group(first, recipe, runtime)
        return
    graphing = capturing(first.device)
    batch = first._batch
    if (batch is not None and len(batch.groups) == len(groups)
            and all(a is b for a, b in zip(batch.groups, groups))):
        parts = [(groups, batch, batch)]
    elif graphing:
        parts = [([group], group, None) for group in groups]
    else:
        batch = _Batch.stack(groups)
        parts = [(groups, batch, batch)]
    factor, most_recent = _factor(first.fmt, recipe.margin), recipe.amax_compute_algo == "most_recent"
    for members, owner, fold_batch in parts:  # owner: the group or batch whose tensors these are
        hist, scale, scale_inv, pending = owner.tensors
        _fold_refs(members, pending, fold_batch)
        fp8_runners.scale_update(hist, pending, scale, scale_inv, factor, most_recent, runtime,
                                 owner.launch_args)
    for group in groups:
        if graphing:
            group.graphed = True
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
    if count == 1:  # one kernel per role holding a kept amax
        for role in groups[0].roles:
            ref = role._ref
            if ref is not None:
                if role._recorded:
                    torch.maximum(role._slot, ref, out=role._slot)
                else:
                    role._slot.copy_(ref)
        return
    for i, role in enumerate(groups[0].roles):
        refs = [group.roles[i]._ref for group in groups]
        ids = tuple(map(id, refs))
        if ids == (_NONE_ID,) * count:
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
