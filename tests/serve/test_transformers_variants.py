"""attn_implementation="astrai" for attention variants (soft-cap, sinks, sliding windows, scale),
against transformers' eager attention (CPU, float32, tiny random models)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from astrai.integrations import transformers as integration  # noqa: E402

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None)
WINDOW = 8  # shorter than every sequence below
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]

CONFIGS = {
    "gemma2-cap5": lambda **o: transformers.Gemma2Config(**{
        **COMMON, "head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
        "sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL, **o}),
    "gemma2-cap50": lambda **o: transformers.Gemma2Config(**{
        **COMMON, "head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 50.0,
        "sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL, **o}),
    "gemma3": lambda **o: transformers.Gemma3TextConfig(**{
        **COMMON, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
        "layer_types": SLIDING_THEN_FULL, **o}),
    "mistral": lambda **o: transformers.MistralConfig(**{**COMMON, "sliding_window": WINDOW, **o}),
    "qwen2": lambda **o: transformers.Qwen2Config(**{  # layers >= max_window_layers slide
        **COMMON, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1, **o}),
    "gpt_oss": lambda **o: transformers.GptOssConfig(**{
        **COMMON, "intermediate_size": 32, "head_dim": 16, "sliding_window": WINDOW, "num_local_experts": 2,
        "num_experts_per_tok": 1, "layer_types": SLIDING_THEN_FULL, **o}),
}


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Scores of several units (so a soft-cap of 5 bends them) and sizeable sinks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(12.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # Gemma 3 normalises q and k
                param.fill_(2.0)
            elif name.endswith(".sinks"):
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0)


def _model(kind: str, impl: str, **overrides) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](**overrides), attn_implementation=impl,
                                                         dtype=torch.float32).eval()


_MODELS: dict[str, tuple] = {}


def _pair(kind: str):
    """The same random weights as an 'astrai' model and an 'eager' model (built once per kind)."""
    if kind not in _MODELS:
        torch.manual_seed(sum(map(ord, kind)))
        ours = _model(kind, integration.register())
        _sharpen(ours, seed=len(kind))
        ref = _model(kind, "eager")
        ref.load_state_dict(ours.state_dict())
        _MODELS[kind] = ours, ref
    return _MODELS[kind]


@pytest.fixture
def calls(monkeypatch):
    """What reached astrai.extension.attention: (mask given, window_left, q_len, kv_len) per call."""
    seen = []
    real = integration.attention

    def recording(q, k, v, **kwargs):
        seen.append((kwargs.get("mask") is not None, kwargs.get("window_left", -1), q.shape[1], k.shape[1]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(integration, "attention", recording)
    return seen


def _padded(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):  # left padding, as generate() pads
        mask[row, : 3 + 4 * row] = 0
    return ids, mask


@pytest.mark.parametrize("kind, off", [
    ("gemma2-cap5", {"attn_logit_softcapping": None}),
    ("mistral", {"sliding_window": None}),
    ("gemma3", {"layer_types": ["full_attention"] * 2}),
])
def test_each_variant_changes_the_logits(kind, off):
    """The models are sharp enough, and the sequences long enough, for the variant to matter."""
    ours, ref = _pair(kind)
    plain = _model(kind, "eager", **off)
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(1, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ref(ids).logits - plain(ids).logits).abs().max() > 0.05


def test_sinks_change_the_logits():
    _, ref = _pair("gpt_oss")
    ids = torch.randint(1, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        sinks = [layer.self_attn.sinks for layer in ref.model.layers]
        saved = [s.clone() for s in sinks]
        for s in sinks:
            s.fill_(-1e9)  # no sink
        plain = ref(ids).logits
        for s, old in zip(sinks, saved):
            s.copy_(old)
    assert (want - plain).abs().max() > 0.05


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_eager_without_padding(kind, calls):
    ours, ref = _pair(kind)
    ids = torch.randint(1, VOCAB, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = ours(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls and not any(masked for masked, *_ in calls)  # sliding layers too: no dense mask
    assert (WINDOW - 1) in {window for _, window, *_ in calls}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_eager_with_padding(kind, calls):
    ours, ref = _pair(kind)
    ids, mask = _padded(3, 19, seed=3)
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    assert calls and all(masked for masked, *_ in calls)
    assert (WINDOW - 1) in {window for _, window, *_ in calls}  # the window and the mask both apply


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_generate_tokens_match_eager(kind):
    ours, ref = _pair(kind)
    ids, mask = _padded(2, 12, seed=4)
    args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **args), ref.generate(ids, **args))


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_generate_with_static_cache_matches_eager(kind):
    """A static cache's keys need not end at the last query: the window then comes from the mask."""
    ours, ref = _pair(kind)
    ids, mask = _padded(2, 11, seed=5)
    args = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(ours.generate(ids, **args), ref.generate(ids, **args))


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_decode_over_a_full_length_cache_uses_the_window(kind, calls):
    """A cache without sliding layers keeps every key: decode steps then rely on window_left."""
    ours, ref = _pair(kind)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    got = ours.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                        past_key_values=transformers.DynamicCache())
    want = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                        past_key_values=transformers.DynamicCache())
    assert torch.equal(got, want)
    assert (False, WINDOW - 1, 1, 17) in calls


