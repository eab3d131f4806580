"""Rotary position embedding: the fused plugin kernel in inference, complex multiply otherwise.

``apply_rotary_emb(x, (cos, sin))`` rotates the interleaved pairs
``(x[..., 2i], x[..., 2i + 1])`` of ``x [batch, seq, heads, head_dim]`` by the angle whose
cosine and sine are ``cos[s, i]`` / ``sin[s, i]`` (float32 ``[seq, head_dim // 2]``)::

    out[..., 2i]     = x[..., 2i] * cos - x[..., 2i + 1] * sin
    out[..., 2i + 1] = x[..., 2i] * sin + x[..., 2i + 1] * cos

Per call, the ``rotary_emb`` kernel of the astrai-rotary plugin runs when ``x`` is bf16
on CUDA, no gradient is needed (``not torch.is_grad_enabled() or not x.requires_grad``)
and the registry reports the op usable on that device; otherwise the torch path
(``torch.view_as_complex`` multiply, computed in float32 or wider, autograd-capable)
runs. The choice goes through the runtime's resolver (op ``"rotary_emb"``), so
``current_runtime().explain("rotary_emb")`` shows why.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..compiling import assume_constant_result
from ..device import DeviceInfo, probe_device
from ..ops import rotary as ops_rotary
from ..runtime import Runtime, current_runtime

__all__ = ["RotaryCall", "apply_rotary_emb", "rotary_torch"]

OP = "rotary_emb"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class RotaryCall(NamedTuple):
    """The facts the rotary dispatch decides on (and its resolver key)."""

    device: DeviceInfo
    dtype: torch.dtype
    head_dim: int
    needs_grad: bool


class _Kernel:
    """The astrai-rotary ``rotary_emb`` kernel."""

    name = "cuda"

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def check(self, call: RotaryCall) -> str | None:
        if call.device.type != "cuda":
            return f"the rotary kernel runs on CUDA tensors ({call.device.describe()})"
        if call.dtype != torch.bfloat16:
            return f"the rotary kernel takes bfloat16, got {call.dtype}"
        if call.needs_grad:
            return "x requires grad: the kernel has no backward (the torch path is autograd-capable)"
        status = self.runtime.registry.op_status(OP, call.device)
        if not status.usable:
            return status.reason
        if "bfloat16" not in status.spec.dtypes:
            return f"{status.reason} lists dtypes {list(status.spec.dtypes)}, not bfloat16"
        if status.spec.head_dims is not None and call.head_dim not in status.spec.head_dims:
            return f"{status.reason} has head dims {list(status.spec.head_dims)}, not {call.head_dim}"
        return None


class _Torch:
    name = "torch"

    def check(self, call: RotaryCall) -> str | None:
        return None


def check_rotary_args(x: object, freqs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``apply_rotary_emb``'s arguments; return ``(cos, sin)``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"x has an empty dimension: shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.shape[3] % 2:
        raise ValueError(f"x has odd head_dim {x.shape[3]}: rotary rotates pairs of channels")
    if not isinstance(freqs, (tuple, list)) or len(freqs) != 2:
        raise TypeError(f"freqs must be a (cos, sin) pair of tensors, got {type(freqs).__name__}")
    expected = (x.shape[1], x.shape[3] // 2)
    for name, t in zip(("cos", "sin"), freqs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}: expected [seq, head_dim // 2] = [{expected[0]}, {expected[1]}]"
            )
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return freqs[0], freqs[1]


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch path: complex multiply in float32 (float64 for float64 ``x``); autograd-capable."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    # view_as_complex needs aligned pairs; under torch.compile the copy is free to elide
    if torch.compiler.is_compiling() or xc.storage_offset() % 2 or not xc.is_contiguous():
        xc = xc.clone(memory_format=torch.contiguous_format)
    pairs = xc.view(*x.shape[:-1], x.shape[-1] // 2, 2)
    rot = torch.complex(cos.to(compute), sin.to(compute))[None, :, None, :]
    return torch.view_as_real(torch.view_as_complex(pairs) * rot).flatten(-2).to(x.dtype)


def _choose(x: torch.Tensor, runtime: Runtime) -> tuple[str, DeviceInfo]:
    device = probe_device(x.device)
    call = RotaryCall(device, x.dtype, x.shape[3], torch.is_grad_enabled() and x.requires_grad)
    winner = runtime.resolver.resolve(OP, (_Kernel(runtime), _Torch()), call, call)
    return winner.name, device


@assume_constant_result
def _choose_while_compiling(device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool) -> str:
    """The same decision, made once at trace time: dynamo cannot trace the runtime's
    context variables or the resolver's lock, and the choice is fixed per graph anyway."""
    runtime = current_runtime()
    call = RotaryCall(probe_device(torch.device(device)), dtype, head_dim, needs_grad)
    return runtime.resolver.resolve(OP, (_Kernel(runtime), _Torch()), call, call).name


def apply_rotary_emb(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate the interleaved channel pairs of ``x [batch, seq, heads, head_dim]``.

    ``freqs = (cos, sin)``, each float32 ``[seq, head_dim // 2]`` on ``x``'s device.
    Returns a new tensor of ``x``'s shape and dtype. Bad arguments raise ``TypeError`` /
    ``ValueError`` naming the argument.
    """
    cos, sin = check_rotary_args(x, freqs)
    if torch.compiler.is_compiling():
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        if _choose_while_compiling(str(x.device), x.dtype, x.shape[3], needs_grad) == "cuda":
            return ops_rotary.rotary_emb(x, cos, sin)
        return rotary_torch(x, cos, sin)
    runtime = current_runtime()
    chosen, device = _choose(x, runtime)
    if chosen == "cuda":
        try:
            return ops_rotary.rotary_emb(x, cos, sin)
        except RuntimeError:
            # The registry marks the op unusable when its module fails to import: forget
            # the cached decisions and take the torch path; any other error propagates.
            if runtime.registry.op_status(OP, device).usable:
                raise
            runtime.resolver.clear()
    return rotary_torch(x, cos, sin)
