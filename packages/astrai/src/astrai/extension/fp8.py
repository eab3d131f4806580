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
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from .backend import fp8 as fp8_backend
from .backend.fp8_torch import FP8_MAX, QUANTIZE_INPUT_DTYPES, capturing
from .device import probe_device
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
    handed to the quantizer. A quantization's amax is kept as a tensor (``record``: no
    kernel for the first call of a step) and written into the history by the end-of-step
    update; the completed steps of the roles updated together (``input`` and ``weight``)
    are rows of one stacked tensor (``_RoleGroup``). Updates replace the scale tensors
    rather than writing into them, so a backward pass still reads the scales its forward
    used.
    """

    def __init__(self, fmt: str, group: _RoleGroup, row: int, scale: torch.Tensor,
                 scale_inv: torch.Tensor, window: deque[frozenset[int]] | None = None):
        self.fmt = fmt
        self.scale, self.scale_inv = scale, scale_inv
        self.updates = 0  # end-of-step updates applied so far
        # Host-side bookkeeping of the weight cache (``_quantize_weight``): ``epoch``
        # changes whenever the delayed scale may have changed; ``_tokens`` are the weight
        # contents recorded in the step in progress, ``_window`` those of the steps the
        # scale is computed from (None: a role whose contents are not tracked).
        self.epoch = 0
        self._group, self._row = group, row
        self._pending: torch.Tensor | None = None  # max of the step's amaxes so far
        self._tokens: set[int] = set()
        self._window = window
        self._window_union: frozenset[int] | None = None

    def __repr__(self) -> str:
        return (f"TensorScaling(fmt={self.fmt!r}, amax_history={self.amax_history!r}, "
                f"scale={self.scale!r}, scale_inv={self.scale_inv!r}, updates={self.updates})")

    @property
    def amax_history(self) -> torch.Tensor:
        done = self._group.hist[self._row]  # completed steps, newest first
        current = self._pending if self._pending is not None else done.new_zeros(())
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

    def record(self, amax: torch.Tensor, token: int | None = None) -> None:
        """Fold ``amax`` (a 0-d float32 tensor, never written to here) into the step's
        amax; ``token`` names the weight content it is of. An amax made inside a CUDA
        graph capture exists only on replay: it is not kept (a captured step does not
        advance the scaling state)."""
        if capturing(amax.device):
            return
        pending = self._pending
        self._pending = amax if pending is None else torch.maximum(pending, amax)
        if token is not None:
            self._tokens.add(token)

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
        self._pending = None
        if self._window is None:
            self.epoch += 1
            return
        self._window.appendleft(frozenset(self._tokens))
        self._tokens = set()
        union = frozenset().union(*self._window)
        if union != self._window_union:
            self.epoch += 1
        self._window_union = union


def _factor(fmt: str, margin: int) -> float:
    return 2.0 ** margin / FP8_MAX[fmt]


class _RoleGroup:
    """Roles whose delayed-scaling update happens at the same moment, stacked: one
    ``[R, L]`` tensor of completed steps and one ``[R]`` scale, so an update is a handful
    of tensor ops for all of them. After a batched update (``_end_steps``) these are rows
    of the batch's tensors, read through ``hist`` / ``scale`` only when needed."""

    def __init__(self, fmt: str, rows: int, recipe: Recipe, device: torch.device,
                 tracked: tuple[bool, ...]):
        length = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        window = length if isinstance(recipe, DelayedScaling) and recipe.amax_compute_algo == "max" else 1
        self.fmt = fmt
        self.device = device
        self._own = (torch.zeros(rows, length, dtype=torch.float32, device=device),
                     torch.ones(rows, dtype=torch.float32, device=device))
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._batch: _Batch | None = None  # set while the tensors are rows of a batch's
        self._index = 0
        ones = self._own[1].unbind(0)
        self.roles = [TensorScaling(fmt, self, i, one, one,
                                    deque(maxlen=window) if track else None)
                      for i, (one, track) in enumerate(zip(ones, tracked))]

    @property
    def hist(self) -> torch.Tensor:
        """``[R, L]``: the completed steps' amaxes, newest first."""
        return self._own[0] if self._batch is None else self._batch.hist[self._index]

    @property
    def scale(self) -> torch.Tensor:
        return self._own[1] if self._batch is None else self._batch.scale[self._index]

    def to(self, device: torch.device) -> None:
        self._own = (self.hist.to(device), self.scale.to(device))
        self._zero, self._batch, self.device = self._zero.to(device), None, device
        for role in self.roles:  # the scales last used (dynamic) or published (delayed)
            role.scale, role.scale_inv = role.scale.to(device), role.scale_inv.to(device)
            if role._pending is not None:
                role._pending = role._pending.to(device)

    def end_step(self, recipe: DelayedScaling) -> None:
        """Roll the histories and compute the next scales (see ``_delayed_update``)."""
        _end_steps([(self, recipe)])


