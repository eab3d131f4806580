"""The FP8 state of one linear weight, kept on the weight tensor itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backend.fp8_torch import capturing
from .recipes import Recipe
from .scaling import TensorScaling, _end_steps, _RoleGroup
from .weights import _WeightCache


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
