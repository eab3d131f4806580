"""astrai.serve with an FP8 KV cache on the CPU (the torch fallbacks): greedy generation against
a transformers reference that quantizes its keys and values the same way, the scales calibrated
before any decode graph is captured, the cache's bytes, bad ``kv_cache_dtype`` values, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.cli.main import main
from astrai.extension import PagedKVCache
from astrai.serve import LLM, engine, graphs
from astrai.serve.graphs import DecodeGraphs
from astrai.serve.scheduler import Request, Scheduler

transformers = pytest.importorskip("transformers")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REFERENCE = "fp8-kv-reference"


def fake_quantized(x: torch.Tensor, scale: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """``round_to_fp8(x / scale) * scale`` in float32, saturated (docs/kv_cache_fp8.md, "Conversions")."""
    limit = torch.finfo(kv_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(kv_dtype).float() * scale


def _reference_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa over keys and values [B, kv_heads, L, D] (rotated keys) quantized with the layer's
    engine scales (``module.kv_fp8``: ``(k_scale, v_scale, kv_dtype)``, None for none)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if module.kv_fp8 is not None:
        k_scale, v_scale, kv_dtype = module.kv_fp8
        key, value = fake_quantized(key, k_scale, kv_dtype), fake_quantized(value, v_scale, kv_dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def reference_model(llm: LLM, quantized: bool = True):
    """transformers' model of ``llm``'s weights whose attention reads keys and values through
    ``llm``'s FP8 cache arithmetic with its scales (``quantized=False``: exact keys and values)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE, _reference_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)
    hf = llm.to_transformers(REFERENCE)
    cache = llm.kv_cache
    for i, layer in enumerate(hf.model.layers):
        layer.self_attn.kv_fp8 = (*cache.kv_scales(i), cache.kv_dtype) if quantized else None
    return hf


def teacher_forced(hf, prompt: list[int], new: list[int]) -> torch.Tensor:
    """``hf``'s float32 logits at the positions that produced ``new`` (prompt + new fed at once)."""
    with torch.no_grad():
        full = hf(torch.tensor([prompt + new])).logits[0].float()
    return full[len(prompt) - 1: len(prompt) - 1 + len(new)]


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _tiny(**kwargs) -> LLM:
    return LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=5, **kwargs)


PROMPTS = _prompts(21, [3, 40, 17, 9], 512)


# -- accuracy ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_greedy_generation_matches_the_fp8_reference(kv_dtype):
    """Chunked prefill, waiting requests, decode: every logit the engine produced is the
    reference's (transformers with keys and values quantized like the cache, the engine's
    scales) to float32 rounding and the odd fp8 rounding flip, and each greedy token is the
    reference's argmax."""
    llm = _tiny(kv_cache_dtype=kv_dtype, max_batch_size=2, max_batch_tokens=24)
    tokens, logits = llm.generate(PROMPTS, max_new_tokens=12, return_logits=True)
    assert llm.kv_cache.kv_dtype == kv_dtype and llm.last_stats.prefill_steps > 1
    quantized, exact = reference_model(llm), reference_model(llm, quantized=False)
    for prompt, new, got in zip(PROMPTS, tokens, logits):
        want = teacher_forced(quantized, prompt, new)
        scale = float(want.abs().max())
        err = float((got - want).abs().max())
        # float32 rounding, plus the odd value near an fp8 rounding boundary that the engine's and
        # the reference's float32 keys round to neighbouring fp8 values (seen: 1.7e-4 on one CPU)
        assert err <= 5e-4 * scale, (err, scale)
        # the tolerance tells a quantized cache from an exact one by far
        assert float((got - teacher_forced(exact, prompt, new)).abs().max()) > 20 * err
        assert new == want.argmax(-1).tolist()


