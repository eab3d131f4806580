"""Independent rotary references in float64: transformers' own ``apply_rotary_pos_emb`` for
the NeoX layout, the complex multiply for the interleaved one; positions gathered here."""

from __future__ import annotations

import torch
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_partial
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_full


def rope_tables(max_pos: int, rotary_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[max_pos, rotary_dim // 2]`` cos/sin of the standard RoPE angles."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def gather(table: torch.Tensor, positions: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor:
    """float64 ``[batch, seq, half]``: the row of each token."""
    table = table.detach().double().cpu()
    if positions is None:
        return table[:seq].expand(batch, seq, -1)
    rows = table[positions.cpu().long()]
    return rows.expand(batch, seq, -1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                   interleaved: bool = True) -> torch.Tensor:
    """Rotary of ``x [B, L, H, D]`` in float64 (differentiable in ``x`` when it is float64)."""
    x = x if x.dtype == torch.float64 else x.detach().double().cpu()
    b, l = x.shape[:2]
    c, s = gather(cos, positions, b, l), gather(sin, positions, b, l)
    rotary_dim = 2 * c.shape[-1]
    if not interleaved:  # transformers: cos/sin [B, L, rotary_dim] as its rotary embedding builds them
        c2, s2 = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        fn = llama_full if rotary_dim == x.shape[-1] else neox_partial
        return fn(x, x, c2, s2, unsqueeze_dim=2)[0]
    rot = torch.view_as_complex(x[..., :rotary_dim].reshape(*x.shape[:-1], -1, 2).contiguous())
    turned = torch.view_as_real(rot * torch.complex(c, s)[:, :, None, :]).flatten(-2)
    return torch.cat((turned, x[..., rotary_dim:]), dim=-1)


def random_positions(gen: torch.Generator, kind: str, batch: int, seq: int, max_pos: int) -> torch.Tensor | None:
    """``kind``: "none", "1d" (int64 ``[seq]``) or "2d" (int32 ``[batch, seq]``, ragged rows)."""
    if kind == "none":
        return None
    if kind == "1d":
        return torch.randint(0, max_pos, (seq,), generator=gen)
    return torch.randint(0, max_pos, (batch, seq), generator=gen, dtype=torch.int32)
