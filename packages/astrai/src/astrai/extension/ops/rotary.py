"""``rotary_emb``: the astrai-rotary plugin's fused kernel as a torch custom op.

``rotary_emb(x, cos, sin)`` rotates the interleaved pairs ``(x[..., 2i], x[..., 2i+1])``
of ``x [batch, seq, heads, head_dim]`` (bfloat16, CUDA, any strides) by ``cos`` / ``sin``
(float32 ``[seq, head_dim // 2]``) and returns a new contiguous bfloat16 tensor. It is
backed by the custom op ``torch.ops.astrai.rotary_emb`` (with a fake implementation, so
it traces under ``torch.compile`` and records into CUDA graphs); the public function
validates first, raising ``TypeError`` / ``ValueError`` that name the argument. The compiled module is reached
through ``_plugin.require`` (``RuntimeError`` naming the plugin and the install command
when it is missing); the fallback lives in ``backend/rotary.py``, not here.

Call convention (ABI 1): ``module.rotary_emb(x, cos, sin, out, stream)``, each tensor
a tuple ``(data_ptr, shape, strides_in_elements, dtype_code)``, the stream an int.
"""

from __future__ import annotations

import torch

from ..abi import launch, tensor_arg
from . import _plugin

__all__ = ["rotary_emb"]

OP = "rotary_emb"


def _check(x: object, cos: object, sin: object) -> None:
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rotary_emb: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"rotary_emb: x must be bfloat16, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"rotary_emb: x must be 4-D [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    head_dim = x.shape[3]
    if head_dim == 0 or head_dim % 2:
        raise ValueError(f"rotary_emb: x's head_dim must be even and positive, got {head_dim}")
    expected = (x.shape[1], head_dim // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise TypeError(f"rotary_emb: {name} must be float32, got {t.dtype}")
        if tuple(t.shape) != expected:
            raise ValueError(f"rotary_emb: {name} must have shape [seq, head_dim // 2] = "
                             f"[{expected[0]}, {expected[1]}], got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"rotary_emb: {name} is on {t.device} but x is on {x.device}")


def _word_aligned(t: torch.Tensor, pair_strides: bool) -> torch.Tensor:
    """``t`` itself when the kernel can read it in place (contiguous last dim, 4-byte
    aligned data, even strides for bf16 pairs), else a contiguous copy."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 4 == 0
    if ok and pair_strides:
        ok = all(s % 2 == 0 or n == 1 for s, n in zip(t.stride()[:-1], t.shape[:-1]))
    return t if ok else t.clone(memory_format=torch.contiguous_format)



def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Fused rotary embedding of ``x [B, L, H, D]`` (bf16, CUDA); returns a new contiguous
    ``[B, L, H, D]`` tensor. ``RuntimeError`` when the astrai-rotary plugin can't run here."""
    _check(x, cos, sin)
    if x.device.type != "cuda":
        raise ValueError(f"rotary_emb: x must be a CUDA tensor, got one on {x.device}")
    return _rotary_emb_op(x, cos, sin)


@_plugin.plugin_op("astrai::rotary_emb")
def _rotary_emb_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    module = _plugin.require(OP, x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = _word_aligned(x, pair_strides=True)
    cos = _word_aligned(cos, pair_strides=False)
    sin = _word_aligned(sin, pair_strides=False)
    args = (tensor_arg(x), tensor_arg(cos), tensor_arg(sin), tensor_arg(out))
    launch(x.device, module.rotary_emb, *args)
    return out


@_rotary_emb_op.op.register_fake
def _rotary_emb_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
