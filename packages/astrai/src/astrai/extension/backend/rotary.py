"""Rotary position embedding: the plugin kernel where it can run, the torch path otherwise.

``apply_rotary_emb(x, (cos, sin), interleaved=True, positions=None)`` rotates channel pairs
of ``x [batch, seq, heads, head_dim]`` by the angles whose cosine and sine are rows of
``cos`` / ``sin`` (float32 ``[max_pos, rotary_dim // 2]``), row ``positions[b, s]``
(``positions`` int32/int64 ``[seq]`` or ``[batch, seq]``; None: row ``s``)::

    out[a] = x[a] * cos - x[b] * sin
    out[b] = x[a] * sin + x[b] * cos        for each pair (a, b) of channels

Pairs are ``(2i, 2i + 1)`` with ``interleaved=True`` (GPT-J / Meta) and ``(i, i + rotary_dim / 2)``
with ``False`` (NeoX: transformers' ``apply_rotary_pos_emb``); channels past ``rotary_dim =
2 * cos.shape[-1]`` pass through. ``apply_rotary_emb(x, (cos, sin))`` with cos/sin
``[seq, head_dim // 2]`` keeps its original meaning. ``apply_rotary_emb_qk`` rotates q and
k in one launch, optionally in place.

Per call the ``rotary_emb`` kernel of the astrai-elementwise plugin runs when ``x`` is on CUDA in
a dtype the plugin's manifest lists; with a gradient its backward is the same kernel
rotating backwards. Otherwise (CPU, float64, no plugin, a gradient for cos/sin) the torch
path runs (``rotary_torch``, autograd-capable). The choice goes through the runtime's
resolver (op ``"rotary_emb"``; ``current_runtime().explain("rotary_emb")`` shows why) once per
(device, dtype, head_dim, gradient), kept in its derived cache: a repeated call only launches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..compiling import assume_constant_result
from ..device import DeviceInfo, probe_device
from ..op_names import ROTARY_EMB
from ..ops import rotary as ops_rotary
from ..ops._plugin import PLUGIN_OF_OP
from ..ops.rotary_args import check_freqs, check_positions, check_qk, check_x, debug_checks
from ..runtime import Runtime, current_runtime
from .rotary_torch import rotary_torch

__all__ = ["RotaryCall", "apply_rotary_emb", "apply_rotary_emb_qk", "rotary_torch"]


class RotaryCall(NamedTuple):
    """The facts the rotary dispatch decides on (and its resolver key)."""

    device: DeviceInfo
    dtype: torch.dtype
    head_dim: int
    needs_grad: bool


class _Kernel:
    """A plugin kernel (``op``, an astrai-elementwise one unless said: the norms, and the FP8 plugin's
    weight GEMM share this dispatch): its manifest states the dtypes (and head dims, if limited)."""

    name = "cuda"

    def __init__(self, runtime: Runtime, op: str = ROTARY_EMB) -> None:
        self.runtime = runtime
        self.op = op

    def check(self, call: RotaryCall) -> str | None:
        if call.device.type != "cuda":
            return f"the {PLUGIN_OF_OP.get(self.op, 'plugin')} kernels run on CUDA tensors ({call.device.describe()})"
        status = self.runtime.registry.op_status(self.op, call.device)
        if not status.usable:
            return status.reason
        dtype = str(call.dtype).removeprefix("torch.")
        if dtype not in status.spec.dtypes:
            return f"{status.reason} lists dtypes {list(status.spec.dtypes)}, not {dtype}"
        if status.spec.head_dims is not None and call.head_dim not in status.spec.head_dims:
            return f"{status.reason} has head dims {list(status.spec.head_dims)}, not {call.head_dim}"
        return None


class _Torch:
    name = "torch"

    def check(self, call: RotaryCall) -> str | None:
        return None


def _decide(runtime: Runtime, call: RotaryCall, op: str = ROTARY_EMB) -> str:
    return runtime.resolver.resolve(op, (_Kernel(runtime, op), _Torch()), call, call).name


@assume_constant_result
def _choose_while_compiling(device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool, op: str) -> str:
    """The decision made once at trace time: dynamo cannot trace the runtime's context
    variables or the resolver's lock, and the choice is fixed per graph anyway."""
    call = RotaryCall(probe_device(torch.device(device)), dtype, head_dim, needs_grad)
    return _decide(current_runtime(), call, op)


def choose(x: torch.Tensor, needs_grad: bool, op: str = ROTARY_EMB) -> str:
    """"cuda" or "torch" for calls of ``op`` like this one; decided once per key (the plan)."""
    if torch.compiler.is_compiling():
        return _choose_while_compiling(str(x.device), x.dtype, x.shape[-1], needs_grad, op)
    runtime = current_runtime()
    call = RotaryCall(probe_device(x.device), x.dtype, x.shape[-1], needs_grad)
    derived = runtime.resolver.derived  # emptied with the resolver's decisions
    chosen = derived.get((op, call))
    if chosen is None:
        chosen = derived[(op, call)] = _decide(runtime, call, op)
    return chosen


