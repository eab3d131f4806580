"""astrai.serve on the CPU (float32): greedy tokens and logits against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from astrai.serve import LLM, ModelConfig, preset
from astrai.serve.model import DecoderModel, hf_state_dict, load_hf_state_dict
from astrai.serve.scheduler import Request, Scheduler

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=512)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=1, **COMMON),  # q/k/v bias
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=4, sliding_window=None, **COMMON),
}


def _hf(kind: str, seed: int, **overrides):
    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # make Qwen2's q/k/v biases matter (transformers initialises them to zero)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval()


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(("kind", "overlap", "fused_rope"),
                         [(k, True, True) for k in sorted(CONFIGS)] + [("llama", False, True), ("qwen2", True, False)])
def test_greedy_tokens_equal_transformers_generate(kind, overlap, fused_rope):
    hf = _hf(kind, seed=11)
    prompts = _prompts(12, [1, 5, 23, 40, 9, 64], hf.config.vocab_size)
    # few slots and a small token budget: requests wait, prompts are chunked, batches are ragged
    llm = LLM.from_transformers(hf, max_batch_size=3, max_batch_tokens=24, overlap=overlap, fused_rope=fused_rope)
    got = llm.generate(prompts, max_new_tokens=10)
    assert got == [_hf_greedy(hf, p, 10) for p in prompts]
    stats = llm.last_stats
    assert stats.prefill_steps > 1 and stats.decode_steps >= 9 and len(stats.ttft) == len(prompts)


def test_logits_equal_transformers_forward():
    hf = _hf("qwen2", seed=13)
    prompts = _prompts(14, [7, 30], hf.config.vocab_size)
    llm = LLM.from_transformers(hf, max_batch_tokens=16)
    tokens, logits = llm.generate(prompts, max_new_tokens=6, return_logits=True)
    for prompt, new, got in zip(prompts, tokens, logits):
        with torch.no_grad():
            full = hf(torch.tensor([prompt + new])).logits[0]
        want = full[len(prompt) - 1: len(prompt) - 1 + len(new)]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_stops_at_eos_like_transformers():
    hf = _hf("llama", seed=15)
    prompt = _prompts(16, [12], hf.config.vocab_size)[0]
    free_run = _hf_greedy(hf, prompt, 12)
    eos = free_run[4]
    hf.config.eos_token_id = eos
    hf.generation_config.eos_token_id = eos
    want = _hf_greedy(hf, prompt, 12)
    assert want[-1] == eos and len(want) <= 5
    for overlap in (True, False):  # overlapped: the stopped request rides along one step, its token dropped
        got = LLM.from_transformers(hf, overlap=overlap).generate([prompt, prompt[:5]], max_new_tokens=12)
        assert got[0] == want
        assert eos not in got[1][:-1]
        assert got[1] == _hf_greedy(hf, prompt[:5], 12)


def test_weights_round_trip_through_transformers_names():
    hf = _hf("qwen2", seed=17)
    model = DecoderModel(ModelConfig.from_hf(hf.config), dtype=torch.float32)
    load_hf_state_dict(model, hf.state_dict())
    back = hf_state_dict(model)
    for name, tensor in hf.state_dict().items():
        if name in back:
            assert torch.equal(back[name], tensor), name
    assert set(back) <= set(hf.state_dict())


def test_preset_round_trip_to_transformers():
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=3)
    hf = llm.to_transformers()
    prompts = _prompts(18, [3, 17], llm.config.vocab_size)
    assert llm.generate(prompts, max_new_tokens=8) == [_hf_greedy(hf, p, 8) for p in prompts]


def test_preset_names():
    assert preset("llama3-8b-8l").num_layers == 8
    assert preset("llama3-8b", num_layers=2).hidden_size == 4096
    with pytest.raises(ValueError, match="preset 'nope'"):
        preset("nope")


def test_scheduler_chunks_and_admits_within_budgets():
    reqs = [Request(rid=i, prompt=list(range(n)), max_new_tokens=4) for i, n in enumerate([10, 30, 5])]
    sched = Scheduler(reqs, page_size=4, num_pages=20, max_batch_size=2, max_batch_tokens=16)
    step = sched.next_step()
    assert step.kind == "prefill" and [r.rid for r in step.requests] == [0, 1] and step.q_lens == (10, 6)
    assert step.logits_for == (0,)  # request 1's prompt is not complete yet
    with pytest.raises(ValueError, match="needs 12 cache pages"):
        Scheduler([Request(rid=0, prompt=list(range(40)), max_new_tokens=8)], page_size=4, num_pages=10,
                  max_batch_size=1, max_batch_tokens=8)


@pytest.mark.parametrize(
    ("prompts", "max_new", "match"),
    [([[1, 2]], 0, "max_new_tokens"), ([], 4, "prompts must be"), ([[1, -1]], 4, r"prompts\[0\] holds"),
     ([[1], []], 4, r"prompts\[1\]"), ([[1] * 2040], 10, "passes the model's 2048 positions")],
)
def test_bad_input_is_named(prompts, max_new, match):
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, max_new_tokens=max_new)


def test_cli_generate_tiny_writes_json_and_plot(tmp_path, capsys):
    import json

    from astrai.cli.main import main

    out, png = tmp_path / "gen.json", tmp_path / "gen.png"
    argv = ["generate", "--preset", "tiny", "--requests", "3", "--prompt-len", "4", "40", "--max-new-tokens", "5",
            "--dtype", "float32", "--compare", "hf", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert torch.cuda.is_available() or "torch fallbacks" in text
    result = json.loads(out.read_text())
    assert result["engine"]["requests"] == 3 and result["engine"]["new_tokens"] <= 15
    generate_peer = result["peers"][0]
    assert generate_peer["agreement"]["token_agreement"] == 1.0  # float32: the same tokens
    assert png.stat().st_size > 0


def test_cli_generate_fp8_linears_recommends_fp8_weights(tmp_path, capsys):
    import json

    from astrai.cli.main import main

    out = tmp_path / "gen.json"
    argv = ["generate", "--preset", "tiny", "--requests", "2", "--prompt-len", "4", "8", "--max-new-tokens", "2",
            "--dtype", "float32", "--fp8", "--json", str(out)]
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "--fp8-weights" in text and "0.90x" in text
    assert "--fp8-weights" in json.loads(out.read_text())["precision_note"]


def test_cli_generate_bad_arguments(capsys):
    from astrai.cli.main import main

    assert main(["generate", "--preset", "tiny", "--prompt-len", "9", "3"]) == 2  # a usage error, no traceback
    assert "--prompt-len" in capsys.readouterr().err


def test_fp8_linears_run_and_stay_close():
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=1)
    fp8 = LLM(llm.model, fp8=True)
    assert llm.precision_note is None and "fp8_weights=True" in fp8.precision_note  # the serving mode, named
    prompts = _prompts(19, [8, 3], llm.config.vocab_size)
    _, exact = llm.generate(prompts, max_new_tokens=1, return_logits=True)
    tokens, approx = fp8.generate(prompts, max_new_tokens=4, return_logits=True)
    assert [len(t) for t in tokens] == [4, 4]
    for want, got in zip(exact, approx):
        rel = float((got[0] - want[0]).norm() / want[0].norm())
        assert 0 < rel < 0.15  # FP8 (E4M3) linears: changed, but within a few percent


class EagerReplays:
    """DecodeGraphs on the CPU: real static buffers per bucket, a "replay" runs the forward
    eagerly over the step planned into them (what the engine hands a graph)."""

    def __init__(self, forward, kv_cache, pad_seq, max_batch_size, max_seq_pages):
        self.forward, self.max_seq_pages = forward, max_seq_pages
        self.sizes = tuple(sorted({1, max_batch_size}))  # batches between run with pad rows
        self.static = {n: kv_cache.static_decode_plan(n, max_seq_pages, pad_seq) for n in self.sizes}
        self.replays = []

    def bucket(self, batch):
        return next((n for n in self.sizes if n >= batch), None)

    def static_plan(self, batch):
        return self.static.get(self.bucket(batch))

    def run(self, plan, tokens):
        from astrai.serve.greedy import greedy_tokens

        assert plan.kv_lens.data_ptr() == self.static_plan(plan.batch_size).kv_lens.data_ptr()
        self.replays.append(plan.batch_size)
        logits = self.forward(tokens, plan.token_positions)
        return greedy_tokens(logits), logits


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_steps_planned_into_static_buffers_give_the_eager_tokens(monkeypatch, overlap):
    from astrai.serve import engine

    hf = _hf("llama", seed=17)
    prompts = _prompts(18, [3, 30, 11, 7, 19], hf.config.vocab_size)
    want = LLM.from_transformers(hf, max_batch_size=3, max_batch_tokens=24, overlap=overlap).generate(prompts, 12)
    monkeypatch.setattr(engine, "DecodeGraphs", EagerReplays)
    llm = LLM.from_transformers(hf, max_batch_size=3, max_batch_tokens=24, overlap=overlap)
    llm.use_graphs = True  # the CUDA path's decode steps, on the CPU
    assert llm.generate(prompts, 12) == want
    assert {2, 3} <= set(llm.graphs.replays)  # batches of 3, then 2 on the bucket of 3 (a pad row)


def test_capture_pages_share_out_the_free_pages():
    from astrai.serve.graphs import capture_pages

    assert capture_pages(100, 4, 10) == [10, 10, 10, 10]
    assert capture_pages(30, 4, 10) == [8, 8, 7, 7]


def test_cli_generate_from_a_local_checkpoint(tmp_path, capsys):
    import json

    from astrai.cli.main import main

    hf = _hf("qwen2", seed=21)
    hf.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "gen.json"
    argv = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--requests", "2", "--prompt-len", "3", "9",
            "--max-new-tokens", "4", "--dtype", "float32", "--compare", "hf", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["engine"]["requests"] == 2
    assert result["peers"][0]["agreement"]["token_agreement"] == 1.0


def test_graphs_require_the_paged_decode_kernel_for_this_cache(monkeypatch):
    from types import SimpleNamespace

    from astrai.extension import ATTN_BACKEND, PagedKVCache, attn_backend
    from astrai.extension.backend.attention import AttentionCall
    from astrai.serve import graphs

    def decision(dtype, chosen, source="default", kv_dtype=None):
        key = AttentionCall(torch.device("cuda", 0), dtype, 128, 32, 8, "decode", None, True, 0, True, 16, False,
                            kv_dtype=kv_dtype)
        return SimpleNamespace(key=key, chosen=chosen, source=source)

    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    seen = [decision(torch.float32, "torch_native"), decision(torch.bfloat16, "cuda"),
            decision(torch.bfloat16, "torch_native", kv_dtype=torch.float8_e4m3fn),  # an FP8 cache's
            decision(torch.bfloat16, "torch_native", source="explicit")]  # forced with attn_backend elsewhere
    monkeypatch.setattr(graphs, "explain", lambda op: seen)
    graphs._require_graph_safe_attention(cache)  # another dtype's fallback is no concern
    with attn_backend(ATTN_BACKEND.TORCH_NATIVE), pytest.raises(RuntimeError, match="torch_native"):
        graphs._require_graph_safe_attention(cache)  # forced now: the forced decisions count
    seen.append(decision(torch.bfloat16, "torch_native"))
    with pytest.raises(RuntimeError, match="torch_native"):
        graphs._require_graph_safe_attention(cache)
