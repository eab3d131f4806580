"""The torch attention fallback against the float64 reference (dense inputs, no cache)."""

import pytest
import torch
from reference import attention_ref, tolerance

from astrai.extension.backend.attention import ATTN_BACKEND, attention, attn_backend


def qkv(b, lq, lkv, hq, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, lkv, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, lkv, hkv, d, generator=g).to(dtype)
    return q, k, v


def run(*args, **kwargs):
    with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
        return attention(*args, **kwargs)


def check(out, q, k, v, mask=None, is_causal=False):
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, mask, is_causal), **tolerance(q.dtype))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (4, 4)], ids=["gqa32:8", "gqa8:1", "mha"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_matches_reference(head_dim, heads, is_causal):
    q, k, v = qkv(2, 19, 19, *heads, head_dim, seed=head_dim + heads[0])
    check(run(q, k, v, is_causal=is_causal), q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("lq, lkv", [(1, 37), (5, 37), (37, 37), (37, 5)])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa32:8", "gqa8:1"])
def test_causal_is_bottom_right_aligned(lq, lkv, heads):
    q, k, v = qkv(2, lq, lkv, *heads, 64, seed=lq * 100 + lkv)
    out = run(q, k, v, is_causal=True)
    check(out, q, k, v, is_causal=True)
    if lq > lkv:  # rows i < lq - lkv see no key at all: zeros, not NaN
        assert (out[:, : lq - lkv] == 0).all()
        assert out[:, lq - lkv :].abs().sum() > 0


@pytest.mark.parametrize("mask_ndim", [2, 3])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)], ids=["gqa32:8", "gqa8:1"])
def test_masks(mask_ndim, is_causal, heads):
    b, lq, lkv = 3, 11, 23
    q, k, v = qkv(b, lq, lkv, *heads, 64, seed=mask_ndim)
    g = torch.Generator().manual_seed(7)
    shape = (b, lkv) if mask_ndim == 2 else (b, lq, lkv)
    mask = torch.rand(shape, generator=g) > 0.4
    check(run(q, k, v, mask=mask, is_causal=is_causal), q, k, v, mask, is_causal)


def test_fully_masked_rows_are_zero_and_have_no_nan_gradient():
    q, k, v = qkv(2, 6, 9, 8, 2, 64, dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.rand(2, 6, 9, generator=torch.Generator().manual_seed(3)) > 0.5
    mask[0, 2] = False
    mask[1, :, :] = False
    mask[1, 4, 3] = True
    out = run(q, k, v, mask=mask)
    check(out, q, k, v, mask)
    assert (out[0, 2] == 0).all() and (out[1, :4] == 0).all() and (out[1, 5] == 0).all()
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[0, 2] == 0).all()


def test_gradient_passes_gradcheck():
    q, k, v = qkv(1, 5, 7, 4, 2, 16, dtype=torch.float64, seed=11)
    mask = torch.rand(1, 5, 7, generator=torch.Generator().manual_seed(5)) > 0.3
    mask[..., 0] = True
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda *t: run(*t, mask=mask, is_causal=True), inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    q, k, v = qkv(2, 9, 13, 8, 2, 128, dtype=dtype, seed=2)
    check(run(q, k, v, is_causal=True), q, k, v, is_causal=True)


def test_strided_inputs_bhld_views():
    """A [B, H, L, D] tensor passed as a permuted [B, L, H, D] view gives the same result."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 10, 64, generator=g).transpose(1, 2)
    k = torch.randn(2, 2, 12, 64, generator=g).transpose(1, 2)
    v = torch.randn(2, 2, 12, 64, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    check(run(q, k, v, is_causal=True), q, k, v, is_causal=True)


def test_default_resolution_on_cpu_is_torch_native():
    q, k, v = qkv(1, 4, 4, 4, 2, 32)
    check(attention(q, k, v), q, k, v)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_garbage_in_padding_does_not_leak(poison):
    """Keys/values that every query masks out (padding) are never part of the result."""
    q, k, v = qkv(2, 4, 9, 8, 2, 64, seed=8)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, :2] = False
    k[0, 6:] = poison
    v[0, 6:] = poison
    v[1, :2] = poison
    for m in (mask, mask[:, None, :].expand(2, 4, 9).clone()):
        out = run(q, k, v, mask=m)
        assert torch.isfinite(out).all()
        check(out, q, k, v, m)
