"""A tiny random-weight Llama (or Mistral, with a sliding window) saved as a local folder
that vLLM and transformers both load: no tokenizer, no download."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def save_tiny(path: Path, *, sliding_window: int | None = None, seed: int = 0) -> Path:
    """A 2-layer model (hidden 128, 4 query / 2 KV heads of 64, GQA) in ``path``: Llama, or
    Mistral with ``sliding_window``. Float32 weights, scaled up so attention is sharp (near-ties
    of tiny random models would let a wrong attention pass a greedy comparison)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config = LlamaConfig(**common) if sliding_window is None else MistralConfig(sliding_window=sliding_window,
                                                                                  **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.save_pretrained(path)
    return path
