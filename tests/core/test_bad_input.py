"""Bad arguments raise TypeError / ValueError naming the argument, before any work is done."""

import pytest
import torch

from astrai.extension.backend.attention import attention
from astrai.extension.backend.rotary import apply_rotary_emb
from astrai.extension.kv_cache import PagedKVCache

B, L, HQ, HKV, D = 2, 5, 8, 2, 32


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=torch.float32).to(dtype=dtype, device=device)


def good():
    return dict(q=t(B, L, HQ, D), k=t(B, 7, HKV, D), v=t(B, 7, HKV, D))


def with_(**changes):
    args = good()
    args.update(changes)
    return args


ATTENTION_CASES = {
    "q not a tensor": (with_(q=[1.0]), TypeError, r"^q must be a torch.Tensor"),
    "q rank": (with_(q=t(B, L, HQ * D)), ValueError, r"^q must be 4-D \[batch, seq, heads, head_dim\], got shape \(2, 5, 256\)"),
    "k rank": (with_(k=t(1, B, 7, HKV, D)), ValueError, r"^k must be 4-D"),
    "v rank": (with_(v=t(B, 7, HKV * D)), ValueError, r"^v must be 4-D"),
    "q empty": (with_(q=t(B, 0, HQ, D)), ValueError, r"^q has an empty dimension"),
    "q integer": (with_(q=torch.ones(B, L, HQ, D, dtype=torch.int32)), TypeError, r"^q must be float16, bfloat16"),
    "k dtype mix": (with_(k=t(B, 7, HKV, D, dtype=torch.float16)), TypeError, r"^k has dtype torch.float16 but q has torch.float32"),
    "v dtype mix": (with_(v=t(B, 7, HKV, D, dtype=torch.float64)), TypeError, r"^v has dtype torch.float64"),
    "k device": (with_(k=t(B, 7, HKV, D, device="meta")), ValueError, r"^k is on meta but q is on cpu"),
    "v device": (with_(v=t(B, 7, HKV, D, device="meta")), ValueError, r"^v is on meta"),
    "v shape": (with_(v=t(B, 6, HKV, D)), ValueError, r"^v has shape \(2, 6, 2, 32\) but k has \(2, 7, 2, 32\)"),
    "head dims": (with_(k=t(B, 7, HKV, 16), v=t(B, 7, HKV, 16)), ValueError, r"^k has head_dim 16 but q has head_dim 32"),
    "gqa ratio": (with_(k=t(B, 7, 3, D), v=t(B, 7, 3, D)), ValueError, r"^q has 8 heads, not a multiple of the 3 kv heads"),
    "batch": (with_(k=t(3, 7, HKV, D), v=t(3, 7, HKV, D)), ValueError, r"^k has batch 3 but q has batch 2"),
    "mask not tensor": (with_(mask=[[True]]), TypeError, r"^mask must be a torch.Tensor"),
    "mask dtype": (with_(mask=torch.ones(B, 7)), TypeError, r"^mask must be a bool tensor \(True = keep\), got dtype torch.float32"),
    "mask shape 2d": (with_(mask=torch.ones(B, 6, dtype=torch.bool)), ValueError,
                      r"^mask has shape \(2, 6\): expected \[batch, kv_len\] = \[2, 7\] or \[batch, q_len, kv_len\] = \[2, 5, 7\]"),
    "mask shape 3d": (with_(mask=torch.ones(B, 7, L, dtype=torch.bool)), ValueError, r"^mask has shape \(2, 7, 5\)"),
    "mask rank": (with_(mask=torch.ones(B, 1, L, 7, dtype=torch.bool)), ValueError, r"^mask has shape \(2, 1, 5, 7\)"),
    "mask device": (with_(mask=torch.ones(B, 7, dtype=torch.bool, device="meta")), ValueError, r"^mask is on meta"),
    "fwd value": (with_(fwd="train"), ValueError, r"^fwd must be None, 'decode' or 'prefill', got 'train'"),
    "fwd decode with q_len 5": (with_(fwd="decode"), ValueError, r"^fwd='decode' needs q with one token"),
    "is_causal type": (with_(is_causal="yes"), TypeError, r"^is_causal must be a bool or None, got str"),
    "layer_id without cache": (with_(layer_id=0), ValueError, r"^layer_id was given without kv_cache"),
    "kv_cache type": (with_(kv_cache={"k": None}, layer_id=0), TypeError, r"^kv_cache must be a PagedKVCache or None, got dict"),
}


