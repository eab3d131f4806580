"""Rotary embedding: the astrai-elementwise plugin's kernel as torch custom ops.

``rotary_emb(x, cos, sin, positions, interleaved, inverse)`` rotates ``x [batch, seq, heads,
head_dim]`` (float16/bfloat16/float32, CUDA, any strides) by rows of ``cos`` / ``sin``
(float32 ``[max_pos, rotary_dim // 2]``), selected by ``positions`` (int32/int64 ``[seq]`` or
``[batch, seq]``; None: rows ``0 .. seq-1``). ``interleaved=True`` pairs channels
``(2i, 2i + 1)`` (GPT-J), ``False`` pairs ``(i, i + rotary_dim / 2)`` (NeoX); channels past
``rotary_dim`` are copied; ``inverse=True`` rotates backwards (the gradient).
``rotary_qk`` does q and k in one launch, ``rotary_qk_`` in place. Each is a custom op
``torch.ops.astrai.*`` with a fake implementation, so it traces under ``torch.compile`` and
records into CUDA graphs. The public functions validate first (``TypeError`` /
``ValueError`` naming the argument); the ``*_unchecked`` ones are for callers that already did.

Call convention (ABI 1): ``module.rotary(q, k, cos, sin, positions, q_out, k_out,
interleaved, inverse, stream)``; each tensor a tuple ``(data_ptr, shape,
strides_in_elements, dtype_code)`` or None (k, positions, k_out), the stream an int.
"""

from __future__ import annotations

import torch

from ..abi import contiguous_strides, current_device, current_stream, dtype_code, empty_allocator, launch, tensor_arg
from ..op_names import ROTARY_EMB
from . import _plugin
from .rotary_args import check_freqs, check_positions, check_qk, check_x

__all__ = ["rotary_emb", "rotary_qk", "rotary_emb_launcher", "rotary_emb_unchecked", "rotary_qk_unchecked",
           "rotary_qk_inplace_unchecked"]


def _check_call(q: torch.Tensor, k: torch.Tensor | None, cos, sin, positions) -> None:
    if k is None:
        check_x("x", q)
    else:
        check_qk(q, k)
    if q.device.type != "cuda":
        raise ValueError(f"{'x' if k is None else 'q'} must be a CUDA tensor, got one on {q.device}")
    cos, sin = check_freqs((cos, sin), q, q.shape[1], positions, "x" if k is None else "q")
    if positions is not None:
        check_positions(positions, q.shape[0], q.shape[1], cos.shape[0], q.device)


def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
               interleaved: bool = True, inverse: bool = False) -> torch.Tensor:
    """Rotated copy of ``x [B, L, H, D]`` (CUDA); ``RuntimeError`` when the plugin can't run here."""
    _check_call(x, None, cos, sin, positions)
    return rotary_emb_unchecked(x, cos, sin, positions, interleaved, inverse)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor | None = None, interleaved: bool = True,
              inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, L, Hq, D]`` and k ``[B, L, Hk, D]`` rotated in one launch: new tensors, or q and k
    themselves (rewritten) with ``inplace=True``."""
    _check_call(q, k, cos, sin, positions)
    if inplace:
        rotary_qk_inplace_unchecked(q, k, cos, sin, positions, interleaved)
        return q, k
    return rotary_qk_unchecked(q, k, cos, sin, positions, interleaved, False)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` when its last dim is contiguous (what the kernel reads), else a copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _launch(q, k, cos, sin, positions, q_out, k_out, interleaved: bool, inverse: bool) -> None:
    module = _plugin.require(ROTARY_EMB, q.device)
    launch(q.device, module.rotary, tensor_arg(q), tensor_arg(k), tensor_arg(_rows(cos)), tensor_arg(_rows(sin)),
           tensor_arg(positions), tensor_arg(q_out), tensor_arg(k_out), interleaved, inverse)


def rotary_emb_launcher(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                        interleaved: bool, inverse: bool):
    """``rotary_emb_unchecked`` reduced to its launch, for a caller's plan: ``run(x, cos, sin,
    positions)`` for tensors of the same shapes, strides, dtypes and device as these (plain
    tensors with a contiguous last dim, eager mode); only the data pointers are read per call
    and the module is looked up on the first call."""
    device = x.device
    index = device.index
    x_shape, x_strides, x_code, dtype = tuple(x.shape), tuple(x.stride()), dtype_code(x), x.dtype
    c_shape, c_strides, c_code = tuple(cos.shape), tuple(cos.stride()), dtype_code(cos)
    s_shape, s_strides, s_code = tuple(sin.shape), tuple(sin.stride()), dtype_code(sin)
    p_meta = None if positions is None else (tuple(positions.shape), tuple(positions.stride()), dtype_code(positions))
    out_strides = contiguous_strides(x_shape)
    empty = empty_allocator(device)
    entry = failed = None

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        nonlocal entry, failed
        if entry is None:
            entry, failed = _plugin.unguarded(_plugin.require(ROTARY_EMB, device), "rotary")
        current = current_device()
        if current != index and index is not None:  # another device is current: the op switches to x's
            return rotary_emb_unchecked(x, cos, sin, positions, interleaved, inverse)
        out = empty(x_shape, out_strides, dtype)
        try:
            entry((x.data_ptr(), x_shape, x_strides, x_code), None, (cos.data_ptr(), c_shape, c_strides, c_code),
                  (sin.data_ptr(), s_shape, s_strides, s_code),
                  None if positions is None else (positions.data_ptr(), *p_meta),
                  (out.data_ptr(), x_shape, out_strides, x_code), None, interleaved, inverse, current_stream(current))
        except BaseException as exc:
            failed(exc)
        return out

    return run


@_plugin.plugin_op(f"astrai::{ROTARY_EMB}")
def rotary_emb_unchecked(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                         interleaved: bool, inverse: bool) -> torch.Tensor:
    x = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, cos, sin, positions, out, None, interleaved, inverse)
    return out


@rotary_emb_unchecked.op.register_fake
def _rotary_emb_fake(x, cos, sin, positions, interleaved, inverse):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@_plugin.plugin_op("astrai::rotary_qk")
def rotary_qk_unchecked(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor | None, interleaved: bool,
                        inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _rows(q), _rows(k)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, cos, sin, positions, q_out, k_out, interleaved, inverse)
    return q_out, k_out


@rotary_qk_unchecked.op.register_fake
def _rotary_qk_fake(q, k, cos, sin, positions, interleaved, inverse):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


@_plugin.plugin_op("astrai::rotary_qk_", mutates_args=("q", "k"))
def rotary_qk_inplace_unchecked(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                positions: torch.Tensor | None, interleaved: bool) -> None:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary in place needs q and k with a contiguous last dim")
    _launch(q, k, cos, sin, positions, q, k, interleaved, False)


@rotary_qk_inplace_unchecked.op.register_fake
def _rotary_qk_inplace_fake(q, k, cos, sin, positions, interleaved):
    return None
