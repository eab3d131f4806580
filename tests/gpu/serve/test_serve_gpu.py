"""astrai.serve on CUDA in bfloat16: decode graphs against eager steps, and against transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from astrai.serve import LLM

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per row."""
    return (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def llm():
    # Llama-3-8B layer shapes, 2 layers: the real GEMM and attention shapes, small enough for a test
    return LLM.from_preset("llama3-8b", num_layers=2, dtype=torch.bfloat16, device="cuda", seed=0, max_batch_size=16)


def _assert_graph_agrees_with_eager(got, want, got_logits, want_logits, logits_rel: float = 2e-2) -> None:
    for g, w, gl, wl in zip(got, want, got_logits, want_logits):
        first = _first_divergence(g, w)
        n = first + 1  # logits agree up to and including the first differing step
        assert float(_rel(gl[:n], wl[:n]).max()) < logits_rel
        if first < len(w):
            # random weights make near-ties: the graph may pick another token only where the
            # eager logits rate it as good as the best, within bf16 rounding (then the
            # continuations differ and are compared no further)
            step = wl[first].float()
            assert float(step.max() - step[g[first]]) <= 2e-2 * float(step.abs().max()), (first, g[first], w[first])


def test_graph_decode_matches_eager_decode(llm):
    eager = LLM(llm.model, cuda_graphs=False, max_batch_size=16)
    prompts = _prompts(1, [5, 130, 17, 700, 64], llm.config.vocab_size)
    llm.reserve(prompts * 3, 24)  # graphs up to 15 requests: the 5 decode in the bucket of 8, with 3 pad rows
    assert llm.graphs.bucket(5) == 8
    replays = llm.graphs.replays
    got, got_logits = llm.generate(prompts, max_new_tokens=24, return_logits=True)
    assert llm.graphs.replays - replays == llm.last_stats.decode_steps >= 23
    want, want_logits = eager.generate(prompts, max_new_tokens=24, return_logits=True)
    _assert_graph_agrees_with_eager(got, want, got_logits, want_logits)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_graphs_on_and_off_give_the_same_tokens_as_batches_grow_and_shrink(llm, kv_dtype):
    """The engine's default decode path (CUDA graphs over static plans) against eager steps:
    ragged prompts, long ones prefilled in chunks while short ones decode (the decode batch
    grows), and an EOS that stops requests at different steps (it shrinks). The greedy tokens
    agree as graph and eager decode can: the graph's split-KV count is planned for its longest
    reservation, an eager step's for its own lengths, so the float32 merges run in another order;
    logits agree to bf16 rounding up to each request's first differing token, and that token is
    a near-tie of the eager logits (a replay into freed workspaces gave NaN or errors of 1e-2+)."""
    engines = [LLM(llm.model, max_batch_size=16, max_batch_tokens=512, kv_cache_dtype=kv_dtype, cuda_graphs=graphs)
               for graphs in (True, False)]
    prompts = _prompts(7, [3, 40, 900, 17, 2100, 260, 5, 1300], llm.config.vocab_size)
    probe = engines[1].generate(prompts, max_new_tokens=24)
    eos = probe[1][5]  # request 1 stops at its sixth token, the others where (if ever) they meet it
    for engine in engines:
        engine.config = dataclasses.replace(engine.config, eos_token_ids=(eos,))
    (got, got_logits), (want, want_logits) = (e.generate(prompts, max_new_tokens=24, return_logits=True) for e in engines)
    graphed = engines[0].graphs
    assert graphed is not None and graphed.replays > 0, engines[0].graphs_off_reason
    lengths = [len(w) for w in want]
    assert min(lengths) <= 6 < max(lengths) == 24, lengths  # the batch shrank
    _assert_graph_agrees_with_eager(got, want, got_logits, want_logits)


def test_overlapped_graph_decode_equals_step_by_step(llm):
    """The overlapped loop feeds each step the previous step's tokens on the device: the same
    graphs replayed one step at a time give the same tokens, bit for bit."""
    serial = LLM(llm.model, overlap=False, max_batch_size=16)
    prompts = _prompts(4, [300, 7, 51, 1200, 90, 33], llm.config.vocab_size)
    assert llm.generate(prompts, max_new_tokens=40) == serial.generate(prompts, max_new_tokens=40)
    assert serial.graphs.replays >= 39


def test_tokens_and_logits_match_transformers_bf16(llm):
    hf = llm.to_transformers("sdpa")
    prompts = _prompts(2, [9, 33, 128, 250, 511, 1000, 77, 3], llm.config.vocab_size)
    tokens, logits = llm.generate(prompts, max_new_tokens=32, return_logits=True)
    agree = total = 0
    for prompt, new, got in zip(prompts, tokens, logits):
        with torch.no_grad():  # transformers on the engine's own sequence: the same context at every step
            full = hf(torch.tensor([prompt + new], device="cuda"), logits_to_keep=len(new) + 1).logits[0, :-1]
        assert float(_rel(got.cuda(), full).max()) < 5e-2
        agree += int((full.argmax(-1).cpu() == torch.tensor(new)).sum())
        total += len(new)
    assert agree / total >= 0.95


def test_fp8_engine_runs_in_graphs_and_stays_close(llm):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89 or newer")
    fp8 = LLM(llm.model, fp8=True, max_batch_size=16)
    prompts = _prompts(3, [40, 300, 12], llm.config.vocab_size)
    _, exact = llm.generate(prompts, max_new_tokens=1, return_logits=True)
    tokens, approx = fp8.generate(prompts, max_new_tokens=16, return_logits=True)
    assert fp8.graphs.replays >= 15 and [len(t) for t in tokens] == [16] * 3
    for want, got in zip(exact, approx):
        # e4m3 activations and weights in every linear of 2 layers and the LM head: 0.17 measured on
        # the H200 (random weights); a wrong scale or a skipped K tile lands far above 0.25
        assert 0 < float(_rel(got[:1], want[:1]).max()) < 0.25


@pytest.mark.parametrize(("kv_dtype", "bound"), [(torch.float8_e4m3fn, 0.15), (torch.float8_e5m2, 0.3)])
def test_fp8_kv_cache_decodes_in_graphs_like_eager(llm, kv_dtype, bound):
    """Scales calibrated before the capture (the same on both engines: the same first prefill
    step), the paged decode kernel reading FP8 pages inside the graphs as eagerly."""
    graphs = LLM(llm.model, max_batch_size=16, kv_cache_dtype=kv_dtype)
    eager = LLM(llm.model, max_batch_size=16, kv_cache_dtype=kv_dtype, cuda_graphs=False)
    prompts = _prompts(6, [40, 300, 12, 700], llm.config.vocab_size)
    got, got_logits = graphs.generate(prompts, max_new_tokens=16, return_logits=True)
    assert graphs.graphs is not None and graphs.graphs.replays >= 15, graphs.graphs_off_reason
    want, want_logits = eager.generate(prompts, max_new_tokens=16, return_logits=True)
    for i in range(llm.config.num_layers):
        for a, b in zip(graphs.kv_cache.kv_scales(i), eager.kv_cache.kv_scales(i)):
            assert torch.equal(a, b)
    _assert_graph_agrees_with_eager(got, want, got_logits, want_logits)
    assert graphs.kv_cache.kv_dtype == kv_dtype
    _, exact = llm.generate(prompts, max_new_tokens=1, return_logits=True)
    for g, w in zip(got_logits, exact):
        # against the bf16 cache's first logits (relative L2); the CPU's tiny preset in float32
        # measures at most 0.04 (e4m3) / 0.08 (e5m2) as max |error| over the largest logit
        assert 0 < float(_rel(g[:1], w[:1]).max()) < bound


def test_transformers_attn_implementation_astrai_bf16():
    from astrai.integrations.transformers import register

    name = register()
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name, dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    ours, ref = ours.cuda().eval(), ref.cuda().eval()
    ids = torch.randint(1, 1000, (3, 200), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    mask[2, :120] = 0
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert float(_rel(got[keep], want[keep]).max()) < 2e-2
    args = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    new_got, new_want = ours.generate(ids, **args)[:, 200:], ref.generate(ids, **args)[:, 200:]
    assert (new_got == new_want).float().mean() >= 0.9


def test_fused_rope_matches_rotary_then_attention(llm):
    unfused = LLM(llm.model, fused_rope=False, max_batch_size=16)
    prompts = _prompts(5, [64, 9, 513], llm.config.vocab_size)
    got, got_logits = llm.generate(prompts, max_new_tokens=16, return_logits=True)
    want, want_logits = unfused.generate(prompts, max_new_tokens=16, return_logits=True)
    for g, w, gl, wl in zip(got, want, got_logits, want_logits):
        n = _first_divergence(g, w) + 1
        assert float(_rel(gl[:n], wl[:n]).max()) < 2e-2


def test_decode_graph_replays_write_no_memory_handed_out_after_the_capture(llm):
    """The engine's DecodeGraphs, captured with long reservations (split-KV launches): tensors
    of every size a split launch's partials could have, allocated after the capture, keep
    their values through a replay of every bucket."""
    engine = LLM(llm.model, max_batch_size=8)
    engine.reserve(_prompts(3, [1500] * 8, llm.config.vocab_size), 64)
    config, graphs = llm.config, engine.graphs
    assert graphs is not None, engine.graphs_off_reason
    torch.cuda.synchronize()
    sentinel = 1.5e38
    numels = {s * b * config.num_heads * n for b in graphs.sizes for s in range(2, 33) for n in (config.head_dim, 1)}
    sentinels = [torch.full((n,), sentinel, device="cuda") for n in sorted(numels) for _ in range(2)]
    for size in graphs.sizes:
        graphs._graphs[size].graph.replay()
    torch.cuda.synchronize()
    overwritten = sum(not bool((t == sentinel).all()) for t in sentinels)
    assert overwritten == 0, f"{overwritten} of {len(sentinels)} tensors allocated after the capture were overwritten"
