"""``attention(..., kv_cache=cache, layer_id=i, rope=(cos, sin))`` on the torch path and with a
stand-in fused kernel: q and the new k rotated at their cache positions, k (rotated) and v in
their pages, against rotary done by hand at independently computed positions."""

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest
from reference import tolerance
from rotary_reference import rope_reference, rope_tables

from astrai.extension import BatchPlan, PagedKVCache, apply_rotary_emb_qk, attention
from astrai.extension.backend import rope_paged, rotary
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

HQ, HKV, D = 4, 2, 32
STEPS = ([5, 3, 9], [1, 1, 1], [1, 1, 1], [2, 1, 4])  # prefill, decode, decode, chunked


def caches(dtype=torch.float32, layers=2):
    made = [PagedKVCache(layers, 32, 4, HKV, D, dtype=dtype, page_order=list(range(31, -1, -1))) for _ in range(2)]
    for cache in made:
        for seq in "abc":
            cache.add_sequence(seq)
    return made


def expected_positions(lengths_so_far, q_lens):
    return torch.tensor([p for done, n in zip(lengths_so_far, q_lens) for p in range(done, done + n)])


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_rope_equals_rotary_then_attention(dtype, interleaved):
    fused, by_hand = caches(dtype)
    freqs = rope_tables(64, 24)  # partial rotary: 24 of 32 channels
    g = torch.Generator().manual_seed(7)
    done = [0, 0, 0]
    for q_lens in STEPS:
        fused.plan(list("abc"), q_lens=q_lens)
        by_hand.plan(list("abc"), q_lens=q_lens)
        pos = expected_positions(done, q_lens)
        total = sum(q_lens)
        for layer in range(2):
            q = torch.randn(1, total, HQ, D, generator=g).to(dtype)
            k, v = (torch.randn(1, total, HKV, D, generator=g).to(dtype) for _ in range(2))
            out = attention(q, k, v, kv_cache=fused, layer_id=layer, rope=freqs, rope_interleaved=interleaved)
            q_rot = rope_reference(q, *freqs, pos, interleaved).to(dtype)
            k_rot = rope_reference(k, *freqs, pos, interleaved).to(dtype)
            want = attention(q_rot, k_rot, v, kv_cache=by_hand, layer_id=layer)
            torch.testing.assert_close(out.double(), want.double(), **tolerance(dtype))
            torch.testing.assert_close(fused.gather_flat(layer)[1], by_hand.gather_flat(layer)[1], atol=0, rtol=0)
            torch.testing.assert_close(fused.gather_flat(layer)[0].double(), by_hand.gather_flat(layer)[0].double(),
                                       **tolerance(dtype))
        done = [a + b for a, b in zip(done, q_lens)]


def test_token_positions_follow_the_plan():
    cache, _ = caches()
    done = [0, 0, 0]
    for q_lens in STEPS:
        plan = cache.plan(list("abc"), q_lens=q_lens)
        assert plan.token_positions.tolist() == expected_positions(done, q_lens).tolist()
        assert plan.token_positions is plan.token_positions  # once per plan
        assert plan.token_positions.tolist() == BatchPlan.token_positions.func(plan).tolist()  # staged = derived
        done = [a + b for a, b in zip(done, q_lens)]


def test_without_rope_nothing_changes():
    one, two = caches()
    for cache in (one, two):
        cache.plan(list("abc"), q_lens=[3, 2, 1])
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 6, HQ, D, generator=g), torch.randn(1, 6, HKV, D, generator=g), torch.randn(1, 6, HKV, D)
    torch.testing.assert_close(attention(q, k, v, kv_cache=one, layer_id=0),
                               attention(q, k, v, kv_cache=two, layer_id=0, rope=None), atol=0, rtol=0)


BAD = {
    "no cache": (dict(kv_cache=None), ValueError, r"^rope: the fused rotary \+ cache write needs kv_cache"),
    "cos dtype": (dict(rope=(torch.ones(64, 16, dtype=torch.float64), torch.ones(64, 16))), TypeError, r"^cos must be float32"),
    "rotary_dim": (dict(rope=(torch.ones(64, 17), torch.ones(64, 17))), ValueError, r"^cos has 17 columns"),
    "k heads": (dict(k=torch.randn(1, 6, 3, D)), ValueError, r"^k has shape \(1, 6, 3, 32\)"),
    "v dtype": (dict(v=torch.randn(1, 6, HKV, D).double()), TypeError, r"^v has dtype torch.float64"),
    "positions past the table": (dict(rope=rope_tables(2, 32)), ValueError, r"^positions must lie in \[0, 2\)"),
}


@pytest.mark.parametrize("override, error, match", BAD.values(), ids=BAD.keys())
def test_bad_input_raises_before_any_write(override, error, match):
    cache, _ = caches()
    cache.plan(list("abc"), q_lens=[3, 2, 1])
    before = cache.k_pages.clone(), cache.v_pages.clone()
    args = dict(q=torch.randn(1, 6, HQ, D), k=torch.randn(1, 6, HKV, D), v=torch.randn(1, 6, HKV, D), kv_cache=cache,
                layer_id=1, rope=rope_tables(64, 32))
    args.update(override)
    with pytest.raises(error, match=match):
        attention(**args)
    assert torch.equal(cache.k_pages.nan_to_num(7.0), before[0].nan_to_num(7.0))
    assert torch.equal(cache.v_pages.nan_to_num(7.0), before[1].nan_to_num(7.0))


def test_one_fused_launch_per_layer_with_the_kernel(monkeypatch):
    """With the plugin usable the whole step is one call of the fused op: its arguments are the
    layer's pages, the plan's slots and the tokens' positions."""
    calls = []

    def stand_in(q, k, v, k_cache, v_cache, cos, sin, positions, slots, interleaved):
        calls.append((positions.tolist(), slots.tolist(), interleaved))
        q_rot, k_rot = apply_rotary_emb_qk(q, k, (cos, sin), positions=positions, interleaved=interleaved)
        rows = k_cache.shape[0] * k_cache.shape[1]
        k_cache.view(rows, HKV, D)[slots] = k_rot
        v_cache.view(rows, HKV, D)[slots] = v
        return q_rot

    ops = {"rope_paged_append": {"module": "fake_rotary_module", "abi": 1, "dtypes": ["float32"]}}
    runtime = Runtime(Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=ops))), importer=fake_module))
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(rope_paged.ops_rope_paged, "rope_paged_append_unchecked", stand_in)
    fused, by_hand = caches()
    freqs = rope_tables(64, 32)
    g = torch.Generator().manual_seed(9)
    with use_runtime(runtime), torch.no_grad():
        for cache in (fused, by_hand):
            cache.plan(list("abc"), q_lens=[2, 1, 3])
        q, k, v = torch.randn(1, 6, HQ, D, generator=g), torch.randn(1, 6, HKV, D, generator=g), torch.randn(1, 6, HKV, D)
        out = attention(q, k, v, kv_cache=fused, layer_id=1, rope=freqs, rope_interleaved=False)
    assert calls == [([0, 1, 0, 0, 1, 2], fused.active_plan.write_index.tolist(), False)]
    pos = expected_positions([0, 0, 0], [2, 1, 3])
    q_rot, k_rot = (rope_reference(t, *freqs, pos, False).float() for t in (q, k))
    want = attention(q_rot, k_rot, v, kv_cache=by_hand, layer_id=1)
    torch.testing.assert_close(out, want, **tolerance(torch.float32))
