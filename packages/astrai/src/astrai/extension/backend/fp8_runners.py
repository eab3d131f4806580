"""The FP8 linear's per-call path: functions built once per (runtime, device, formats,
shape) that run what the policy in ``backend.fp8`` chose, without its checks and decisions,
and delayed scaling's end-of-step update.

fp8_autocast makes the same calls for every linear of every step, with operands it built
itself (2-D, dense, on one device, 0-d float32 scales); the host cost of a linear is what
limits it at small token counts. The functions live in the resolver's ``derived`` cache,
which a ``clear()`` (a plugin found broken) empties with the decisions.
"""

from __future__ import annotations

import functools

import torch

from ..device import DeviceInfo, probe_device
from ..op_names import FP8_QUANTIZE, FP8_SCALE_UPDATE
from ..ops import _plugin as ops_plugin
from ..ops import fp8 as ops_fp8
from ..runtime import Runtime
from . import fp8 as policy  # by module: the choices are looked up (and patchable) there
from . import fp8_torch
from .fp8_torch import _SCALED_MM_ALIGN

_MISSING = object()


def _runner(runtime: Runtime, key: tuple, build, *args):
    """``build(*args)``, made once per key and kept in the resolver's ``derived`` cache."""
    derived = runtime.resolver.derived  # emptied with the resolver's decisions
    value = derived.get(key, _MISSING)
    if value is _MISSING:  # a built None (no plugin module) is kept too
        value = derived[key] = build(*args)
    return value


def _quantize_checked(runtime: Runtime, fmt: str, x, multiplier, out_layout, amax=None, cache=None,
                      reuse=None, reuse_t=False):
    """``quantize`` through the checked public path, ``max|x|`` copied into ``amax``."""
    q, q_t, got = policy.quantize(x, multiplier, fmt, out_layout, runtime=runtime)
    if amax is None:
        return q, q_t, got
    amax.copy_(got)
    return q, q_t, amax


def _gemm_checked(runtime: Runtime, a, b, scale_a, scale_b, bias):
    return policy.gemm(a, b, scale_a * scale_b, bias, runtime=runtime)


def quantizer(device: DeviceInfo, x_dtype: torch.dtype, fmt: str, runtime: Runtime):
    """``run(x, multiplier, out_layout, amax=None, cache=None, reuse=None, reuse_t=False)
    -> (q, q_t, amax)``: ``quantize`` for these facts, ``max|x|`` written into ``amax``
    when given (a 0-d float32 tensor). ``cache``: a dict the caller keeps with its
    multiplier and amax tensors, where the plugin call keeps what it derives from them
    between calls. ``reuse`` (a tag naming the operand): the caller reads ``q`` (and
    ``q_t`` if ``reuse_t``) only until its next call of this function with that tag on
    this thread and stream, so the plugin call may write them into buffers it keeps
    (``ops.fp8.QuantizeScratch``)."""
    if torch.compiler.is_compiling():
        return functools.partial(_quantize_checked, runtime, fmt)
    return _runner(runtime, ("quantize", device.key, x_dtype, fmt), _build_quantizer, device, x_dtype, fmt,
                   runtime)


def _build_quantizer(device: DeviceInfo, x_dtype: torch.dtype, fmt: str, runtime: Runtime):
    module = None
    if policy.choose_quantize(device, x_dtype, fmt, runtime=runtime) == "plugin":
        module = _usable_module(FP8_QUANTIZE, device, runtime)
    if module is None:
        def run_torch(x, multiplier, out_layout, amax=None, cache=None, reuse=None, reuse_t=False):
            return fp8_torch.quantize(x, multiplier, fmt, out_layout, amax)

        return run_torch
    launch = ops_fp8.quantize_launcher(module, fmt)
    scratch = ops_fp8.QuantizeScratch(fmt)

    def run(x, multiplier, out_layout, amax=None, cache=None, reuse=None, reuse_t=False):
        out = torch.empty((), dtype=torch.float32, device=x.device) if amax is None else amax
        x = x if x.is_contiguous() else x.contiguous()
        kept = None if reuse is None else scratch.outputs(x, out_layout, reuse, reuse_t)
        try:
            q, q_t = launch(x, multiplier, out_layout, out, cache, kept)
        except RuntimeError:
            if not policy._plugin_broken(runtime, FP8_QUANTIZE, device):
                raise
            return _quantize_checked(runtime, fmt, x, multiplier, out_layout, amax)
        return q, q_t, out

    return run