def relative_max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``max |got - want| / max |want|`` over the rows (steps) of ``[steps, vocab]`` logits."""
    return float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max())


# Max |logit error| of a row over its largest logit, against exact keys and values. e4m3 keeps
# 3 mantissa bits (a value within 2**-4 of itself), e5m2 2 (2**-3): measured on the tiny preset
# (seeds 5-7, these prompts) at most 0.038 (e4m3) and 0.077 (e5m2); a missing scale or a
# value read as raw bytes lands far above.
LOGIT_BOUND = {E4M3: 0.06, E5M2: 0.12}


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_logits_within_the_bound_of_the_unquantized_engine(kv_dtype):
    llm = _tiny(kv_cache_dtype=kv_dtype)
    tokens, logits = llm.generate(PROMPTS, max_new_tokens=12, return_logits=True)
    exact = reference_model(llm, quantized=False)  # the float32 engine's logits (tests/serve/test_serve.py)
    for prompt, new, got in zip(PROMPTS, tokens, logits):  # teacher-forced on the FP8 engine's tokens
        assert 0 < relative_max_error(got, teacher_forced(exact, prompt, new)) <= LOGIT_BOUND[kv_dtype]
    first = _tiny().generate(PROMPTS, max_new_tokens=1, return_logits=True)[1]  # the float32 engine's prefill
    for got, want in zip(logits, first):
        assert 0 < relative_max_error(got[:1], want) <= LOGIT_BOUND[kv_dtype]


# -- scales, before any capture ------------------------------------------------------------


def test_scales_are_calibrated_on_the_first_prefill_step_and_then_fixed():
    """The engine's scales are those a cache gets when the workload's first prefill step
    calibrates it (the same keys and values), and generation keeps the same tensors, unchanged."""
    llm = _tiny(kv_cache_dtype=E4M3, max_batch_size=2, max_batch_tokens=24)
    llm.reserve(PROMPTS, 12)
    cache = llm.kv_cache
    scales = [cache.kv_scales(i) for i in range(cache.num_layers)]
    held = [(k.clone(), v.clone()) for k, v in scales]

    c = llm.config
    lazy = PagedKVCache(num_layers=c.num_layers, num_pages=cache.num_pages, page_size=llm.page_size,
                        kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=torch.float32, kv_dtype=E4M3)
    requests = [Request(rid=i, prompt=p, max_new_tokens=12) for i, p in enumerate(PROMPTS)]
    step = Scheduler(requests, page_size=llm.page_size, num_pages=cache.free_pages, max_batch_size=2,
                     max_batch_tokens=24).next_step()
    assert step.q_lens == (3, 21)  # a chunked step: the calibration saw the chunk only
    for r in step.requests:
        lazy.add_sequence(r.rid)
    lazy.plan([r.rid for r in step.requests], list(step.q_lens))
    tokens = torch.tensor([t for r, n in zip(step.requests, step.q_lens) for t in r.prompt[:n]])
    positions = torch.tensor([p for n in step.q_lens for p in range(n)])
    with torch.inference_mode():
        llm.model(tokens, positions, lazy)
    for i, (k, v) in enumerate(held):
        assert torch.equal(k, lazy.kv_scales(i)[0]) and torch.equal(v, lazy.kv_scales(i)[1])

    llm.generate(PROMPTS, max_new_tokens=12)
    assert llm.kv_cache is cache
    for (k, v), (k0, v0), i in zip(scales, held, range(cache.num_layers)):
        now = cache.kv_scales(i)
        assert now[0] is k and now[1] is v and torch.equal(k, k0) and torch.equal(v, v0)


class RecordingGraphs:
    """Stands in for DecodeGraphs on the CPU: runs its scale check, records the scales it
    would capture with, and captures nothing (``bucket`` None: the engine decodes eagerly)."""

    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __init__(self, forward, kv_cache, pad_seq, max_batch_size, max_seq_pages):
        graphs.require_kv_scales(kv_cache)
        RecordingGraphs.seen.append([kv_cache.kv_scales(i) for i in range(kv_cache.num_layers)])
        self.sizes, self.max_seq_pages = (max_batch_size,), max_seq_pages

    def bucket(self, batch: int) -> None:
        return None

    def static_plan(self, batch: int) -> None:
        return None


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    RecordingGraphs.seen = []
    monkeypatch.setattr(engine, "DecodeGraphs", RecordingGraphs)
    return RecordingGraphs.seen


def test_decode_graphs_are_captured_after_the_scales_are_set(graphs_on_the_cpu):
    llm = _tiny(kv_cache_dtype=E4M3)
    llm.use_graphs = True  # the CUDA path's order of building the cache and capturing
    tokens = llm.generate(PROMPTS, max_new_tokens=6)
    assert llm.graphs is not None and len(graphs_on_the_cpu) == 1 and llm.use_graphs
    captured = graphs_on_the_cpu[0]
    assert all(k is not None for k in captured)
    cache = llm.kv_cache
    for i, (k, v) in enumerate(captured):  # the tensors a graph would read are the cache's, unchanged
        assert cache.kv_scales(i)[0] is k and cache.kv_scales(i)[1] is v
    assert tokens == _tiny(kv_cache_dtype=E4M3).generate(PROMPTS, max_new_tokens=6)


def test_a_capture_before_the_scales_are_set_is_refused(graphs_on_the_cpu, monkeypatch):
    monkeypatch.setattr(engine, "calibrate_kv_scales", lambda llm, cache, requests: None)
    llm = _tiny(kv_cache_dtype=E4M3)
    llm.use_graphs = True
    with pytest.raises(ValueError, match=r"no K/V scales for layers \[0, 1\].*before capturing decode graphs"):
        llm.generate(PROMPTS, max_new_tokens=2)
    assert graphs_on_the_cpu == []


def test_decode_graphs_check_the_scales_first():
    cache = PagedKVCache(num_layers=3, num_pages=8, page_size=4, kv_heads=2, head_dim=8, dtype=torch.float32,
                         kv_dtype=E5M2)
    cache.set_kv_scales(1, 0.5, 0.5)
    with pytest.raises(ValueError, match=r"no K/V scales for layers \[0, 2\]"):
        DecodeGraphs(lambda tokens, positions: None, cache, 0, 1, 1)
    for layer in (0, 2):
        cache.set_kv_scales(layer, 0.5, 0.5)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA kv_cache"):  # past the scales
        DecodeGraphs(lambda tokens, positions: None, cache, 0, 1, 1)


# -- bytes, construction -------------------------------------------------------------------


def test_the_cache_bytes_halve():
    sizes = {}
    for name, dtype, kv in (("bf16", torch.bfloat16, None), ("fp8", torch.bfloat16, E4M3),
                            ("e5m2", torch.bfloat16, E5M2), ("fp32", torch.float32, None)):
        llm = LLM.from_preset("tiny", dtype=dtype, device="cpu", kv_cache_dtype=kv)
        assert llm.kv_cache_bytes == 0
        llm.reserve(PROMPTS, 12)
        sizes[name] = (llm.kv_cache_bytes, llm.kv_cache.num_pages)
    c = llm.config
    pages = sizes["bf16"][1]
    assert all(n == pages for _, n in sizes.values())
    assert sizes["bf16"][0] == 2 * c.num_layers * pages * llm.page_size * c.kv_size * 2
    assert sizes["fp8"][0] == sizes["e5m2"][0] == sizes["bf16"][0] // 2 == sizes["fp32"][0] // 4


@pytest.mark.parametrize(("value", "error"), [
    ("fp8_e4m3", TypeError), (8, TypeError), (torch.bfloat16, ValueError), (torch.int8, ValueError),
    (torch.float8_e4m3fnuz, ValueError),
])
def test_bad_kv_cache_dtypes_are_refused_at_construction(value, error):
    with pytest.raises(error, match=r"^kv_cache_dtype must be one of None \(the model's torch.float32\), "
                                    r"torch.float8_e4m3fn, torch.float8_e5m2, got"):
        _tiny(kv_cache_dtype=value)


def test_kv_cache_dtype_none_or_the_model_dtype_keeps_the_cache_unquantized():
    for value in (None, torch.float32):
        llm = _tiny(kv_cache_dtype=value)
        assert llm.kv_cache_dtype is None
        llm.reserve(PROMPTS[:1], 2)
        assert llm.kv_cache.kv_dtype == torch.float32 and llm.kv_cache.kv_scales(0) is None


# -- astrai generate --kv-cache-dtype ------------------------------------------------------


def test_cli_bad_kv_cache_dtype_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's choices, as for --dtype
        main(["generate", "--preset", "tiny", "--kv-cache-dtype", "fp8"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and err.splitlines()[-1] == (
        "astrai generate: error: argument --kv-cache-dtype: invalid choice: 'fp8' "
        "(choose from 'auto', 'fp8_e4m3', 'fp8_e5m2')")
    assert "model:" not in out


@pytest.mark.parametrize(("arg", "dtype", "itemsize"), [("fp8_e4m3", "torch.float8_e4m3fn", 1),
                                                        ("auto", "torch.float32", 4)])
def test_cli_reports_the_kv_cache_dtype_and_bytes(tmp_path, capsys, arg, dtype, itemsize):
    out = tmp_path / "g.json"
    argv = ["generate", "--preset", "tiny", "--requests", "2", "--prompt-len", "4", "9", "--max-new-tokens", "3",
            "--dtype", "float32", "--kv-cache-dtype", arg, "--json", str(out)]
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    result = json.loads(out.read_text())
    kv = result["kv_cache"]
    assert kv["dtype"] == dtype and kv["bytes"] > 0
    c = LLM.from_preset("tiny").config
    assert kv["bytes"] == 2 * c.num_layers * kv["pages"] * kv["page_size"] * c.kv_size * itemsize
    assert f"KV cache: {dtype.removeprefix('torch.')}, {kv['pages']} pages of {kv['page_size']} tokens" in text
    engine_ = result["engine"]  # the floor's KV bytes are the cache's: one byte a value in FP8
    assert engine_["hbm_floor"]["kv_bytes"] == int(2 * c.num_layers * c.kv_size * itemsize
                                                   * engine_["decode_context_per_step"])