def _delayed_update(hist: torch.Tensor, prev: torch.Tensor, amaxes: list[torch.Tensor],
                    recipe: DelayedScaling, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv, history)`` after a step, for completed-step histories stacked
    along the leading dimensions (``[..., L]``) and the step's amaxes (one 0-d tensor per
    row, in order): the history gains the step as its newest slot and drops its oldest;
    ``amax = max(history)`` or the step's own, ``scale = amax * 2**margin / fp8_max``
    unless the amax is zero or not finite (then ``prev`` stays). Every op is elementwise
    or a max, so stacking more rows changes no value. Ten ops, eight kernels."""
    step = torch.stack(amaxes)
    full = torch.cat((step.view(*prev.shape, 1), hist[..., :-1]), -1)
    if recipe.amax_compute_algo == "max":
        amax = full.amax(-1)
    else:
        amax = step if prev.dim() == 1 else step.view(prev.shape)
    usable = amax.nan_to_num(0.0, 0.0)  # zero where amax is zero, inf or NaN (never negative)
    scale = torch.where(usable > 0, usable * _factor(fmt, recipe.margin), prev)
    return scale, scale.reciprocal(), full


@dataclass(eq=False)
class _Batch:
    """Groups updated together last time: their histories and scales are rows of these."""

    groups: tuple[_RoleGroup, ...]
    hist: torch.Tensor  # [S, R, L]
    scale: torch.Tensor  # [S, R]


def _end_steps(pairs: list[tuple[_RoleGroup, Recipe]]) -> None:
    """End the step of many role groups: one stacked update per (recipe, format, device,
    shape) instead of one per group, so a region's bookkeeping costs about ten ops
    whatever the number of linears in it. Delayed scaling only; values as group by group.
    The histories stay rows of one tensor, so the next update of the same groups needs
    no stacking copy; the roles get views of their scales (two ``unbind``), nothing else."""
    buckets: dict[tuple, list[_RoleGroup]] = {}
    for group, recipe in pairs:
        if isinstance(recipe, DelayedScaling):
            key = (recipe, group.fmt, group.device, len(group.roles))
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = [group]
            else:
                bucket.append(group)
    for (recipe, fmt, _, _), groups in buckets.items():
        if len(groups) == 1:
            group = groups[0]
            hist, prev = group.hist, group.scale
        else:
            batch = groups[0]._batch
            if (batch is not None and len(batch.groups) == len(groups)
                    and all(a is b for a, b in zip(batch.groups, groups))):
                hist, prev = batch.hist, batch.scale
            else:
                hist = torch.stack([g.hist for g in groups])
                prev = torch.stack([g.scale for g in groups])
        zero = groups[0]._zero
        amaxes = [zero if r._pending is None else r._pending for g in groups for r in g.roles]
        scale, inv, hist = _delayed_update(hist, prev, amaxes, recipe, fmt)
        flat_scale, flat_inv = (scale, inv) if scale.dim() == 1 else (scale.flatten(), inv.flatten())
        scales, invs = flat_scale.unbind(0), flat_inv.unbind(0)
        if len(groups) == 1:
            groups[0]._own = (hist, scale)
        else:
            batch = _Batch(tuple(groups), hist, scale)
            for index, group in enumerate(groups):
                group._batch, group._index = batch, index
        row = 0
        for group in groups:
            for role in group.roles:
                role.scale, role.scale_inv = scales[row], invs[row]
                role._close_step()
                row += 1


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


def _quantize(x: torch.Tensor, role: TensorScaling, recipe: Recipe, runtime: Runtime,
              out_layout: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, multiplier = role.scale_for(x, recipe)
    q, q_t, amax = fp8_backend.quantize(x, multiplier, role.fmt, out_layout, runtime=runtime)
    role.record(amax)
    return q, q_t, scale


def _quantize_weight(weight: torch.Tensor, state: Fp8LinearState, runtime: Runtime, want_t: bool,
                     cache: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(q, q_t or None, scale)`` of the weight, from the cache while it is valid.

    Valid while the weight holds the same contents (``_weight_key``, its storage alive)
    and, under delayed scaling, its scale provably kept its value (``epoch``); a dynamic
    scale is a function of the contents alone. A hit costs no kernel but the step's amax
    record (once per step). In-place writes that bypass the version counter
    (``weight.data.copy_(...)``) are invisible: ``Fp8LinearState.clear_weight_cache``.
    """
    role, recipe = state.weight, state.recipe
    delayed = isinstance(recipe, DelayedScaling)
    entry = state._weight_cache
    key = _weight_key(weight)
    same = entry is not None and entry.key == key and not entry.storage.expired()
    if same and entry.epoch == role.epoch:
        if want_t and entry.q_t is None:
            entry.q_t = entry.q.t().contiguous()  # the bytes the two-layout quantize writes
        if delayed:
            if entry.token not in role._tokens:
                role.record(entry.amax, entry.token)
        else:
            role.scale, role.scale_inv = entry.scale, entry.scale_inv
        return entry.q, entry.q_t, entry.scale
    scale, multiplier = role.scale_for(weight, recipe)
    q, q_t, amax = fp8_backend.quantize(weight, multiplier, role.fmt, 2 if want_t else 0,
                                        runtime=runtime)
    token = entry.token if same else next(_tokens)
    role.record(amax, token if delayed else None)
    state._weight_cache = None
    if cache and not capturing(weight.device):  # a captured quantize runs only on replay
        state._weight_cache = _WeightCache(key, StorageWeakRef(weight.untyped_storage()), token,
                                           role.epoch, q, q_t if want_t else None, amax, scale,
                                           multiplier)
    return q, (q_t if want_t else None), scale


