"""A step abandoned half-way never leaves the paged cache counting slots a layer did not write.

The pages start as NaN, so a layer that read an unwritten slot would give a non-finite
output: after a step that fails between layer 0's append and layer 1, ``step()`` rolls back
(lengths, pages), a plain ``plan()`` rolls the previous plan back at the next one (with a
warning), and the next step's outputs equal those of a cache that never failed.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attention"))  # test_attention_launch
from test_attention_launch import D as LAUNCH_D  # noqa: E402
from test_attention_launch import HQ as LAUNCH_HQ  # noqa: E402
from test_attention_launch import FakeAppendingModule, call_of, decode_cache, fake_module  # noqa: E402

from astrai.extension import CacheStateError, PagedKVCache, apply_rotary_emb_qk, attention  # noqa: E402
from astrai.extension.backend import rope_paged, rotary  # noqa: E402
from astrai.extension.backend.attention import ATTN_BACKEND, attn_backend  # noqa: E402
from astrai.extension.backend.attention.cuda import CudaBackend  # noqa: E402
from astrai.serve import LLM  # noqa: E402

LAYERS, HQ, HKV, D, PAGE = 2, 4, 2, 16, 4


class ModelFailed(RuntimeError):
    pass


def nan_cache(seqs="st"):
    cache = PagedKVCache(LAYERS, 16, PAGE, HKV, D, dtype=torch.float32)
    cache.k_pages.fill_(math.nan)
    cache.v_pages.fill_(math.nan)
    for s in seqs:
        cache.add_sequence(s)
    return cache


def layer_inputs(total, seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(1, total, h, D, generator=g) for h in (HQ, HKV, HKV)) for _ in range(LAYERS)]


def run_layers(cache, inputs, fail_before=None, error=ModelFailed):
    """Every layer appends and attends, as a model does; raises ``error`` before layer ``fail_before``."""
    outs = []
    with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
        for layer, (q, k, v) in enumerate(inputs):
            if layer == fail_before:
                raise error(f"the model failed before layer {layer}")
            outs.append(attention(q, k, v, kv_cache=cache, layer_id=layer))
    return outs


def state(cache):
    return {s: (cache.seq_len(s), cache.page_table(s)) for s in cache.sequences}, cache.free_pages


def assert_same_outputs(got, want):
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("error", [ModelFailed, KeyboardInterrupt])
def test_a_step_that_fails_between_layers_is_rolled_back(error):
    cache, ref = nan_cache(), nan_cache()
    for c in (cache, ref):
        with c.step(["s", "t"], [2, 5]):
            run_layers(c, layer_inputs(7, 0))
    before = state(cache)
    with pytest.raises(error):
        with cache.step(["s"], [3]):  # 2 + 3 tokens cross s's first page: the step takes a page
            run_layers(cache, layer_inputs(3, 1), fail_before=1, error=error)
    assert state(cache) == before  # lengths, page tables and the pool as before the step
    with pytest.raises(RuntimeError, match="no active plan"):
        cache.active_plan
    outs = {}
    for c in (cache, ref):
        with c.step(["s", "t"], [3, 1]) as plan:
            assert plan.kv_lens_host == (5, 6)
            outs[c] = run_layers(c, layer_inputs(4, 2))
    assert_same_outputs(outs[cache], outs[ref])
    assert state(cache) == state(ref)


def test_a_plain_plan_rolls_back_the_previous_plan_that_not_every_layer_wrote():
    cache, ref = nan_cache(), nan_cache()
    for c in (cache, ref):
        c.plan(["s", "t"], [2, 5])
        run_layers(c, layer_inputs(7, 0))
    cache.plan(["s"], [3])
    with pytest.raises(ModelFailed):
        run_layers(cache, layer_inputs(3, 1), fail_before=1)
    with pytest.warns(RuntimeWarning, match=r"layer 1 \(of 2\) did not write the new tokens of requests \['s'\]"):
        plan = cache.plan(["s", "t"], [3, 1])
    assert plan.kv_lens_host == (5, 6)  # s's 3 lost tokens are not counted: the step is replanned
    ref.plan(["s", "t"], [3, 1])
    assert_same_outputs(run_layers(cache, layer_inputs(4, 2)), run_layers(ref, layer_inputs(4, 2)))


def test_no_layer_reads_a_slot_it_did_not_write():
    """The issue's case as it stood: plan, layer 0 appends, the model raises; the next plan
    counted the 3 tokens in layer 1 too, whose pages still held NaN."""
    cache = nan_cache()
    cache.plan(["s"], [3])
    with pytest.raises(ModelFailed):
        run_layers(cache, layer_inputs(3, 0), fail_before=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache.plan(["s"], [1])
    for out in run_layers(cache, layer_inputs(1, 1)):
        assert torch.isfinite(out).all()


def test_retrying_the_failed_layer_on_the_same_plan_completes_the_step():
    cache, ref = nan_cache(), nan_cache()
    for c in (cache, ref):
        c.plan(["s"], [3])
    inputs = layer_inputs(3, 1)
    with pytest.raises(ModelFailed):
        run_layers(cache, inputs, fail_before=1)
    run_layers(cache, inputs)  # every layer again: the step is whole
    run_layers(ref, inputs)
    for c in (cache, ref):
        c.plan(["s"], [1])  # no warning: the previous plan is committed
    assert_same_outputs(run_layers(cache, layer_inputs(1, 2)), run_layers(ref, layer_inputs(1, 2)))


def test_rollback_undoes_the_active_plan_only_while_it_is_uncommitted():
    cache = nan_cache()
    with cache.step(["s"], [3]):
        run_layers(cache, layer_inputs(3, 0))
    assert not cache.rollback()  # committed
    before = state(cache)
    cache.plan(["s", "t"], [2, 4])
    cache.append(0, *layer_inputs(6, 1)[0][1:])  # layer 0 only: the step failed
    assert cache.rollback()
    assert state(cache) == before
    with pytest.raises(RuntimeError, match="no active plan"):
        cache.active_plan
    assert not cache.rollback()


def test_a_step_left_with_an_unwritten_layer_raises_and_rolls_back():
    cache = nan_cache()
    before = state(cache)
    missing = r"layer 1 \(of 2\) did not write the new tokens of requests \['s', 't'\]"
    with pytest.raises(CacheStateError, match=missing):
        with cache.step(["s", "t"], [3, 2]):
            cache.append(0, *layer_inputs(5, 0)[0][1:])
    assert state(cache) == before
    with pytest.raises(CacheStateError, match="layers 0, 1"):
        with cache.step(["s"], [1]):
            pass
    assert isinstance(CacheStateError("x"), RuntimeError)


def test_planning_a_request_of_an_open_step_raises_and_changes_nothing():
    cache = nan_cache()
    with cache.step(["s"], [3]) as plan:
        cache.append(0, *layer_inputs(3, 0)[0][1:])
        with pytest.raises(CacheStateError, match=r"a step\(\) over requests \['s'\] is still open"):
            cache.plan(["t", "s"], [1, 1])
        assert cache.active_plan is plan and cache.seq_len("t") == 0
        cache.append(1, *layer_inputs(3, 0)[1][1:])
    assert cache.seq_len("s") == 3


def test_another_threads_plan_leaves_an_unfinished_plan_of_other_requests_open():
    """Plans of disjoint requests (one per thread, ``plan=`` passed to append) settle nothing of
    each other; the unfinished one is rolled back when its own request is planned again."""
    cache = nan_cache()
    a = cache.plan(["s"], [3])
    cache.append(0, *layer_inputs(3, 0)[0][1:], plan=a)
    b = cache.plan(["t"], [2])
    for layer in range(LAYERS):
        cache.append(layer, *layer_inputs(2, 1)[layer][1:], plan=b)
    cache.plan(["t"], [1])  # b is complete: committed, no warning
    assert cache.seq_len("s") == 3  # a may still be finished by its thread
    with pytest.warns(RuntimeWarning, match=r"layer 1 .* requests \['s'\]"):
        cache.plan(["s"], [3])
    assert cache.seq_len("s") == 3 and cache.seq_len("t") == 3


def test_releasing_a_request_of_an_unfinished_plan_rolls_the_others_back():
    cache = nan_cache()
    cache.plan(["s", "t"], [1, 6])
    cache.append(0, *layer_inputs(7, 0)[0][1:])
    with pytest.warns(RuntimeWarning, match="rolled back at the release of 's'"):
        cache.release("s")
    assert cache.seq_len("t") == 0 and cache.free_pages == cache.num_pages


def test_a_plan_that_fails_to_build_reserves_nothing():
    cache = nan_cache()
    cache.add_preparer("broken", lambda cache, plan: 1 / 0)  # not a RuntimeError: propagates
    before = state(cache)
    with pytest.raises(ZeroDivisionError):
        cache.plan(["s"], [9])
    assert state(cache) == before


def test_the_decode_kernels_in_kernel_append_marks_the_layer(monkeypatch):
    """The CUDA decode writes the step's keys/values inside its launch (no append() call), in
    ``forward`` and in the policy's eager runner: the step still counts every layer written."""
    fake_module(monkeypatch, FakeAppendingModule())
    cache, _ = decode_cache([6, 3], layers=2)
    backend = CudaBackend()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, LAUNCH_HQ, LAUNCH_D, generator=g).bfloat16()
    k = torch.randn(2, 1, cache.kv_heads, LAUNCH_D, generator=g).bfloat16()
    with cache.step([0, 1], [1, 1]):
        for layer in range(2):
            backend.forward(call_of(cache, "decode"), q, k, k, kv_cache=cache, layer_id=layer, is_causal=True)
    with cache.step([0, 1], [1, 1]):
        run = backend.eager_runner(call_of(cache, "decode"), q, k, k, cache)
        assert run is not None
        for layer in range(2):
            run(q, k, k, cache, layer, False)
    assert cache.seq_len(0) == 6 + 3  # decode_cache planned one decode step