def test_an_unknown_argument_that_changes_the_result_is_refused():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="position_bias"):
        integration.astrai_attention(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        integration.astrai_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="sliding_window"):
        integration.astrai_attention(torch.nn.Module(), q, q, q, None, sliding_window=0)


def test_harmless_and_off_arguments_are_accepted():
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    want, _ = integration.astrai_attention(module, q, q, q, None)
    got, _ = integration.astrai_attention(
        module, q, q, q, None, dropout=0.0, softcap=None, s_aux=None, sliding_window=None, position_bias=None,
        position_ids=torch.arange(3)[None], use_cache=True, output_attentions=False, output_router_logits=False)
    assert torch.equal(got, want)
    assert torch.equal(integration.astrai_attention(module, q, q, q, None, softcap=0.0)[0], want)


def _mask(q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, config=None, **kwargs):
    from transformers.masking_utils import sliding_window_causal_mask_function

    config = config or transformers.MistralConfig(sliding_window=WINDOW)
    return integration.astrai_mask(
        batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=sliding_window_causal_mask_function(WINDOW), attention_mask=attention_mask,
        local_size=WINDOW, config=config, **kwargs)


def test_mask_is_left_to_the_window_only_where_it_is_causal_plus_window():
    assert _mask(20, 20) is None  # prefill, nothing padded
    assert _mask(1, 30, q_offset=29) is None  # decode over a full-length cache
    assert _mask(1, 8, q_offset=29, kv_offset=22, attention_mask=torch.ones(2, 30, dtype=torch.bool)) is None
    padded = torch.ones(2, 20, dtype=torch.bool)
    padded[1, :4] = False
    assert _mask(20, 20, attention_mask=padded).shape == (2, 1, 20, 20)
    assert _mask(1, 16, q_offset=3).shape == (2, 1, 1, 16)  # a static cache: keys past the query
    assert _mask(5, 25, q_offset=20).shape == (2, 1, 5, 25)  # several queries after a cache
    assert _mask(20, 20, allow_is_causal_skip=False).shape == (2, 1, 20, 20)
    chunked = transformers.MistralConfig(sliding_window=WINDOW)
    chunked.attention_chunk_size = WINDOW
    assert _mask(20, 20, config=chunked).shape == (2, 1, 20, 20)


def test_a_mask_over_static_cache_slots_keeps_its_own_window():
    """Keys past the last query (empty static-cache slots): the mask, not a bottom-right window, places the queries."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 5, 16, generator=gen)
    k, v = (torch.randn(2, 2, 16, 16, generator=gen) for _ in range(2))
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[0, :5], padding[1, 2:5] = True, True
    mask = sdpa_mask(batch_size=2, q_length=5, kv_length=16, mask_function=sliding_window_causal_mask_function(3),
                     attention_mask=padding, local_size=3, allow_is_causal_skip=False)
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = integration.astrai_attention(module, q, k, v, mask, sliding_window=3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 2:], want[1, 2:], rtol=1e-5, atol=1e-5)  # rows 0-1 of sequence 1 see no key


def test_arguments_that_change_nothing_stay_unset(monkeypatch):
    """A default scale or a window covering every key is left unset, so backends without them stay eligible."""
    seen = {}
    monkeypatch.setattr(integration, "attention", lambda q, k, v, **kwargs: seen.update(kwargs) or q)
    q = torch.randn(1, 2, 6, 16)
    integration.astrai_attention(torch.nn.Module(), q, q, q, None, scaling=16**-0.5, sliding_window=6)
    assert seen["scale"] is None and seen["window_left"] == -1
    integration.astrai_attention(torch.nn.Module(), q, q, q, None, scaling=0.2, sliding_window=5)
    assert seen["scale"] == 0.2 and seen["window_left"] == 4
