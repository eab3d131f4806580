"""The eager host path's launchers on the GPU: outputs from the launchers' allocator are new
tensors on the right device, every call's own, and repeated planned calls (the rotary
launcher, the paged decode runner) stay correct against float64 references."""

from __future__ import annotations

import pytest
import torch
from reference import attention_ref
from rotary_reference import rope_reference, rope_tables

from astrai.extension import PagedKVCache, abi, apply_rotary_emb, attention

pytestmark = pytest.mark.gpu


def test_the_allocator_gives_tensors_of_the_layout_asked_on_the_current_device():
    alloc = abi.empty_allocator(torch.device("cuda", torch.cuda.current_device()))
    a = alloc((3, 1, 4, 128), (512, 512, 128, 1), torch.bfloat16)
    b = alloc((3, 1, 4, 128), (512, 512, 128, 1), torch.bfloat16)
    for t in (a, b):
        assert t.device == torch.device("cuda", torch.cuda.current_device())
        assert (t.shape, t.stride(), t.dtype) == ((3, 1, 4, 128), (512, 512, 128, 1), torch.bfloat16)
    assert a.data_ptr() != b.data_ptr()


def test_repeated_rotary_calls_return_their_own_correct_outputs():
    g = torch.Generator().manual_seed(21)
    tables = rope_tables(4096, 128)
    cos, sin = (t.cuda() for t in tables)
    xs = [torch.randn(64, 1, 32, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4)]
    with torch.inference_mode():
        outs = [apply_rotary_emb(x, (cos, sin)) for x in xs]  # the first plans, the others only launch
    assert len({o.data_ptr() for o in outs}) == len(outs)
    for x, out in zip(xs, outs):
        ref = rope_reference(x, *tables)
        torch.testing.assert_close(out.double().cpu(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_repeated_decode_calls_of_a_plan_return_their_own_correct_outputs():
    g = torch.Generator().manual_seed(22)
    hq, hkv, d, history = 32, 8, 128, 300
    cache = PagedKVCache(2, 64, 16, hkv, d, dtype=torch.bfloat16, device="cuda")
    cache.add_sequence(0)
    keys = torch.randn(1, history, hkv, d, generator=g).to("cuda", torch.bfloat16)
    values = torch.randn(1, history, hkv, d, generator=g).to("cuda", torch.bfloat16)
    cache.plan([0], [history])
    for layer in range(2):
        cache.append(layer, keys, values)
    cache.plan([0], [1])
    k_new = torch.randn(1, 1, hkv, d, generator=g).to("cuda", torch.bfloat16)
    v_new = torch.randn(1, 1, hkv, d, generator=g).to("cuda", torch.bfloat16)
    qs = [torch.randn(1, 1, hq, d, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    with torch.inference_mode():
        outs = [attention(q, k_new, v_new, kv_cache=cache, layer_id=i % 2) for i, q in enumerate(qs)]
    assert len({o.data_ptr() for o in outs}) == len(outs)
    k_all, v_all = torch.cat([keys, k_new], 1), torch.cat([values, v_new], 1)
    for q, out in zip(qs, outs):
        ref = attention_ref(q, k_all, v_all, is_causal=True)
        torch.testing.assert_close(out.double().cpu(), ref, rtol=2**-6, atol=2**-6)
