"""AstrAI attention inside transformers models: ``attn_implementation="astrai"``.

    >>> from astrai.integrations.transformers import register
    >>> name = register()                                   # "astrai"; idempotent
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    >>> model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

:func:`register` adds :func:`astrai_attention` to transformers' ``AttentionInterface`` and
its mask builder (transformers' ``sdpa_mask``: boolean, True = keep, or None when a causal
flag says it all) to ``AttentionMaskInterface`` under the same name, so padding and causal
masks reach :func:`astrai.extension.attention` as its ``mask`` / ``is_causal`` arguments.
Tested with transformers 5.17 (the version pinned in ci/requirements-dev.txt).
"""

from __future__ import annotations

import math

import torch

from ..extension import attention

__all__ = ["NAME", "astrai_attention", "register"]

NAME = "astrai"


def _keep_mask(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """transformers' 4-D mask ``[B or 1, 1, q, kv]`` (bool keep, or additive float) as bool ``[B, q, kv]``."""
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}: expected [batch, 1, q_len, kv_len] "
            "(one mask for all heads)"
        )
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return keep[:, 0, :, -kv_len:].expand(batch, q_len, kv_len)


def astrai_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over :func:`astrai.extension.attention`.

    ``query [B, Hq, Lq, D]``, ``key`` / ``value [B, Hkv, Lkv, D]`` (grouped heads stay grouped:
    AstrAI's attention takes ``Hq = group * Hkv`` directly); returns ``([B, Lq, Hq, D], None)``.
    """
    if dropout:
        raise ValueError(f"dropout={dropout}: attn_implementation='astrai' has no attention dropout (use 0.0)")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    batch, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        q = q * (scaling * math.sqrt(head_dim))  # attention() scales by 1/sqrt(head_dim)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = None
    if attention_mask is not None:
        mask = _keep_mask(attention_mask, batch, q_len, kv_len)
        causal = False  # the mask carries the causal pattern
    elif causal and q_len > 1 and kv_len > q_len:
        # as transformers' sdpa: a mask-free causal call with more keys than queries is a
        # prefill into a static cache whose later slots are empty; top-left causal over the first q_len keys
        k, v = k[:, :q_len], v[:, :q_len]
    out = attention(q, k, v, mask=mask, is_causal=bool(causal and q_len > 1))
    return out, None


def register() -> str:
    """Make ``attn_implementation="astrai"`` available to transformers models; returns ``"astrai"``.

    Idempotent. Raises ``ImportError`` with the install command when transformers is missing.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError("astrai.integrations.transformers needs transformers: pip install 'astrai[transformers]'") from exc
    AttentionInterface.register(NAME, astrai_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
