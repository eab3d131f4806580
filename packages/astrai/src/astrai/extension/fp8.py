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
import threading
from dataclasses import dataclass

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ._fp8.linear import _fp8_capable, _fp8_linear
from ._fp8.recipes import DelayedScaling, DynamicScaling, Format, Recipe
from ._fp8.scaling import TensorScaling, _end_steps
from ._fp8.state import Fp8LinearState, fp8_state

__all__ = ["Format", "DelayedScaling", "DynamicScaling", "fp8_autocast", "fp8_state",
           "Fp8LinearState", "TensorScaling", "is_fp8_autocast_enabled"]


@dataclass
class _Region:
    enabled: bool
    recipe: Recipe
    touched: dict[int, Fp8LinearState]  # shared by a thread's nested regions
    cache_weights: bool | None = None
    mode: _LinearMode | None = None  # the one an outermost region pushed

    def touch(self, state: Fp8LinearState) -> None:
        self.touched.setdefault(id(state), state)


_local = threading.local()
_DEFAULT_RECIPE = DelayedScaling()


def _stack() -> list[_Region]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class _LinearMode(TorchFunctionMode):
    """Routes ``F.linear`` to the FP8 linear while the innermost region is enabled."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            stack = getattr(_local, "stack", None)
            if stack and stack[-1].enabled:
                if kwargs or len(args) != 3:
                    x, weight, bias = _linear_args(*args, **(kwargs or {}))
                else:
                    x, weight, bias = args
                if _fp8_capable(x, weight, bias):
                    return _fp8_linear(x, weight, bias, stack[-1])
        return func(*args, **(kwargs or {}))


def _linear_args(input, weight, bias=None):  # noqa: A002 - F.linear's own parameter names
    return input, weight, bias


def is_fp8_autocast_enabled() -> bool:
    """True inside an enabled (innermost) ``fp8_autocast`` region of this thread."""
    stack = _stack()
    return bool(stack) and stack[-1].enabled


def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None, *,
                 cache_weights: bool | None = None) -> _Autocast:
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
        recipe = _DEFAULT_RECIPE  # frozen: one object serves every region (an identity check per linear)
    elif not isinstance(recipe, (DelayedScaling, DynamicScaling)):
        raise TypeError(f"recipe must be a DelayedScaling or DynamicScaling, got {type(recipe).__name__}")
    return _Autocast(enabled, recipe, cache_weights)


class _Autocast(contextlib.ContextDecorator):
    """One ``fp8_autocast`` region: a plain context manager (no generator), as its enter
    and exit are on the path of every step. What an entry made lives on the thread's
    region stack, not here, so one object may be entered on several threads or nested.
    The outermost region of a thread routes ``F.linear`` (``_LinearMode``) and ends the
    forward step of every linear it ran."""

    __slots__ = ("enabled", "recipe", "cache_weights")

    def __init__(self, enabled: bool, recipe: Recipe, cache_weights: bool | None):
        self.enabled, self.recipe, self.cache_weights = enabled, recipe, cache_weights

    def __enter__(self) -> None:
        stack = _stack()
        if stack:
            stack.append(_Region(self.enabled, self.recipe, stack[0].touched, self.cache_weights))
            return
        region = _Region(self.enabled, self.recipe, {}, self.cache_weights, _LinearMode())
        stack.append(region)
        try:
            region.mode.__enter__()
        except BaseException:
            stack.pop()
            raise

    def __exit__(self, *exc) -> None:
        stack = _stack()
        mode = stack[-1].mode
        try:
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            region = stack.pop()
            if mode is not None:
                _end_steps([(state.forward_roles, state.recipe) for state in region.touched.values()])