def test_the_fused_rotary_kernel_marks_the_layer(monkeypatch):
    from fakes import H200, FakeEntryPoint, entry_points, manifest
    from fakes import fake_module as fake_importer
    from rotary_reference import rope_tables

    from astrai.extension.registry import Registry
    from astrai.extension.runtime import Runtime, use_runtime

    calls = []

    def stand_in(q, k, v, k_cache, v_cache, cos, sin, positions, slots, interleaved):
        calls.append(slots)
        q_rot, k_rot = apply_rotary_emb_qk(q, k, (cos, sin), positions=positions, interleaved=interleaved)
        k_cache.view(-1, HKV, D)[slots] = k_rot
        v_cache.view(-1, HKV, D)[slots] = v
        return q_rot

    ops = {"rope_paged_append": {"module": "fake_rotary_module", "abi": 1, "dtypes": ["float32"]}}
    runtime = Runtime(Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=ops))), importer=fake_importer))
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(rope_paged.ops_rope_paged, "rope_paged_append_unchecked", stand_in)
    cache = nan_cache()
    with use_runtime(runtime), torch.no_grad(), cache.step(["s"], [3]):
        for layer, (q, k, v) in enumerate(layer_inputs(3, 0)):
            out = attention(q, k, v, kv_cache=cache, layer_id=layer, rope=rope_tables(64, D))
            assert torch.isfinite(out).all()
    assert len(calls) == LAYERS and cache.seq_len("s") == 3


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_generate_leaves_the_engine_able_to_serve(monkeypatch, overlap):
    prompts = [[1, 5, 9, 4], [7, 3]]
    want = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=2, overlap=overlap).generate(prompts, 6)
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=2, overlap=overlap)
    llm.reserve(prompts, 6)
    cache = llm.kv_cache
    before = state(cache)
    layer = llm.model.layers[1]
    calls = {"n": 0}
    forward = layer.forward

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the second decode step, after layer 0 appended
            raise ModelFailed("out of memory")
        return forward(*args, **kwargs)

    monkeypatch.setattr(layer, "forward", failing)
    with pytest.raises(ModelFailed):
        llm.generate(prompts, 6)
    assert state(cache) == before  # only the engine's pad sequence, the pool whole
    assert llm.generate(prompts, 6) == want