def gemm_runner(device: DeviceInfo, a_fmt: str, b_fmt: str, shape: tuple[int, int, int], runtime: Runtime):
    """``run(a, b, scale_a, scale_b, bias) -> bf16(scale_a * scale_b * a @ b + bias)`` for
    the shape class of ``shape``; ``a`` row-major and ``b`` column-major run cuBLASLt
    without a copy, other layouts take the general path."""
    if torch.compiler.is_compiling():
        return functools.partial(_gemm_checked, runtime)
    return _runner(runtime, ("gemm", device.key, a_fmt, b_fmt, policy.shape_class(*shape)), _build_gemm, device,
                   a_fmt, b_fmt, shape, runtime)


def _build_gemm(device: DeviceInfo, a_fmt: str, b_fmt: str, shape: tuple[int, int, int], runtime: Runtime):
    _, n, k = shape
    general = functools.partial(_gemm_checked, runtime)
    chosen = policy.choose_gemm(device, a_fmt, b_fmt, runtime=runtime, shape=shape)
    if chosen == "emulated":  # any layout; what ``gemm`` runs for it, without its checks
        return _run_emulated
    if chosen != "scaled_mm" or k % _SCALED_MM_ALIGN or n % _SCALED_MM_ALIGN:
        return general

    return fp8_torch.scaled_mm_runner(k, general)


def _run_emulated(a, b, scale_a, scale_b, bias):
    if bias is not None and bias.dtype != torch.bfloat16:
        bias = bias.to(torch.bfloat16)
    return fp8_torch.emulated_gemm(a, b, scale_a * scale_b, bias)


def scale_update(hist: torch.Tensor, pending: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                 factor: float, most_recent: bool, runtime: Runtime, launch_args: dict | None = None) -> None:
    """Delayed scaling's end of step, in place (``fp8_torch.scale_update``): one plugin
    kernel where the policy picks the plugin, else the torch ops. ``launch_args``: a dict
    the caller keeps with these tensors (and empties when it swaps them) where the plugin
    call keeps what it derives from them (``ops.fp8.scale_update``)."""
    if not torch.compiler.is_compiling():
        derived = runtime.resolver.derived  # emptied with the resolver's decisions
        key = ("scale_update", hist.device)  # the torch device: no probe on a repeated call
        module = derived.get(key, _MISSING)
        if module is _MISSING:
            device = probe_device(hist.device)
            module = _runner(runtime, ("scale_update", device.key), _scale_update_module, device, runtime)
            derived[key] = module
        if module is not None:
            try:
                return ops_fp8.scale_update(module, hist, pending, scale, scale_inv, factor, most_recent,
                                            launch_args)
            except RuntimeError:
                if not policy._plugin_broken(runtime, FP8_SCALE_UPDATE, probe_device(hist.device)):
                    raise
    fp8_torch.scale_update(hist, pending, scale, scale_inv, factor, most_recent)


def _scale_update_module(device: DeviceInfo, runtime: Runtime):
    if policy.choose_scale_update(device, runtime=runtime) != "plugin":
        return None
    return _usable_module(FP8_SCALE_UPDATE, device, runtime)


def _usable_module(op: str, device: DeviceInfo, runtime: Runtime):
    """The plugin module serving ``op``; None when loading it just failed (the registry
    marked the op unusable, with a warning): the torch path serves it then."""
    try:
        return ops_plugin.require(op, torch.device("cuda", device.index))
    except RuntimeError:
        if not policy._plugin_broken(runtime, op, device):
            raise
        return None