def _forward(x2d, weight, bias, state, runtime, cache: bool, save_x_t: bool = False,
             save_w_t: bool = False):
    """The forward GEMM; also returns the FP8 operands the backward will read (their
    transposes when the backward GEMM wants K-major operands: see ``_Fp8Linear``)."""
    xq, xq_t, sx = _quantize(x2d, state.input, state.recipe, runtime, 2 if save_x_t else 0)
    wq, wq_t, sw = _quantize_weight(weight, state, runtime, save_w_t, cache)
    y = fp8_backend.gemm(xq, wq.t(), sx * sw, bias, runtime=runtime)
    return y, (xq_t if save_x_t else xq), sx, (wq_t if save_w_t else wq), sw


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ w.T + b`` with forward, dgrad and wgrad GEMMs in FP8.

    Where the backward GEMM wants K-major operands (cuBLASLt, Hopper wgmma), the forward
    quantizes ``x`` and ``W`` into both layouts (one pass in the plugin kernel) and saves
    the transposed copy, so dgrad ``dy @ W`` and wgrad ``dy.T @ x`` read ``[K, N]`` /
    ``[K, M]`` row-major operands without a transpose of their own.
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, state, runtime, out_dtype, k_major, cache):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        y, x_saved, sx, w_saved, sw = _forward(x2d, weight, bias, state, runtime, cache,
                                               save_x_t=k_major and need_dw,
                                               save_w_t=k_major and need_dx)
        ctx.save_for_backward(x_saved if need_dw else None, sx, w_saved if need_dx else None, sw)
        ctx.state, ctx.runtime, ctx.k_major = state, runtime, k_major
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x_saved, sx, w_saved, sw = ctx.saved_tensors
        state, runtime, k_major = ctx.state, ctx.runtime, ctx.k_major
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if not grad_y.is_contiguous():
            grad_y = grad_y.contiguous()
        dx = dw = db = None
        if need_dx or need_dw:
            layout = (2 if need_dx else 1) if k_major and need_dw else 0
            gq, gq_t, sg = _quantize(grad_y, state.grad_output, state.recipe, runtime, layout)
            if not state._backward_pending:  # one history update per backward pass
                _end_with_backward(state)
            if need_dx:  # [M, N] @ [N, K]
                w_op = w_saved.t() if k_major else w_saved
                dx = fp8_backend.gemm(gq, w_op, sg * sw, runtime=runtime)
                dx = dx if dx.dtype == x_dtype else dx.to(x_dtype)
            if need_dw:  # [N, M] @ [M, K]
                g_op, x_op = (gq_t, x_saved.t()) if k_major else (gq.t(), x_saved)
                dw = fp8_backend.gemm(g_op, x_op, sg * sx, runtime=runtime)
                dw = dw if dw.dtype == w_dtype else dw.to(w_dtype)
        if need_db:  # float32 accumulation without a float32 copy of dy
            db = grad_y.sum(0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


_pending: dict[int, list[Fp8LinearState]] = {}  # graph task -> states its backward used
_pending_lock = threading.Lock()


def _end_with_backward(state: Fp8LinearState) -> None:
    """Have ``state``'s gradient step end when this backward pass ends: one callback per
    pass updates every state it used together (``_end_steps``)."""
    state._backward_pending = True
    task = torch._C._current_graph_task_id()
    with _pending_lock:
        states = _pending.get(task)
        if states is None:
            states = _pending[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_end_backward_pass, task))
        states.append(state)


