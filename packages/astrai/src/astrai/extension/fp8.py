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
import math
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


@dataclass(eq=False)
class TensorScaling:
    """Scaling state of one tensor role of one weight (``input``, ``weight``, ``grad_output``).

    ``amax_history[0]`` collects the current step's amax (maximum over the calls of the
    step); ``amax_history[1:]`` are earlier steps, newest first. ``scale`` is the
    dequantization scale the next quantization uses (delayed) or the last one used
    (dynamic); ``scale_inv`` its reciprocal, the multiplier handed to the quantizer.
    Roles updated at the same moment (``input`` and ``weight``) are rows of one stacked
    history (``_RoleGroup``), and these tensors are views of their rows. Updates replace
    the tensors rather than writing into them, so a backward pass still reads the scales
    its forward used.
    """

    fmt: str
    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    updates: int = 0  # end-of-step updates applied so far
    # Host-side bookkeeping of the weight cache (``_quantize_weight``): ``epoch`` changes
    # whenever the delayed scale may have changed; ``_tokens`` are the weight contents
    # recorded in the step in progress, ``_window`` those of the steps the scale is
    # computed from (None: a role whose contents are not tracked).
    epoch: int = field(default=0, repr=False)
    _slot: torch.Tensor | None = field(default=None, repr=False)  # amax_history[:1]
    _tokens: set[int] = field(default_factory=set, repr=False)
    _window: deque[frozenset[int]] | None = field(default=None, repr=False)
    _window_union: frozenset[int] | None = field(default=None, repr=False)

    def scale_for(self, x: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, multiplier)`` to quantize ``x`` with."""
        if isinstance(recipe, DynamicScaling):
            # max|x| is one of the elements: exact in float32 whatever x's dtype
            amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
            scale = torch.where(_usable(amax), amax * _factor(self.fmt, recipe.margin), 1.0)
            self.scale, self.scale_inv = scale, scale.reciprocal()
        return self.scale, self.scale_inv

    def record(self, amax: torch.Tensor, token: int | None = None) -> None:
        """Fold ``amax`` into the step's slot; ``token`` names the weight content it is of."""
        torch.maximum(self._slot, amax, out=self._slot)
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


def _usable(amax: torch.Tensor) -> torch.Tensor:
    """``amax > 0`` and finite (an amax is never negative; NaN compares false)."""
    return (amax > 0) & (amax < math.inf)


class _RoleGroup:
    """Roles whose delayed-scaling update happens at the same moment, stacked: one
    ``[R, L]`` history and one ``[R]`` scale, so an update is a handful of tensor ops for
    all of them (amax, scale, reciprocal, shifted history) instead of a dozen per role."""

    def __init__(self, fmt: str, rows: int, recipe: Recipe, device: torch.device,
                 tracked: tuple[bool, ...]):
        length = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        window = length if isinstance(recipe, DelayedScaling) and recipe.amax_compute_algo == "max" else 1
        self.fmt = fmt
        self.hist = torch.zeros(rows, length, dtype=torch.float32, device=device)
        self.scale = torch.ones(rows, dtype=torch.float32, device=device)
        self.scale_inv = self.scale  # 1 / 1
        self._zeros = torch.zeros(rows, 1, dtype=torch.float32, device=device)
        self._batch: _Batch | None = None  # set while the tensors are rows of a batch's
        self.roles = [TensorScaling(fmt, self.hist, self.scale, self.scale_inv,
                                    _window=deque(maxlen=window) if track else None)
                      for track in tracked]
        self._publish(_rows(self.hist, self.scale, self.scale_inv), 0)

    def _publish(self, rows: tuple, start: int, scales: bool = True) -> None:
        """Point the roles at their rows of ``_rows(...)`` from ``start`` on (views)."""
        hists, slots, scale_rows, inv_rows = rows
        for i, role in enumerate(self.roles, start):
            role.amax_history, role._slot = hists[i], slots[i]
            if scales:
                role.scale, role.scale_inv = scale_rows[i], inv_rows[i]

    def to(self, device: torch.device) -> None:
        self.hist, self.scale, self.scale_inv, self._zeros = (
            t.to(device) for t in (self.hist, self.scale, self.scale_inv, self._zeros))
        self._batch = None
        self._publish(_rows(self.hist, self.scale, self.scale_inv), 0, scales=False)
        for role in self.roles:  # the scales last used (dynamic) or published (delayed)
            role.scale, role.scale_inv = role.scale.to(device), role.scale_inv.to(device)

    def end_step(self, recipe: DelayedScaling) -> None:
        """Roll the histories and compute the next scales (see ``_delayed_update``)."""
        scale, inv, self.hist = _delayed_update(self.hist, self.scale, recipe, self.fmt, self._zeros)
        self.scale, self.scale_inv, self._batch = scale, inv, None
        self._published(_rows(self.hist, scale, inv), 0)

    def _published(self, rows: tuple, start: int) -> None:
        self._publish(rows, start)
        for role in self.roles:
            role._close_step()


