"""LLM.from_pretrained: a local transformers folder (save_pretrained, one file or shards) loaded
straight into the engine, against transformers' own model of the same folder (float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.serve import LLM
from astrai.serve.checkpoint import CheckpointError, load_checkpoint
from astrai.serve.model import DecoderLayer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **COMMON),
    # a window shorter than the prompts: the sliding layers' window_left matters
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=8, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=1, **COMMON),  # q/k/v bias
    # layer 1 slides (layers >= max_window_layers), layer 0 attends to everything
    "qwen2-window": lambda: transformers.Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                                                     max_window_layers=1, **COMMON),
    "llama3-rope": lambda: transformers.LlamaConfig(num_key_value_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **COMMON),
    "tied": lambda: transformers.LlamaConfig(num_key_value_heads=4, tie_word_embeddings=True, **COMMON),
}


def _save(tmp_path, kind: str, seed: int = 0, **save_kwargs):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():  # biases and norms away from their init, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.5)
    folder = tmp_path / kind
    model.save_pretrained(folder, **save_kwargs)
    return folder, model.eval()


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("sharded", [False, True])
def test_tokens_and_logits_equal_transformers(tmp_path, kind, sharded):
    folder, hf = _save(tmp_path, kind, max_shard_size="40KB" if sharded else "5GB")
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    llm = LLM.from_pretrained(folder, dtype=torch.float32, device="cpu", max_batch_tokens=16)
    prompts = _prompts(COMMON["vocab_size"], [3, 20, 11])
    tokens, logits = llm.generate(prompts, max_new_tokens=8, return_logits=True)
    assert tokens == [_hf_greedy(hf, p, 8) for p in prompts]
    for prompt, new, got in zip(prompts, tokens, logits):
        with torch.no_grad():
            want = hf(torch.tensor([prompt + new[:-1]])).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_weights_land_in_the_requested_dtype_and_match_the_files(tmp_path):
    folder, hf = _save(tmp_path, "qwen2", max_shard_size="40KB")
    model = load_checkpoint(folder, dtype=torch.bfloat16, device="cpu")
    assert model.dtype == torch.bfloat16 and not any(p.requires_grad for p in model.parameters())
    q = hf.model.layers[1].self_attn.q_proj
    qkv = model.layers[1].qkv
    assert torch.equal(qkv.weight[: q.weight.shape[0]], q.weight.to(torch.bfloat16))
    assert torch.equal(qkv.bias[: q.bias.shape[0]], q.bias.to(torch.bfloat16))
    assert load_checkpoint(folder, device="cpu").dtype == torch.float32  # default: the checkpoint's dtype


def test_generation_config_eos_is_the_engines(tmp_path):
    folder, _ = _save(tmp_path, "llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert LLM.from_pretrained(folder, device="cpu").config.eos_token_ids == (7, 9)


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(("change", "match"), [
    (dict(architectures=["LlamaForSequenceClassification"]), "architecture LlamaForSequenceClassification"),
    (dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"]), "Gemma2ForCausalLM"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "rope_type 'dynamic'"),
])
def test_unsupported_configs_are_named_with_what_is_supported(tmp_path, change, match):
    folder, _ = _save(tmp_path, "llama")
    _edit_config(folder, **change)
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(folder, device="cpu")
    assert str(folder) in str(err.value) and "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in str(err.value)


def test_missing_folder_config_and_weights_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="not a folder"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
    folder, hf = _save(tmp_path, "llama")
    (folder / "model.safetensors").unlink()
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model.safetensors.*pytorch_model.bin.*not read"):
        load_checkpoint(folder, device="cpu")


def test_a_missing_shard_is_named(tmp_path):
    folder, _ = _save(tmp_path, "llama", max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shards that are not there: .*{shard.name}"):
        load_checkpoint(folder, device="cpu")


def _rewrite_weights(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def test_unknown_missing_and_misshapen_weights_are_named(tmp_path):
    folder, _ = _save(tmp_path, "llama")
    _rewrite_weights(folder, lambda s: s.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(CheckpointError, match="no place for: model.layers.0.self_attn.q_norm.weight"):
        load_checkpoint(folder, device="cpu")
    _rewrite_weights(folder, lambda s: [s.pop("model.layers.0.self_attn.q_norm.weight"),
                                        s.pop("model.layers.1.mlp.up_proj.weight")])
    with pytest.raises(CheckpointError, match="lacks model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(folder, device="cpu")
    _rewrite_weights(folder, lambda s: s.update({"model.layers.1.mlp.up_proj.weight": torch.ones(128, 32)}))
    for fp8 in (None, torch.float8_e4m3fn):  # a released linear is checked when its layer is read
        with pytest.raises(CheckpointError, match=r"up_proj.weight has shape \(128, 32\), the config gives "
                                                  r"\(128, 64\)"):
            load_checkpoint(folder, device="cpu", fp8_weights=fp8)


@pytest.mark.parametrize("kind", ["qwen2", "tied"])  # q/k/v biases beside released weights; a tied head
@pytest.mark.parametrize("sharded", [False, True])
def test_fp8_weights_load_layer_by_layer(tmp_path, monkeypatch, kind, sharded):
    """``from_pretrained(..., fp8_weights=True)`` quantizes each layer as it is read: never two
    layers' 16-bit linears at once, and the engine equals one over the whole 16-bit load's copies."""
    folder, _ = _save(tmp_path, kind, max_shard_size="40KB" if sharded else "5GB")
    whole = LLM(load_checkpoint(folder, dtype=torch.float32, device="cpu"), fp8_weights=True)
    live, most = set(), []
    materialize, quantize = DecoderLayer.materialize_linears, DecoderLayer.quantize_weights_fp8

    def materialized(layer):
        materialize(layer)
        live.add(id(layer))
        most.append(len(live))

    def quantized(layer, *args, **kwargs):
        quantize(layer, *args, **kwargs)
        if layer.linears_released:
            live.discard(id(layer))

    monkeypatch.setattr(DecoderLayer, "materialize_linears", materialized)
    monkeypatch.setattr(DecoderLayer, "quantize_weights_fp8", quantized)
    llm = LLM.from_pretrained(folder, dtype=torch.float32, device="cpu", fp8_weights=True)
    assert most == [1] * COMMON["num_hidden_layers"] and not live
    assert llm.model.linears_released and llm.model.weight_bytes() < whole.model.weight_bytes()
    prompts = _prompts(COMMON["vocab_size"], [3, 17])
    tokens, logits = llm.generate(prompts, max_new_tokens=6, return_logits=True)
    want_tokens, want = whole.generate(prompts, max_new_tokens=6, return_logits=True)
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want))
    with pytest.raises(ValueError, match="fp8_weights must be None"):
        load_checkpoint(folder, device="cpu", fp8_weights=torch.bfloat16)


def test_saved_inv_freq_and_tied_heads_are_ignored(tmp_path):
    folder, hf = _save(tmp_path, "tied")
    _rewrite_weights(folder, lambda s: s.update({"model.rotary_emb.inv_freq": torch.ones(8),
                                                 "lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    llm = LLM.from_pretrained(folder, dtype=torch.float32, device="cpu")
    prompt = _prompts(COMMON["vocab_size"], [9])[0]
    assert llm.generate([prompt], max_new_tokens=6) == [_hf_greedy(hf, prompt, 6)]


def test_cli_serves_a_checkpoint_without_building_a_transformers_model(tmp_path, capsys, monkeypatch):
    from astrai.cli.main import main

    folder, _ = _save(tmp_path, "mistral", max_shard_size="40KB")

    def refuse(*args, **kwargs):
        raise AssertionError("the engine's load built a transformers model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    out = tmp_path / "gen.json"
    argv = ["generate", "--checkpoint", str(folder), "--requests", "2", "--prompt-len", "3", "12",
            "--max-new-tokens", "4", "--dtype", "float32", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["engine"]["requests"] == 2 and result["engine"]["new_tokens"] == 8


def test_cli_compares_against_the_checkpoints_own_transformers_model(tmp_path, capsys):
    from astrai.cli.main import main

    folder, _ = _save(tmp_path, "qwen2")
    out = tmp_path / "gen.json"
    argv = ["generate", "--checkpoint", str(folder), "--requests", "2", "--prompt-len", "3", "9",
            "--max-new-tokens", "4", "--dtype", "float32", "--compare", "hf", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["peers"][0]["status"] == "ran" and result["accuracy"]["astrai"] < 1e-5


def test_cli_refuses_an_unsupported_checkpoint_before_loading(tmp_path, capsys):
    from astrai.cli.main import main

    folder, _ = _save(tmp_path, "llama")
    _edit_config(folder, architectures=["LlamaForTokenClassification"])
    assert main(["generate", "--checkpoint", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "LlamaForTokenClassification" in err and str(folder) in err and "Traceback" not in err


def test_cli_serves_a_checkpoint_with_fp8_weights_loaded_layer_by_layer(tmp_path, capsys):
    from astrai.cli.main import main

    folder, _ = _save(tmp_path, "llama", max_shard_size="40KB")
    out = tmp_path / "gen.json"
    argv = ["generate", "--checkpoint", str(folder), "--requests", "2", "--prompt-len", "3", "9",
            "--max-new-tokens", "3", "--dtype", "float32", "--json", str(out)]
    assert main(argv) == 0
    full = json.loads(out.read_text())["weights_bytes"]
    assert main(argv + ["--fp8-weights"]) == 0
    result = json.loads(out.read_text())
    assert "their 16-bit weights freed" in capsys.readouterr().out
    # per layer: qkv 128 x 64, o 64 x 64, gate_up 256 x 64, down 64 x 128 weights; 512 output channels
    weights, channels = COMMON["num_hidden_layers"] * 36864, COMMON["num_hidden_layers"] * 512
    # float32 weights (4 bytes) became one byte each and a float32 scale per output channel
    assert result["fp8_weights"] is True and full - result["weights_bytes"] == 3 * weights - 4 * channels