def states_pages(op: str, kv_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the plugin serving ``op`` on ``device`` states ``kv_dtype`` pages (its manifest's
    ``kv_dtypes``); decided once per resolver state, as ``choose`` is."""
    runtime = current_runtime()
    key = (op, "kv_dtypes", kv_dtype, str(device))
    found = runtime.resolver.derived.get(key)
    if found is None:
        spec = runtime.registry.op_status(op, probe_device(device)).spec
        found = runtime.resolver.derived[key] = spec is not None and \
            str(kv_dtype).removeprefix("torch.") in spec.kv_dtypes
    return found


def with_fallback(device: torch.device, kernel, torch_path, op: str = ROTARY_EMB):
    """Run ``kernel()``; if the plugin's module turns out unusable (the registry marks it so
    when it fails to load), forget the cached decisions and run ``torch_path()``."""
    try:
        return kernel()
    except RuntimeError:
        return fall_back(device, torch_path, op)


def fall_back(device: torch.device, torch_path, op: str = ROTARY_EMB):
    """What ``with_fallback`` does once the kernel raised ``RuntimeError``: ``torch_path()``
    when the plugin's module is now marked unusable, else the error again. Call it only
    while handling that error."""
    if torch.compiler.is_compiling():
        raise  # noqa: PLE0704 - the kernel's error, being handled by the caller
    runtime = current_runtime()
    if runtime.registry.op_status(op, probe_device(device)).usable:
        raise  # noqa: PLE0704
    runtime.resolver.clear()
    return torch_path()


class _RotaryFunction(torch.autograd.Function):
    """The kernel with a gradient: the backward rotates the output gradient backwards."""

    @staticmethod
    def forward(ctx, x, cos, sin, positions, interleaved):
        ctx.save_for_backward(cos, sin, positions)
        ctx.interleaved = interleaved
        return ops_rotary.rotary_emb_unchecked(x, cos, sin, positions, interleaved, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin, positions = ctx.saved_tensors
        return ops_rotary.rotary_emb_unchecked(grad, cos, sin, positions, ctx.interleaved, True), None, None, None, None


class _RotaryQKFunction(torch.autograd.Function):
    """q and k in one launch, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, interleaved):
        ctx.save_for_backward(cos, sin, positions)
        ctx.interleaved = interleaved
        return ops_rotary.rotary_qk_unchecked(q, k, cos, sin, positions, interleaved, False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin, positions = ctx.saved_tensors
        if grad_q is None or grad_k is None:  # only one of them was used
            back = lambda g: None if g is None else ops_rotary.rotary_emb_unchecked(  # noqa: E731
                g, cos, sin, positions, ctx.interleaved, True)
            dq, dk = back(grad_q), back(grad_k)
        else:
            dq, dk = ops_rotary.rotary_qk_unchecked(grad_q, grad_k, cos, sin, positions, ctx.interleaved, True)
        return dq, dk, None, None, None, None


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Plan(NamedTuple):
    """What a call like this one runs, decided and validated once (the rotary plan)."""

    run: Callable  # (x, cos, sin, positions) -> out
    kernel: bool
    range_check: bool  # positions on the host (or ASTRAI_DEBUG=1): checked on every call


_MAX_PLANS = 512
_NO_PLANS: dict = {}  # never filled: what a runtime without plans yet looks them up in


def _plans(runtime: Runtime) -> dict:
    """The rotary plans, kept in the resolver's derived cache (emptied with its decisions)."""
    plans = runtime.resolver.derived.get("rotary_plans")
    if plans is None:
        plans = runtime.resolver.derived["rotary_plans"] = {}
    return plans


def _make_plan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
               interleaved: bool) -> _Plan:
    check_x("x", x)
    check_freqs((cos, sin), x, x.shape[1], positions)
    if positions is not None:
        check_positions(positions, x.shape[0], x.shape[1], cos.shape[0], x.device)
    range_check = positions is not None and (positions.device.type == "cpu" or debug_checks())
    needs_grad = _needs_grad(x)
    if _needs_grad(cos, sin) or choose(x, needs_grad) != "cuda":  # gradients for the angles: torch's autograd
        return _Plan(lambda x, c, s, p: rotary_torch(x, c, s, p, interleaved), False, range_check)
    if needs_grad:
        return _Plan(lambda x, c, s, p: _RotaryFunction.apply(x, c, s, p, interleaved), True, range_check)
    if x.is_cuda and x.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1:
        return _Plan(ops_rotary.rotary_emb_launcher(x, cos, sin, positions, interleaved, False), True, range_check)
    return _Plan(lambda x, c, s, p: ops_rotary.rotary_emb_unchecked(x, c, s, p, interleaved, False), True, range_check)


