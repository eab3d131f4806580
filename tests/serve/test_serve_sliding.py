"""astrai.serve past a sliding window (Mistral, Qwen2 with use_sliding_window): prompts and
generations longer than the window, every sliding layer's attention through window_left, the
greedy tokens and logits equal to transformers' on the same weights (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from astrai.serve import LLM, ModelConfig

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=512)
WINDOW = 8
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=WINDOW, **COMMON),
    # layers 1 and 2 slide, layer 0 attends to everything
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=1, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1, **COMMON),
}


def _hf(kind: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():  # scores large enough that the window changes the tokens
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval()


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_config_reads_which_layers_slide():
    assert ModelConfig.from_hf(CONFIGS["mistral"]()).window_left(2) == WINDOW - 1
    qwen = ModelConfig.from_hf(CONFIGS["qwen2"]())
    assert [qwen.window_left(i) for i in range(3)] == [-1, WINDOW - 1, WINDOW - 1]


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_generation_past_the_window_equals_transformers(kind):
    hf = _hf(kind, seed=21)
    prompts = _prompts(22, [3, 13, 30], hf.config.vocab_size)
    llm = LLM.from_transformers(hf, max_batch_size=2, max_batch_tokens=16)
    tokens, logits = llm.generate(prompts, max_new_tokens=12, return_logits=True)
    for prompt, new, got in zip(prompts, tokens, logits):
        with torch.no_grad():
            full = hf(torch.tensor([prompt + new])).logits[0]
        torch.testing.assert_close(got, full[len(prompt) - 1: len(prompt) - 1 + len(new)], rtol=1e-4, atol=1e-4)
        assert new == full[len(prompt) - 1: len(prompt) - 1 + len(new)].argmax(-1).tolist()


def test_the_window_changes_the_result():
    """Without window_left the engine's logits differ from transformers' (the test above can fail)."""
    hf = _hf("mistral", seed=23)
    prompt = _prompts(24, [30], hf.config.vocab_size)[0]
    llm = LLM.from_transformers(hf)
    for layer in llm.model.layers:
        layer.window_left = -1
    _, logits = llm.generate([prompt], max_new_tokens=2, return_logits=True)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0][0] - want).abs().max() > 1e-2
