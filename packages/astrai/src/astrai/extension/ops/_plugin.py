"""How an ops wrapper reaches its compiled module: through the registry, or a clear error."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn

import torch

from ..device import DeviceInfo, probe_device
from ..install import PLUGIN_EXTRAS, pip_command, unpublished_note
from ..manifest import OpSpec
from ..op_names import (ATTN_DECODE, ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL, ATTN_PREFILL, FP8_GEMM, FP8_QUANTIZE,
                        FP8_SCALE_UPDATE, FP8_WEIGHT_GEMM, FUSED_ADD_RMS_NORM, RMS_NORM, ROPE_PAGED_APPEND, ROTARY_EMB,
                        SILU_AND_MUL)
from ..registry import OpStatus, Registry, failure
from ..runtime import current_runtime

# Which of the project's plugins provides each op (for the error message only:
# any plugin in the entry-point group may provide an op).
PLUGIN_OF_OP = {
    ATTN_DECODE: "astrai-attention",
    ATTN_PREFILL: "astrai-attention",
    ATTN_PAGED_DECODE: "astrai-attention",
    ATTN_PAGED_PREFILL: "astrai-attention",
    ROTARY_EMB: "astrai-elementwise",
    ROPE_PAGED_APPEND: "astrai-elementwise",
    RMS_NORM: "astrai-elementwise",
    FUSED_ADD_RMS_NORM: "astrai-elementwise",
    SILU_AND_MUL: "astrai-elementwise",
    FP8_QUANTIZE: "astrai-fp8",
    FP8_GEMM: "astrai-fp8",
    FP8_SCALE_UPDATE: "astrai-fp8",
    FP8_WEIGHT_GEMM: "astrai-fp8",
}


# CUDA errors that mean "this binary cannot run on this device or driver": no SASS/PTX for
# the arch (a manifest claiming an arch its binary lacks), PTX newer than the driver's JIT,
# a statically linked runtime newer than the driver. They are per-device and not sticky,
# so the op is marked unusable there and the policy layer falls back. Any other error
# (an illegal address, a bad argument) propagates unchanged. The plugins' RuntimeError
# carries the cudaError_t as ``cuda_error`` (cuda-common's bind.h); the decision reads it.
IMAGE_ERROR_CODES = frozenset({
    209,  # cudaErrorNoKernelImageForDevice
    98,  # cudaErrorInvalidDeviceFunction
    200,  # cudaErrorInvalidKernelImage
    222,  # cudaErrorUnsupportedPtxVersion
    35,  # cudaErrorInsufficientDriver
    36,  # cudaErrorCallRequiresNewerDriver
})
# The same errors by name, for a RuntimeError without a code (a binary built before the
# code was attached, or a third-party plugin): its message names the CUDA error.
IMAGE_ERRORS = (
    "cudaErrorNoKernelImageForDevice", "no kernel image is available",
    "cudaErrorInvalidDeviceFunction", "invalid device function",
    "cudaErrorInvalidKernelImage", "device kernel image is invalid",
    "cudaErrorUnsupportedPtxVersion", "cudaErrorInsufficientDriver",
    "cudaErrorCallRequiresNewerDriver",
)


def is_image_error(exc: BaseException) -> bool:
    """True for a ``RuntimeError`` saying the compiled code cannot run on this device: by its
    ``cuda_error`` code when the plugin attached one, else by the CUDA error it names."""
    if not isinstance(exc, RuntimeError):
        return False
    code = getattr(exc, "cuda_error", None)
    if isinstance(code, int):
        return code in IMAGE_ERROR_CODES
    return any(key in str(exc) for key in IMAGE_ERRORS)


class GuardedModule:
    """A compiled module as the ops wrappers call it: a call failing with an image error
    (``is_image_error``) marks ``op`` unusable on the device (one warning) and re-raises,
    so the caller's fallback re-resolves to another backend. A call raising what no op
    should (``SystemExit``, any ``BaseException`` but ``KeyboardInterrupt``) does the same,
    raised as a ``RuntimeError`` naming the op."""

    __slots__ = ("_module", "_op", "_device", "_registry", "_calls")

    def __init__(self, module: ModuleType, op: str, device: DeviceInfo, registry: Registry) -> None:
        self._module, self._op, self._device, self._registry = module, op, device, registry
        self._calls: dict[str, object] = {}

    def __getattr__(self, name: str):
        call = self._calls.get(name)
        if call is not None:
            return call
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except BaseException as exc:
                self.failed(name, exc)

        self._calls[name] = call
        return call

    def failed(self, name: str, exc: BaseException) -> NoReturn:
        """Raise what a guarded call of ``name`` raises when the module's call raised ``exc``
        (call it only while handling ``exc``): ``exc`` itself, after marking the op unusable
        for an image error; a ``RuntimeError`` naming the op for what no op should raise."""
        if isinstance(exc, RuntimeError):
            if is_image_error(exc):
                self._registry.mark_unusable(
                    self._op, self._device, f"{self._module.__name__}.{name} cannot run here: {exc}")
            raise exc
        if isinstance(exc, (Exception, KeyboardInterrupt)):
            raise exc  # argument errors are the caller's; an interrupt is the user's
        reason = f"{self._module.__name__}.{name} raised {failure(exc)}"  # a plugin must never end the process
        self._registry.mark_unusable(self._op, self._device, reason)
        raise RuntimeError(f"{self._op}: {reason}") from exc


def unguarded(module, name: str) -> tuple[Callable, Callable[[BaseException], NoReturn]]:
    """``module``'s entry point ``name`` without the guard's Python frame, and what the guard
    does with what it raises (``failed(exc)``: re-raise, after marking the op unusable where
    the guard would; a module that is no ``GuardedModule`` just re-raises), for a launcher
    that calls the entry point on every launch::

        try:
            entry(...)
        except BaseException as exc:
            failed(exc)
    """
    if isinstance(module, GuardedModule):
        return getattr(module._module, name), functools.partial(module.failed, name)
    return getattr(module, name), reraise


def reraise(exc: BaseException) -> NoReturn:
    """Raise ``exc`` (the failure handler of an unguarded module)."""
    raise exc


# One guard per (registry, op, device), made on first use: require() runs on every op call.
_GUARDS: weakref.WeakKeyDictionary[Registry, dict[tuple[str, DeviceInfo], GuardedModule]] = (
    weakref.WeakKeyDictionary())


def plugin_op(name: str, mutates_args: tuple[str, ...] = ()):
    """``torch.library.custom_op(name)`` around an op implementation, returning a callable
    that runs the implementation itself for plain tensors in eager mode: the dispatcher
    costs 15-50 us a call (more than a decode kernel runs). torch.compile, fake and meta
    tensors still go through the registered op (``.op``, where fakes are registered)."""

    def wrap(impl):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(impl)

        def call(x, *args):
            if type(x) is torch.Tensor and not torch.compiler.is_compiling():
                return impl(x, *args)
            return op(x, *args)

        call.op = op
        return call

    return wrap


def op_status(op: str, device: torch.device | str | None = None) -> OpStatus:
    """The current runtime's registry status of ``op`` on ``device`` (a new object once it changes)."""
    return current_runtime().registry.op_status(op, probe_device(device))


