"""Execution policy: which implementation runs each call, the torch fallbacks, KV cache I/O.

- :mod:`.attention` — ``attention(...)``, ``attn_backend``, ``ATTN_BACKEND`` and the
  attention backends (CUDA plugin, flash-attn, torch SDPA);
- :mod:`.rotary` — ``apply_rotary_emb`` / ``apply_rotary_emb_qk``: the plugin kernel (forward and backward), the torch path otherwise;
- :mod:`.norm` — ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``: the plugin kernels, the torch path otherwise;
- :mod:`.fp8` — FP8 quantize / GEMM policy.

Policy code calls down into :mod:`astrai.extension.ops` and the resolver; nothing below
imports from here.
"""