@pytest.mark.parametrize("args, error, match", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_rejects(args, error, match):
    with pytest.raises(error, match=match):
        attention(**args)


def planned_cache(q_lens=(3, 3), dtype=torch.float32, layers=2):
    cache = PagedKVCache(layers, 16, 4, HKV, D, dtype=dtype)
    cache.k_pages.normal_()
    cache.v_pages.normal_()
    for s in range(len(q_lens)):
        cache.add_sequence(s)
    cache.plan(list(range(len(q_lens))), list(q_lens))
    return cache


def cached(cache, **changes):
    args = dict(q=t(2, 3, HQ, D), k=t(2, 3, HKV, D), v=t(2, 3, HKV, D), kv_cache=cache, layer_id=1)
    args.update(changes)
    return args


CACHE_CASES = {
    "layer_id missing": (dict(layer_id=None), ValueError, r"^layer_id is required with kv_cache"),
    "layer_id too large": (dict(layer_id=2), ValueError, r"^layer_id 2 is out of range: the cache holds 2 layers"),
    "layer_id negative": (dict(layer_id=-1), ValueError, r"^layer_id -1 is out of range"),
    "layer_id type": (dict(layer_id=1.0), TypeError, r"^layer_id must be an int, got float"),
    "cache dtype": (dict(q=t(2, 3, HQ, D, dtype=torch.float64), k=t(2, 3, HKV, D, dtype=torch.float64),
                         v=t(2, 3, HKV, D, dtype=torch.float64)), TypeError, r"^q has dtype torch.float64 but kv_cache stores torch.float32"),
    "cache heads": (dict(q=t(2, 3, HQ, D), k=t(2, 3, 4, D), v=t(2, 3, 4, D)), ValueError,
                    r"^k has 4 kv heads of head_dim 32 but kv_cache stores 2 kv heads of head_dim 32"),
    "q tokens": (dict(q=t(2, 4, HQ, D), k=t(2, 4, HKV, D), v=t(2, 4, HKV, D)), ValueError,
                 r"^q has shape \(2, 4, 8, 32\) but the cache's plan adds q_lens=\[3, 3\]"),
    "k layout": (dict(k=t(1, 6, HKV, D), v=t(1, 6, HKV, D)), ValueError, r"^k has shape \(1, 6, 2, 32\): with kv_cache"),
    "mask with cache": (dict(mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, r"^mask is not supported with kv_cache"),
    "decode with a prefill plan": (dict(fwd="decode"), ValueError, r"^fwd='decode' needs one new token per request"),
}


@pytest.mark.parametrize("changes, error, match", CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_attention_with_cache_rejects_before_writing(changes, error, match):
    cache = planned_cache()
    before = cache.k_pages.clone(), cache.v_pages.clone()
    with pytest.raises(error, match=match):
        attention(**cached(cache, **changes))
    assert torch.equal(cache.k_pages, before[0]) and torch.equal(cache.v_pages, before[1])


def test_ragged_plan_needs_packed_q():
    cache = planned_cache(q_lens=(2, 4))
    with pytest.raises(ValueError, match=r"q has shape \(2, 4, 8, 32\) .* expected \[1, 6, heads, head_dim\] \(packed\)$"):
        attention(**cached(cache, q=t(2, 4, HQ, D), k=t(2, 4, HKV, D), v=t(2, 4, HKV, D)))


def test_cache_without_plan():
    cache = PagedKVCache(1, 4, 4, HKV, D, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="kv_cache has no active plan"):
        attention(**cached(cache, layer_id=0))


ROTARY_CASES = {
    "x not a tensor": (lambda x, c, s: ([1.0], (c, s)), TypeError, r"^x must be a torch.Tensor"),
    "x rank": (lambda x, c, s: (x[0], (c, s)), ValueError, r"^x must be 4-D \[batch, seq, heads, head_dim\]"),
    "x empty": (lambda x, c, s: (x[:0], (c, s)), ValueError, r"^x has an empty dimension"),
    "x dtype": (lambda x, c, s: (x.to(torch.int64), (c, s)), TypeError, r"^x must be float16, bfloat16, float32 or float64"),
    "x odd head_dim": (lambda x, c, s: (x[..., :7], (c, s)), ValueError, r"^x has odd head_dim 7"),
    "freqs not a pair": (lambda x, c, s: (x, c), TypeError, r"^freqs must be a \(cos, sin\) pair"),
    "freqs of three": (lambda x, c, s: (x, (c, s, s)), TypeError, r"^freqs must be a \(cos, sin\) pair"),
    "cos not a tensor": (lambda x, c, s: (x, (1.0, s)), TypeError, r"^cos must be a torch.Tensor"),
    "cos dtype": (lambda x, c, s: (x, (c.double(), s)), TypeError, r"^cos must be float32, got torch.float64"),
    "sin dtype": (lambda x, c, s: (x, (c, s.bfloat16())), TypeError, r"^sin must be float32"),
    "cos shape": (lambda x, c, s: (x, (c[:3], s)), ValueError, r"^cos has shape \(3, 8\): expected \[seq, head_dim // 2\] = \[5, 8\]"),
    "sin shape": (lambda x, c, s: (x, (c, s.t())), ValueError, r"^sin has shape \(8, 5\)"),
    "sin device": (lambda x, c, s: (x, (c, s.to("meta"))), ValueError, r"^sin is on meta but x is on cpu"),
}


@pytest.mark.parametrize("make, error, match", ROTARY_CASES.values(), ids=ROTARY_CASES.keys())
def test_rotary_rejects(make, error, match):
    x = t(2, 5, 3, 16)
    cos, sin = t(5, 8), t(5, 8)
    with pytest.raises(error, match=match):
        apply_rotary_emb(*make(x, cos, sin))