def _end_backward_pass(task: int) -> None:
    with _pending_lock:
        states = _pending.pop(task, [])
    for state in states:
        state._backward_pending = False
    _end_steps([(state.backward_roles, state.recipe) for state in states])


def _fp8_capable(x, weight, bias) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (all(isinstance(t, torch.Tensor) and t.dtype in QUANTIZE_INPUT_DTYPES for t in tensors)
            and weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and x.numel() > 0 and weight.numel() > 0
            and (bias is None or tuple(bias.shape) == (weight.shape[0],))
            and all(t.device == weight.device for t in tensors))


def _fp8_linear(x, weight, bias, region: _Region) -> torch.Tensor:
    state = _state_for(weight, region.recipe)
    region.touch(state)
    out_dtype = x.dtype
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        out_dtype = torch.get_autocast_dtype(device_type)
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    runtime = current_runtime()
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad:
        fmt = state.recipe.fp8_format
        k_major = fp8_backend.wants_k_major(probe_device(x.device), fmt.backward, fmt.forward,
                                            runtime=runtime)
        y = _Fp8Linear.apply(x2d, weight, bias, state, runtime, out_dtype, k_major, region.cache_weights is True)
    else:
        with torch.no_grad():
            y = _forward(x2d, weight, bias, state, runtime, region.cache_weights is not False)[0]
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
    is opt-in (True, e.g. for gradient accumulation). False never caches.
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
