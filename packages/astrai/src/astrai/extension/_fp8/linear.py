"""The FP8 linear: its per-shape plan, the autograd Function running the forward, dgrad
and wgrad GEMMs in FP8, and the end of each backward pass's gradient step."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..backend import fp8 as fp8_backend
from ..backend import fp8_runners
from ..backend.fp8_torch import QUANTIZE_INPUT_DTYPES
from ..device import DeviceInfo, probe_device
from ..runtime import Runtime, current_runtime
from .scaling import _ROW, _end_steps
from .state import Fp8LinearState, _state_for
from .weights import _quantize, _quantize_weight

if TYPE_CHECKING:
    from ..fp8 import _Region


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
        self.quantize_x = fp8_runners.quantizer(device, x_dtype, fmt, runtime)
        self.quantize_w = fp8_runners.quantizer(device, w_dtype, fmt, runtime)
        self.gemm = fp8_runners.gemm_runner(device, fmt, fmt, shape, runtime)
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


def _forward(x2d, weight, bias, state, plan: _Plan, cache: bool, in_graphs: bool) -> torch.Tensor:
    """The forward GEMM of a call recording no gradient (x's copy is read by it alone)."""
    xq, _, sx, _ = _quantize(x2d, state.input, state.recipe, plan.quantize_x, reuse="x")
    wq, _, sw = _quantize_weight(weight, state, plan.quantize_w, False, cache, in_graphs)
    return plan.gemm(xq, wq.t(), sx, sw, bias)


def _scale_copies(group, sx: torch.Tensor, sw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the scales a training forward used, for its backward: the region's update
    rewrites the live ones in place before the backward runs. They sit ``_ROW`` apart,
    16-byte aligned as cuBLASLt takes scale pointers, as the group's live rows do: a copy
    of those (one clone, two views) unless the weight's scale is a cached copy's own."""
    if sx is group.roles[0].scale and sw is group.roles[1].scale:
        copy = group.tensors[1].clone()
        return copy[0], copy[_ROW]
    zero = group._zero
    copies = torch.stack((sx, *(zero,) * (_ROW - 1), sw)).unbind(0)
    return copies[0], copies[_ROW]


def _backward(ctx, grad_y):
    """``_Fp8Linear``'s backward: quantize ``dy``, the dgrad and wgrad GEMMs, the bias
    gradient. Under ``create_graph=True`` through ``once_differentiable`` (its guard
    against a second derivative); otherwise what that runs, without its no_grad block."""
    if torch.is_grad_enabled():
        return _backward_once_differentiable(ctx, grad_y)
    x_op, sx, w_op, sw = ctx.saved_tensors  # the GEMM operands as the forward laid them out
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
        run = plan.quantize_g if grad_y.dtype is plan.g_dtype else None
        if run is None:
            run = _grad_quantizer(plan, grad_y.dtype, role.fmt)
        # both copies are read by this backward's GEMMs alone
        gq, gq_t, sg, _ = _quantize(grad_y, role, state.recipe, run, layout, reuse="g", reuse_t=True)
        if not state._backward_pending:  # one history update per backward pass
            _end_with_backward(state)
        m, n = grad_y.shape
        if need_dx:  # [M, N] @ [N, K]
            dgrad = plan.dgrad
            if dgrad is None:
                dgrad = plan.dgrad = _backward_gemm(plan, state, (m, w_op.shape[1], n))
            dx = dgrad(gq, w_op, sg, sw, None)
            dx = dx if dx.dtype == x_dtype else dx.to(x_dtype)
        if need_dw:  # [N, M] @ [M, K]
            g_op = gq_t if k_major else gq.t()
            wgrad = plan.wgrad
            if wgrad is None:
                wgrad = plan.wgrad = _backward_gemm(plan, state, (n, x_op.shape[1], m))
            dw = wgrad(g_op, x_op, sg, sx, None)
            dw = dw if dw.dtype == w_dtype else dw.to(w_dtype)
    if need_db:  # float32 accumulation (a 16-bit sum's own) without a float32 copy of dy
        if b_dtype == grad_y.dtype or b_dtype == torch.float32:
            db = grad_y.sum(0, dtype=b_dtype)
        else:
            db = grad_y.sum(0, dtype=torch.float32).to(b_dtype)
    return dx, dw, db, None


_backward_once_differentiable = torch.autograd.function.once_differentiable(_backward)


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ w.T + b`` with forward, dgrad and wgrad GEMMs in FP8.

    Where the backward GEMM wants K-major operands (cuBLASLt, Hopper wgmma), the forward
    quantizes ``x`` and ``W`` into both layouts (one pass in the plugin kernel) and saves
    the transposed copy, so dgrad ``dy @ W`` and wgrad ``dy.T @ x`` read ``[K, N]`` /
    ``[K, M]`` row-major operands without a transpose of their own. It saves them as the
    backward's GEMMs take them (``W`` as ``[N, K]``, ``x`` as ``[M, K]``, views of those
    copies): the views are made on the forward's thread, not on autograd's device thread,
    where the backward runs.
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, call):
        state, plan, out_dtype, cache = call  # one argument: autograd walks each of them
        need_dx, need_dw = ctx.needs_input_grad[:2]
        k_major = plan.k_major
        save_x_t, save_w_t = k_major and need_dw, k_major and need_dx
        # x's row-major copy is read by the forward GEMM alone unless the backward keeps it
        xq, xq_t, sx, _ = _quantize(x2d, state.input, state.recipe, plan.quantize_x, 2 if save_x_t else 0,
                                    reuse=None if need_dw and not save_x_t else "x")
        wq, wq_t, sw = _quantize_weight(weight, state, plan.quantize_w, save_w_t, cache, cache)
        y = plan.gemm(xq, wq.t(), sx, sw, bias)
        if state.forward_roles.delayed and (need_dx or need_dw):
            sx, sw = _scale_copies(state.forward_roles, sx, sw)
        ctx.save_for_backward((xq_t.t() if save_x_t else xq) if need_dw else None, sx,
                              (wq_t.t() if save_w_t else wq) if need_dx else None, sw)
        ctx.state, ctx.plan = state, plan
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    backward = staticmethod(_backward)


def _grad_quantizer(plan: _Plan, dtype: torch.dtype, fmt: str):
    """The plan's quantize function for the gradient (made on the first backward)."""
    if dtype is not plan.g_dtype:  # not the output's dtype: asked for this call
        return fp8_runners.quantizer(plan.call.device, dtype, fmt, plan.call.runtime)
    run = plan.quantize_g
    if run is None:
        run = plan.quantize_g = fp8_runners.quantizer(plan.call.device, dtype, fmt, plan.call.runtime)
    return run


def _backward_gemm(plan: _Plan, state: Fp8LinearState, shape: tuple[int, int, int]):
    """dgrad / wgrad (the gradient's format times the forward's) for ``shape``."""
    call = plan.call
    return fp8_runners.gemm_runner(call.device, state.grad_output.fmt, state.input.fmt, shape, call.runtime)


_pending: dict[int, list[Fp8LinearState]] = {}  # graph task -> states its backward used
_pending_lock = threading.RLock()  # RLock: an abandoned pass is noticed wherever its end is freed


class _PassEnd:
    """The callback ending one backward pass's gradient step, held by the engine alone:
    called when the pass finishes, it updates every state the pass used together
    (``_end_steps``). Freed unrun (the pass raised), it has those states forget the
    gradient amaxes the pass recorded, so the next pass neither folds them into its step
    nor finds a state still pending."""

    __slots__ = ("task", "ran")

    def __init__(self, task: int):
        self.task, self.ran = task, False

    def __call__(self) -> None:
        self.ran = True
        with _pending_lock:
            states = _pending.pop(self.task, [])
        for state in states:
            state._backward_pending = False
        _end_steps([(state.backward_roles, state.recipe) for state in states])

    def __del__(self) -> None:
        if self.ran:
            return
        with _pending_lock:
            states = _pending.pop(self.task, [])
        for state in states:
            state._backward_pending = False
            for role in state.backward_roles.roles:
                role._abandon_step()


def _end_with_backward(state: Fp8LinearState) -> None:
    """Have ``state``'s gradient step end when this backward pass ends: one callback per
    pass (``_PassEnd``) updates every state it used together."""
    state._backward_pending = True
    task = torch._C._current_graph_task_id()
    with _pending_lock:
        states = _pending.get(task)
        if states is None:
            states = _pending[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(_PassEnd(task))
        states.append(state)


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
        y = _Fp8Linear.apply(x2d, weight, bias, (state, plan, out_dtype, region.cache_weights is True))
    else:
        plan = _plan_for(x2d, weight, state, None)
        cache, in_graphs = region.cache_weights is not False, region.cache_weights is True
        if grad_mode:  # nothing requires a gradient: none recorded either
            with torch.no_grad():
                y = _forward(x2d, weight, bias, state, plan, cache, in_graphs)
        else:
            y = _forward(x2d, weight, bias, state, plan, cache, in_graphs)
        if y.dtype != out_dtype:
            y = y.to(out_dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