def op_spec(op: str, device: torch.device | str | None = None) -> OpSpec | None:
    """The manifest's statement of ``op`` (dtypes, head dims) from the plugin serving it on
    ``device``; None when no plugin can."""
    return op_status(op, device).spec


# (op, device, entry point) -> (the op's registry status when last asked, whether its module has
# the entry): a status is a new object whenever the registry's answer changes, so each answer is
# looked up once
_ENTRIES: dict[tuple[str, torch.device, str], tuple[OpStatus, bool]] = {}


def has_entry(op: str, device: torch.device, entry: str) -> bool:
    """Whether a plugin serves ``op`` on ``device`` and its module has the entry point ``entry``
    (one added after the op: a plugin built before it has not)."""
    status = op_status(op, device)
    known = _ENTRIES.get((op, device, entry))
    if known is None or known[0] is not status:
        has = status.usable and hasattr(require(op, device), entry)
        known = _ENTRIES[(op, device, entry)] = (status, has)
    return known[1]


def require(op: str, device: torch.device | str | None = None) -> GuardedModule:
    """The compiled module serving ``op`` on ``device`` (wrapped in ``GuardedModule``);
    ``RuntimeError`` naming the plugin, the reason and the install command when there is none."""
    info = probe_device(device)
    registry = current_runtime().registry
    status = registry.op_status(op, info)
    if status.usable:
        guards = _GUARDS.setdefault(registry, {})
        guard = guards.get((op, info))
        if guard is None:
            guard = guards[(op, info)] = GuardedModule(registry.load(op, info), op, info, registry)
        return guard
    plugin = PLUGIN_OF_OP.get(op, "a plugin providing it")
    hint = pip_command(PLUGIN_EXTRAS[plugin], info.driver_cuda) + unpublished_note() if plugin in PLUGIN_EXTRAS else ""
    raise RuntimeError(f"astrai.extension.ops.{op} needs the {plugin} plugin, which is not usable "
                       f"here ({status.reason}). Install it with: {hint}".rstrip())
