"""The engine over FP8 weight copies (``fp8_weights``) on the CPU (float32): the same tokens and
logits as the model whose weights are the dequantized copies, and an engine that owns its model
frees the 16-bit weights of the decoder linears."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.serve import LLM
from astrai.serve.model import DecoderLayer, DecoderModel, hf_state_dict


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _linear_bytes(model: DecoderModel) -> int:
    return sum(getattr(layer, name).weight.nbytes for layer in model.layers for name in DecoderLayer.LINEARS)


def test_fp8_weights_serve_the_dequantized_model():
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=3)
    fp8 = LLM(llm.model, fp8_weights=True)  # copies on the shared model, read only by this engine
    ref = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=3)
    with torch.no_grad():
        for layer, ref_layer in zip(fp8.model.layers, ref.model.layers):
            for name, (w, w_scale) in layer.fp8_weights.items():
                getattr(ref_layer, name).weight.copy_(w.float() * w_scale[:, None])
    prompts = _prompts(23, [8, 30, 3], llm.config.vocab_size)
    tokens, approx = fp8.generate(prompts, max_new_tokens=5, return_logits=True)
    want_tokens, want = ref.generate(prompts, max_new_tokens=5, return_logits=True)
    assert tokens == want_tokens
    for got, expected in zip(approx, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    _, exact = llm.generate(prompts, max_new_tokens=1, return_logits=True)  # the 16-bit weights, untouched
    for got, full in zip(approx, exact):
        rel = float((got[0] - full[0]).norm() / full[0].norm())
        assert 0 < rel < 0.1  # e4m3 weights, one scale per channel: changed, within a few percent
    with pytest.raises(ValueError, match="exclude each other"):
        LLM(llm.model, fp8=True, fp8_weights=True)


def test_cli_generate_fp8_weights(tmp_path, capsys):
    from astrai.cli.main import main

    out = tmp_path / "gen.json"
    argv = ["generate", "--preset", "tiny", "--requests", "2", "--prompt-len", "4", "9", "--max-new-tokens", "3",
            "--dtype", "float32", "--fp8-weights", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "FP8 weights" in printed and "their 16-bit weights freed" in printed
    assert json.loads(out.read_text())["fp8_weights"] is True
    with pytest.raises(SystemExit) as exit_:  # one or the other: argparse's one-line usage error
        main(["generate", "--preset", "tiny", "--fp8", "--fp8-weights"])
    assert exit_.value.code == 2 and "not allowed with argument --fp8" in capsys.readouterr().err


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_cli_compares_fp8_weights_against_the_original_16bit_model(tmp_path, fp8_weights):
    """The peer (and the accuracy's float32 reference) of a freed preset is rebuilt from its seed:
    the FP8 copies' error shows, instead of a reference made of the same copies."""
    pytest.importorskip("transformers")
    from astrai.cli.main import main

    out = tmp_path / "gen.json"
    argv = ["generate", "--preset", "tiny", "--requests", "2", "--prompt-len", "4", "9", "--max-new-tokens", "3",
            "--dtype", "float32", "--compare", "hf", "--json", str(out)] + (["--fp8-weights"] if fp8_weights else [])
    assert main(argv) == 0
    result = json.loads(out.read_text())
    error = result["accuracy"]["astrai"]
    assert (0.005 < error < 0.1) if fp8_weights else error < 1e-4
    full = LLM.from_preset("tiny", dtype=torch.float32, device="cpu").model.weight_bytes()
    assert (result["weights_bytes"] < full) == fp8_weights


def test_an_engine_that_owns_its_model_frees_the_16bit_linears():
    kept = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=5)
    full_bytes = kept.model.weight_bytes()
    assert full_bytes == kept.config.num_parameters() * 4  # float32, every parameter once
    shared = LLM(kept.model, fp8_weights=True)  # the model passed in keeps its 16-bit weights
    assert not kept.model.linears_released
    own = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=5, fp8_weights=True)
    model = own.model
    assert model.linears_released and all(layer.linears_released for layer in model.layers)
    copies = sum(w.nbytes + s.nbytes for layer in model.layers for w, s in layer.fp8_weights.values())
    assert copies > 0
    assert model.weight_bytes() == full_bytes - _linear_bytes(kept.model) + copies
    for layer, kept_layer in zip(model.layers, kept.model.layers):  # the same copies as the shared model's
        for name, (w, s) in layer.fp8_weights.items():
            assert torch.equal(w.float(), kept_layer.fp8_weights[name][0].float())
            assert torch.equal(s, kept_layer.fp8_weights[name][1])
    prompts = _prompts(7, [9, 25, 2], model.config.vocab_size)
    tokens, logits = own.generate(prompts, max_new_tokens=6, return_logits=True)
    want_tokens, want = shared.generate(prompts, max_new_tokens=6, return_logits=True)
    assert tokens == want_tokens
    for got, expected in zip(logits, want):
        assert torch.equal(got, expected)  # the same copies, the same arithmetic


