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
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .backend import fp8 as fp8_backend
from .backend.fp8_torch import FP8_MAX, QUANTIZE_INPUT_DTYPES
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


@dataclass
class TensorScaling:
    """Scaling state of one tensor role of one weight (``input``, ``weight``, ``grad_output``).

    ``amax_history[0]`` collects the current step's amax (maximum over the calls of the
    step); ``amax_history[1:]`` are earlier steps, newest first. ``scale`` is the
    dequantization scale the next quantization uses (delayed) or the last one used
    (dynamic); ``scale_inv`` its reciprocal, the multiplier handed to the quantizer.
    Updates replace these tensors rather than writing into them, so a backward pass
    still reads the scales its forward used.
    """

    fmt: str
    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    updates: int = 0  # end-of-step updates applied so far

    @classmethod
    def create(cls, fmt: str, history_len: int, device: torch.device) -> TensorScaling:
        one = torch.ones((), dtype=torch.float32, device=device)
        return cls(fmt, torch.zeros(history_len, dtype=torch.float32, device=device), one, one)

    def to(self, device: torch.device) -> None:
        self.amax_history = self.amax_history.to(device)
        self.scale = self.scale.to(device)
        self.scale_inv = self.scale_inv.to(device)

    def scale_for(self, x: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, multiplier)`` to quantize ``x`` with."""
        if isinstance(recipe, DynamicScaling):
            amax = torch.linalg.vector_norm(x.detach(), float("inf")).to(torch.float32)
            self._set_scale(_scale_from_amax(amax, torch.ones_like(amax), self.fmt, recipe.margin))
        return self.scale, self.scale_inv

    def _set_scale(self, scale: torch.Tensor) -> None:
        self.scale, self.scale_inv = scale, scale.reciprocal()

    def record(self, amax: torch.Tensor) -> None:
        slot = self.amax_history[:1]
        torch.maximum(slot, amax, out=slot)

    def end_step(self, recipe: Recipe) -> None:
        """Roll the history and compute the next scale (delayed scaling only)."""
        if isinstance(recipe, DynamicScaling):
            return
        hist = self.amax_history
        amax = hist.max() if recipe.amax_compute_algo == "max" else hist[0]
        self._set_scale(_scale_from_amax(amax, self.scale, self.fmt, recipe.margin))
        self.amax_history = torch.roll(hist, 1)
        self.amax_history[0] = 0.0
        self.updates += 1


def _scale_from_amax(amax: torch.Tensor, previous: torch.Tensor, fmt: str, margin: int) -> torch.Tensor:
    candidate = amax * (2.0 ** margin / FP8_MAX[fmt])
    good = (amax > 0) & torch.isfinite(amax)
    return torch.where(good, candidate, previous)


@dataclass
class Fp8LinearState:
    """FP8 state of one linear weight: a ``TensorScaling`` per tensor role."""

    recipe: Recipe
    input: TensorScaling
    weight: TensorScaling
    grad_output: TensorScaling
    _backward_pending: bool = field(default=False, repr=False)

    @classmethod
    def create(cls, recipe: Recipe, device: torch.device) -> Fp8LinearState:
        length = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        fmt = recipe.fp8_format
        return cls(recipe, TensorScaling.create(fmt.forward, length, device),
                   TensorScaling.create(fmt.forward, length, device),
                   TensorScaling.create(fmt.backward, length, device))

    def end_forward_step(self) -> None:
        self.input.end_step(self.recipe)
        self.weight.end_step(self.recipe)

    def end_backward_step(self) -> None:
        self._backward_pending = False
        self.grad_output.end_step(self.recipe)


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
    if state is None or state.recipe != recipe:  # a different recipe starts afresh
        state = Fp8LinearState.create(recipe, weight.device)
        setattr(weight, _STATE_ATTR, state)
    elif state.input.scale.device != weight.device:  # the module moved since
        for role in (state.input, state.weight, state.grad_output):
            role.to(weight.device)
    return state


# -- the FP8 linear ---------------------------------------------------------------------


def _quantize(x: torch.Tensor, role: TensorScaling, recipe: Recipe, runtime: Runtime,
              out_layout: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, multiplier = role.scale_for(x, recipe)
    q, q_t, amax = fp8_backend.quantize(x, multiplier, role.fmt, out_layout, runtime=runtime)
    role.record(amax)
    return q, q_t, scale


def _forward(x2d, weight, bias, state, runtime, save_x_t: bool = False, save_w_t: bool = False):
    """The forward GEMM; also returns the FP8 operands the backward will read (their
    transposes when the backward GEMM wants K-major operands: see ``_Fp8Linear``)."""
    xq, xq_t, sx = _quantize(x2d, state.input, state.recipe, runtime, 2 if save_x_t else 0)
    wq, wq_t, sw = _quantize(weight, state.weight, state.recipe, runtime, 2 if save_w_t else 0)
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
    def forward(ctx, x2d, weight, bias, state, runtime, out_dtype, k_major):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        y, x_saved, sx, w_saved, sw = _forward(x2d, weight, bias, state, runtime,
                                               save_x_t=k_major and need_dw,
                                               save_w_t=k_major and need_dx)
        ctx.save_for_backward(x_saved if need_dw else None, sx, w_saved if need_dx else None, sw)
        ctx.state, ctx.runtime, ctx.k_major = state, runtime, k_major
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x_saved, sx, w_saved, sw = ctx.saved_tensors
        state, runtime, k_major = ctx.state, ctx.runtime, ctx.k_major
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        grad_y = grad_y.contiguous()
        dx = dw = db = None
        if need_dx or need_dw:
            layout = (2 if need_dx else 1) if k_major and need_dw else 0
            gq, gq_t, sg = _quantize(grad_y, state.grad_output, state.recipe, runtime, layout)
            if not state._backward_pending:  # one history update per backward pass
                state._backward_pending = True
                torch.autograd.Variable._execution_engine.queue_callback(state.end_backward_step)
            if need_dx:  # [M, N] @ [N, K]
                w_op = w_saved.t() if k_major else w_saved
                dx = fp8_backend.gemm(gq, w_op, sg * sw, runtime=runtime).to(x_dtype)
            if need_dw:  # [N, M] @ [M, K]
                g_op, x_op = (gq_t, x_saved.t()) if k_major else (gq.t(), x_saved)
                dw = fp8_backend.gemm(g_op, x_op, sg * sx, runtime=runtime).to(w_dtype)
        if need_db:
            db = grad_y.to(torch.float32).sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None


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
    if torch.is_autocast_enabled(x.device.type):
        out_dtype = torch.get_autocast_dtype(x.device.type)
    x2d = x.reshape(-1, x.shape[-1])
    runtime = current_runtime()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    if needs_grad:
        k_major = fp8_backend.wants_k_major(probe_device(x.device), state.recipe.fp8_format.backward,
                                            state.recipe.fp8_format.forward, runtime=runtime)
        y = _Fp8Linear.apply(x2d, weight, bias, state, runtime, out_dtype, k_major)
    else:
        with torch.no_grad():
            y = _forward(x2d, weight, bias, state, runtime)[0].to(out_dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


# -- the autocast region ----------------------------------------------------------------


@dataclass
class _Region:
    enabled: bool
    recipe: Recipe
    touched: dict[int, Fp8LinearState]  # shared by a thread's nested regions

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
def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None) -> Iterator[None]:
    """Run ``F.linear`` / ``nn.Linear`` in FP8 inside the block (see the module docstring).

    Regions nest: the innermost decides (``enabled=False`` inside switches FP8 off for
    its block). Delayed-scaling forward states update once, when the outermost region of
    the thread exits; gradient states at the end of each backward pass.
    Linears FP8 can't take (float64, zero-size, mismatched shapes) run unchanged.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if recipe is None:
        recipe = DelayedScaling()
    elif not isinstance(recipe, (DelayedScaling, DynamicScaling)):
        raise TypeError(f"recipe must be a DelayedScaling or DynamicScaling, got {type(recipe).__name__}")
    stack = _stack()
    outermost = not stack
    touched = {} if outermost else stack[0].touched
    stack.append(_Region(enabled, recipe, touched))
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
            for state in touched.values():
                state.end_forward_step()
