"""attn_implementation="astrai" inside transformers models, against transformers' own sdpa (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from astrai.integrations import transformers as integration  # noqa: E402

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, pad_token_id=0, bos_token_id=None, eos_token_id=None),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, sliding_window=None, pad_token_id=0, bos_token_id=None, eos_token_id=None),
}


def _pair(kind: str, seed: int):
    """The same random weights as an 'astrai' model and an 'sdpa' model."""
    name = integration.register()
    torch.manual_seed(seed)
    ours = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation=name, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="sdpa", dtype=torch.float32)
    ref.load_state_dict(ours.state_dict())
    return ours.eval(), ref.eval()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls reaching astrai.extension.attention through the integration."""
    seen = []
    real = integration.attention

    def counting(*args, **kwargs):
        seen.append(kwargs.get("mask") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(integration, "attention", counting)
    return seen


def test_register_is_idempotent_and_named():
    assert integration.register() == "astrai"
    assert integration.register() == "astrai"
    assert transformers.AttentionInterface._global_mapping["astrai"] is integration.astrai_attention


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_sdpa_without_padding(kind, calls):
    ours, ref = _pair(kind, seed=1)
    ids = torch.randint(1, 300, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = ours(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls and not any(calls)  # a causal flag, no mask


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_sdpa_with_padding(kind, calls):
    ours, ref = _pair(kind, seed=3)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 300, (3, 13), generator=gen)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as generate() pads
    mask[2, :9] = 0
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    assert calls and all(calls)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_generate_tokens_match_sdpa(kind, calls):
    ours, ref = _pair(kind, seed=5)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 300, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, :6] = 0
    args = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got, want = ours.generate(ids, **args), ref.generate(ids, **args)
    assert torch.equal(got, want)
    assert len(calls) >= 2 * 12  # prefill and every decode step, in each of the 2 layers


def test_non_default_scaling_is_honoured():
    integration.register()
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 5, 16, generator=gen) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = integration.astrai_attention(module, q, k, v, None, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dropout_is_refused():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="dropout"):
        integration.astrai_attention(torch.nn.Module(), q, q, q, None, dropout=0.1)


def test_per_head_mask_is_refused():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="attention_mask"):
        integration.astrai_attention(torch.nn.Module(), q, q, q, torch.ones(1, 2, 3, 3, dtype=torch.bool))