def test_released_linears_need_fp8_weights_and_export_dequantized():
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=2, fp8_weights=True)
    model = llm.model
    with pytest.raises(ValueError, match="pass fp8_weights=True"):
        LLM(model)
    with pytest.raises(ValueError, match="pass fp8_weights=True"):
        LLM(model, fp8=True)
    with pytest.raises(RuntimeError, match="released"):  # before anything reads the (absent) cache
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), None)
    state = hf_state_dict(model)  # transformers' names, the FP8 copies dequantized
    layer = model.layers[1]
    w, s = layer.fp8_weights["gate_up"]
    gate, up = (w.float() * s[:, None]).chunk(2)
    assert torch.equal(state["model.layers.1.mlp.gate_proj.weight"], gate)
    assert torch.equal(state["model.layers.1.mlp.up_proj.weight"], up)
    assert all(not t.is_meta for t in state.values())
    hf = llm.to_transformers("eager")  # the peer of a freed model runs the dequantized weights
    prompt = _prompts(3, [12], model.config.vocab_size)[0]
    tokens, logits = llm.generate([prompt], max_new_tokens=4, return_logits=True)
    with torch.no_grad():
        want = hf(torch.tensor([prompt + tokens[0][:-1]])).logits[0, len(prompt) - 1:]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)


def test_w8a8_layers_read_inputs_quantized_where_they_are_made(monkeypatch):
    """Where the route is W8A8 (forced here: the CPU has no FP8 GEMM route of its own), the
    linears after a norm or SiLU-and-mul take rows that launch quantized (backend.norm_fp8) and
    the step is the step whose linears quantize their 16-bit input themselves, to the bit."""
    from astrai.extension.backend import fp8_weights
    from astrai.serve import model as model_module

    llm = LLM.from_preset("tiny", dtype=torch.bfloat16, device="cpu", seed=3)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # norms of their own, so that a norm's weight read in another's place shows
        for layer in llm.model.layers:
            for norm in (layer.attn_norm, layer.mlp_norm):
                norm.copy_(1 + 0.5 * torch.randn(norm.shape, generator=gen))
    fp8 = LLM(llm.model, fp8_weights=True)
    prompts = _prompts(5, [9, 17], llm.config.vocab_size)
    monkeypatch.setattr(fp8_weights, "fp8_weight_route", lambda *args, **kwargs: "w8a8")
    monkeypatch.setattr(model_module, "fp8_weight_route", lambda *args, **kwargs: "weight")  # the linears quantize
    want_tokens, want = fp8.generate(prompts, max_new_tokens=3, return_logits=True)
    made = []
    for name in ("add_rms_norm_fp8", "silu_and_mul_fp8"):
        real = getattr(model_module, name)
        monkeypatch.setattr(model_module, name, lambda *args, _real=real, _name=name: made.append(_name) or _real(*args))
    monkeypatch.setattr(model_module, "fp8_weight_route", lambda *args, **kwargs: "w8a8")
    monkeypatch.setattr(model_module, "W8A8_MIN_ROWS", 1)  # a two-request decode step too
    tokens, got = fp8.generate(prompts, max_new_tokens=3, return_logits=True)
    assert tokens == want_tokens
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    steps = 3  # one prefill, two decode steps
    assert made == ["add_rms_norm_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8"] * llm.config.num_layers * steps


def test_steps_below_the_w8a8_crossover_do_not_ask_the_route_table_twice(monkeypatch):
    """Below W8A8_MIN_ROWS a layer knows its linears take 16-bit rows: only the linears ask."""
    from astrai.serve import model as model_module

    asked = []
    real = model_module.fp8_weight_route
    monkeypatch.setattr(model_module, "fp8_weight_route", lambda *args, **kwargs: asked.append(1) or real(*args))
    llm = LLM.from_preset("tiny", dtype=torch.bfloat16, device="cpu", seed=3)
    fp8 = LLM(llm.model, fp8_weights=True)
    fp8.generate(_prompts(6, [5, 7], llm.config.vocab_size), max_new_tokens=2)  # 12 and 2 rows
    assert asked == []
    fp8.generate(_prompts(6, [20, 30], llm.config.vocab_size), max_new_tokens=1)  # a 50-row prefill
    assert len(asked) == 3 * llm.config.num_layers  # qkv, gate_up, down of each layer