def apply_rotary_emb(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor], *, interleaved: bool = True,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate channel pairs of ``x [batch, seq, heads, head_dim]`` (float16/bfloat16/float32/float64).

    ``freqs = (cos, sin)``, each float32 ``[max_pos, rotary_dim // 2]`` on ``x``'s device
    (``rotary_dim <= head_dim``); ``positions`` (int32/int64 ``[seq]``, ``[batch, seq]`` or
    ``[1, seq]``) selects their rows, by default ``0 .. seq-1``. ``interleaved=False`` is the
    NeoX layout. Returns a new tensor of ``x``'s shape and dtype; differentiable. Bad
    arguments raise ``TypeError`` / ``ValueError`` naming the argument.

    The checks and the backend decision are made once per kind of call (shapes, strides,
    dtypes, devices, gradients, layout) and kept as a plan; a repeated call only launches.
    """
    if type(freqs) is tuple and len(freqs) == 2 and not torch.compiler.is_compiling():
        cos, sin = freqs
        if (type(x) is torch.Tensor and type(cos) is torch.Tensor and type(sin) is torch.Tensor
                and (positions is None or type(positions) is torch.Tensor)):
            # Everything the checks and the decision read (equal keys, equal plans); the device's
            # properties follow from x.device, the gradient flags matter only with gradients on.
            pos = None if positions is None else (positions.shape, positions.stride(), positions.dtype,
                                                  positions.device, debug_checks())
            key = (x.shape, x.stride(), x.dtype, x.device, cos.shape, cos.stride(), cos.dtype, cos.device,
                   sin.shape, sin.stride(), sin.dtype, sin.device, pos, interleaved,
                   torch.is_grad_enabled() and (x.requires_grad, cos.requires_grad, sin.requires_grad))
            plan = current_runtime().resolver.derived.get("rotary_plans", _NO_PLANS).get(key)
            if plan is None:
                plans = _plans(current_runtime())
                if len(plans) >= _MAX_PLANS:  # many shapes (prefill lengths): start over rather than grow
                    plans.clear()
                plan = plans[key] = _make_plan(x, cos, sin, positions, interleaved)
            elif plan.range_check:
                check_positions(positions, x.shape[0], x.shape[1], cos.shape[0], x.device)
            run, kernel, _ = plan
            if not kernel:
                return run(x, cos, sin, positions)
            try:  # with_fallback, without two closures per call
                return run(x, cos, sin, positions)
            except RuntimeError:
                return fall_back(x.device, lambda: rotary_torch(x, cos, sin, positions, interleaved))
    # traced by torch.compile, or arguments the checks will name
    check_x("x", x)
    cos, sin = check_freqs(freqs, x, x.shape[1], positions)
    if positions is not None:
        check_positions(positions, x.shape[0], x.shape[1], cos.shape[0], x.device)
    if _needs_grad(cos, sin):  # gradients for the angles: torch's autograd only
        return rotary_torch(x, cos, sin, positions, interleaved)
    needs_grad = _needs_grad(x)
    if choose(x, needs_grad) == "cuda":
        if needs_grad:
            return _RotaryFunction.apply(x, cos, sin, positions, interleaved)
        return ops_rotary.rotary_emb_unchecked(x, cos, sin, positions, interleaved, False)
    return rotary_torch(x, cos, sin, positions, interleaved)


def apply_rotary_emb_qk(q: torch.Tensor, k: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor], *,
                        positions: torch.Tensor | None = None, interleaved: bool = True,
                        inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[batch, seq, q_heads, D]`` and k ``[batch, seq, kv_heads, D]`` (or both
    ``[tokens, heads, D]``) by the same rows, in one launch on CUDA; ``apply_rotary_emb``'s
    arguments otherwise. ``inplace=True`` writes into q and k and returns them.
    """
    check_qk(q, k)
    flat = q.dim() == 3  # [tokens, heads, D]: one sequence of tokens
    q4, k4 = (q[None], k[None]) if flat else (q, k)
    cos, sin = check_freqs(freqs, q4, q4.shape[1], positions, "q")
    if positions is not None:
        check_positions(positions, q4.shape[0], q4.shape[1], cos.shape[0], q.device)

    def torch_path():
        qo = rotary_torch(q4, cos, sin, positions, interleaved)
        ko = rotary_torch(k4, cos, sin, positions, interleaved)
        return qo, ko

    needs_grad = _needs_grad(q, k)
    if not _needs_grad(cos, sin) and choose(q, needs_grad) == "cuda":
        if inplace and not needs_grad:
            def kernel():
                ops_rotary.rotary_qk_inplace_unchecked(q4, k4, cos, sin, positions, interleaved)
                return q4, k4
        elif needs_grad:
            kernel = lambda: _RotaryQKFunction.apply(q4, k4, cos, sin, positions, interleaved)  # noqa: E731
        else:
            kernel = lambda: ops_rotary.rotary_qk_unchecked(q4, k4, cos, sin, positions, interleaved, False)  # noqa: E731
        qo, ko = with_fallback(q.device, kernel, torch_path)
    else:
        qo, ko = torch_path()
    if inplace:
        if qo is not q4:
            q4.copy_(qo)
            k4.copy_(ko)
        return q, k
    return (qo[0], ko[0]) if flat else (qo, ko)
