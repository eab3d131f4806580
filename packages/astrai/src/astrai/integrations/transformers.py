"""AstrAI attention inside transformers models: ``attn_implementation="astrai"``.

    >>> from astrai.integrations.transformers import register
    >>> name = register()                                   # "astrai"; idempotent
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    >>> model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

:func:`register` adds :func:`astrai_attention` to transformers' ``AttentionInterface`` and
:func:`astrai_mask` to ``AttentionMaskInterface`` under the same name, so padding and causal
masks reach :func:`astrai.extension.attention` as its ``mask`` / ``is_causal`` arguments, and
the model's attention variant as its keyword arguments (``scaling`` -> ``scale``, ``softcap``
-> ``logits_soft_cap``, ``s_aux`` -> ``sinks``, ``sliding_window`` -> ``window_left``).
Tested with transformers 5.17 (the version pinned in ci/requirements-dev.txt).
"""

from __future__ import annotations

import math

import torch

from ..extension import attention

__all__ = ["NAME", "astrai_attention", "astrai_mask", "register"]

NAME = "astrai"

# Keyword arguments transformers passes that never change attention's output (outputs to
# collect, the cache flag, positions already applied by the rotary embedding). Any other
# one that is not None raises: ignoring it could give a silently different result.
HARMLESS_KWARGS = frozenset({
    "position_ids", "use_cache", "output_attentions", "output_hidden_states", "output_router_logits",
    "num_items_in_batch",
})


def _keep_mask(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """transformers' 4-D mask ``[B or 1, 1, q, kv]`` (bool keep, or additive float) as bool ``[B, q, kv]``."""
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}: expected [batch, 1, q_len, kv_len] "
            "(one mask for all heads)"
        )
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return keep[:, 0, :, -kv_len:].expand(batch, q_len, kv_len)


def _window_left(sliding_window: int | None) -> int:
    """transformers keeps key ``j`` for query ``i`` iff ``i - j < sliding_window``: ``W - 1`` keys left of ``i``."""
    if sliding_window is None:
        return -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r}: expected None or a positive int")
    return sliding_window - 1


def _check_kwargs(kwargs: dict) -> None:
    unknown = sorted(name for name, value in kwargs.items() if value is not None and name not in HARMLESS_KWARGS)
    if unknown:
        raise ValueError(
            f"attn_implementation='astrai' does not support the attention argument(s) {', '.join(unknown)}: "
            "they would change the result"
        )


def astrai_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over :func:`astrai.extension.attention`.

    ``query [B, Hq, Lq, D]``, ``key`` / ``value [B, Hkv, Lkv, D]`` (grouped heads stay grouped:
    AstrAI's attention takes ``Hq = group * Hkv`` directly); returns ``([B, Lq, Hq, D], None)``.
    ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss sinks, ``[Hq]``) are applied as eager applies
    them; ``None`` or ``0`` turns them off.
    """
    if dropout:
        raise ValueError(f"dropout={dropout}: attn_implementation='astrai' has no attention dropout (use 0.0)")
    _check_kwargs(kwargs)
    window = _window_left(sliding_window)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    batch, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = None
    if attention_mask is not None:
        mask = _keep_mask(attention_mask, batch, q_len, kv_len)
        causal = False  # the mask carries the causal pattern
        if kv_len != q_len:
            # The mask carries the window too, and a static cache's keys need not end at the
            # last query, where a bottom-right aligned window would cut off visible keys.
            window = -1
    else:
        if causal and q_len > 1 and kv_len > q_len:
            # as transformers' sdpa: a mask-free causal call with more keys than queries is a
            # prefill into a static cache whose later slots are empty; top-left causal over the first q_len keys
            k, v = k[:, :q_len], v[:, :q_len]
        if not causal:
            window = -1  # mask-free and bidirectional only where the window covers every key
    if window >= k.shape[1] - 1:
        window = -1  # covers every key; left unset, backends without windows stay eligible
    if scaling is not None and math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        scaling = None  # likewise
    out = attention(
        q, k, v, mask=mask, is_causal=bool(causal and q_len > 1),
        window_left=window,
        logits_soft_cap=float(softcap) if softcap else None,
        sinks=None if s_aux is None else s_aux.to(torch.float32),
        scale=None if scaling is None else float(scaling),
    )
    return out, None


def _no_padding(attention_mask: torch.Tensor | None, kv_offset: int, kv_len: int) -> bool:
    if attention_mask is None:
        return True
    if attention_mask.shape[-1] < kv_offset + kv_len:
        return False  # transformers pads the missing columns as masked (empty static-cache slots)
    return bool(attention_mask[:, kv_offset : kv_offset + kv_len].all())


def astrai_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    config=None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' ``sdpa_mask`` (bool ``[B, 1, q, kv]``, True = keep, or None for a plain causal
    call), and also None for a sliding-window layer whose mask would be causal + window only:
    :func:`astrai_attention` then passes ``window_left`` and ``is_causal`` to the kernels, which
    skip the tiles left of the window instead of reading a dense mask.

    That holds when transformers allows the causal skip, ``local_size`` is the config's
    ``sliding_window`` (chunked attention passes its chunk size there), nothing is padded, the
    keys end at the last query (so bottom-right alignment places every query) and, as for
    sdpa's own skip, the call is a decode step or has as many keys as queries.
    """
    from transformers.masking_utils import sdpa_mask
    from transformers.utils.import_utils import is_tracing

    if (
        allow_is_causal_skip
        and local_size is not None
        and local_size == getattr(config, "sliding_window", None)
        and getattr(config, "attention_chunk_size", None) is None
        and isinstance(q_offset, int) and isinstance(kv_offset, int)
        and (q_length == 1 or q_length == kv_length)
        and kv_offset + kv_length == q_offset + q_length
        and not is_tracing(attention_mask)
        and _no_padding(attention_mask, kv_offset, kv_length)
    ):
        return None
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        attention_mask=attention_mask, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
        config=config, **kwargs,
    )


def register() -> str:
    """Make ``attn_implementation="astrai"`` available to transformers models; returns ``"astrai"``.

    Idempotent. Raises ``ImportError`` with the install command when transformers is missing.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError("astrai.integrations.transformers needs transformers: pip install 'astrai[transformers]'") from exc
    AttentionInterface.register(NAME, astrai_attention)
    AttentionMaskInterface.register(NAME, astrai_mask)
    return NAME