def _rows(hist: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor) -> tuple:
    """Per-row views of stacked histories ``[..., L]`` and scales ``[...]``, rows in order:
    ``(histories, slot 0 of each, scales, multipliers)``; a handful of view ops for any
    number of rows, no kernels."""
    if hist.dim() > 2:
        hist, scale, inv = hist.flatten(0, -2), scale.flatten(), inv.flatten()
    return hist.unbind(0), hist[:, :1].unbind(0), scale.unbind(0), inv.unbind(0)


def _delayed_update(hist: torch.Tensor, prev: torch.Tensor, recipe: DelayedScaling, fmt: str,
                    zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv, history)`` after a step, for histories stacked along the
    leading dimensions (``[..., L]``): ``amax = max(history)`` or ``history[0]``,
    ``scale = amax * 2**margin / fp8_max`` unless the amax is zero or not finite (then
    ``prev`` stays), and the history shifted by one with slot 0 cleared. Every op is
    elementwise or a max, so stacking more rows changes no value."""
    amax = hist.amax(-1) if recipe.amax_compute_algo == "max" else hist[..., 0]
    scale = torch.where(_usable(amax), amax * _factor(fmt, recipe.margin), prev)
    return scale, scale.reciprocal(), torch.cat((zeros, hist[..., :-1]), -1)


@dataclass(eq=False)
class _Batch:
    """Groups updated together last time: their histories and scales are rows of these."""

    groups: tuple[_RoleGroup, ...]
    hist: torch.Tensor  # [S, R, L]
    scale: torch.Tensor  # [S, R]
    zeros: torch.Tensor  # [S, R, 1]


def _end_steps(pairs: list[tuple[_RoleGroup, Recipe]]) -> None:
    """End the step of many role groups: one stacked update per (recipe, format, device,
    shape) instead of one per group, so a region's bookkeeping costs about ten kernels
    whatever the number of linears in it. Delayed scaling only; values as group by group.
    The histories stay rows of one tensor, so the next update of the same groups needs
    no stacking copy."""
    buckets: dict[tuple, list[_RoleGroup]] = {}
    for group, recipe in pairs:
        if isinstance(recipe, DelayedScaling):
            key = (recipe, group.fmt, group.hist.device, group.hist.shape)
            buckets.setdefault(key, []).append(group)
    for (recipe, fmt, _, _), groups in buckets.items():
        if len(groups) == 1:
            groups[0].end_step(recipe)
            continue
        members = tuple(groups)
        batch = groups[0]._batch
        if batch is not None and batch.groups == members and all(g._batch is batch for g in groups):
            hist, prev, zeros = batch.hist, batch.scale, batch.zeros
        else:
            hist = torch.stack([g.hist for g in groups])
            prev = torch.stack([g.scale for g in groups])
            zeros = hist.new_zeros((*hist.shape[:-1], 1))
        scale, inv, hist = _delayed_update(hist, prev, recipe, fmt, zeros)
        batch = _Batch(members, hist, scale, zeros)
        rows = _rows(hist, scale, inv)
        start = 0
        for group, h, s, i in zip(groups, hist.unbind(0), scale.unbind(0), inv.unbind(0)):
            group.hist, group.scale, group.scale_inv, group._batch = h, s, i, batch
            group._published(rows, start)
            start += len(group.roles)


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
    elif state.forward_roles.hist.device != weight.device:  # the module moved since
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
