"""The policy remembers the validated description of a repeated call shape (dense, or per
batch plan for a cache); a remembered shape must still reject what validation rejects, follow
grad mode and, for the CUDA decode runner, the batch's current plan."""

from __future__ import annotations

import pytest
import torch
from reference import attention_ref, tolerance
from test_attention_launch import HKV, HQ, D, FakeAppendingModule, decode_cache, fake_module

from astrai.extension.backend.attention import AttentionPolicy, TorchNativeBackend
from astrai.extension.backend.attention.cuda import CudaBackend


def qkv(seed=0, lq=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, lq, 8, 64, generator=g), torch.randn(2, 5, 2, 64, generator=g), torch.randn(2, 5, 2, 64, generator=g)


def test_repeated_shapes_reuse_the_description_and_stay_correct():
    policy = AttentionPolicy([TorchNativeBackend()])
    for seed in range(3):
        q, k, v = qkv(seed)
        torch.testing.assert_close(policy(q, k, v).double(), attention_ref(q, k, v), **tolerance(torch.float32))
    assert len(policy._dense_calls) == 1


def test_a_remembered_shape_still_rejects_bad_arguments():
    policy = AttentionPolicy([TorchNativeBackend()])
    q, k, v = qkv()
    policy(q, k, v, is_causal=True)
    with pytest.raises(TypeError, match="is_causal must be a bool or None, got int"):
        policy(q, k, v, is_causal=1)  # equal to True as a dict key
    with pytest.raises(ValueError, match="fwd must be None, 'decode' or 'prefill'"):
        policy(q, k, v, fwd="decoder")
    with pytest.raises(ValueError, match="k has batch 1 but q has batch 2"):
        policy(q, k[:1], v[:1])


def test_grad_mode_is_part_of_the_remembered_description():
    policy = AttentionPolicy([TorchNativeBackend()])
    q, k, v = qkv(lq=3)
    q.requires_grad_()
    with torch.no_grad():
        assert not policy(q, k, v).requires_grad
    out = policy(q, k, v)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_cache_calls_are_remembered_per_plan_and_still_validated():
    from astrai.extension.kv_cache import PagedKVCache

    policy = AttentionPolicy([TorchNativeBackend()])
    cache = PagedKVCache(2, 16, 4, 2, 64, dtype=torch.float32)
    cache.add_sequence("a")
    plan = cache.plan(["a"], [3])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 8, 64, generator=g), torch.randn(1, 3, 2, 64, generator=g)
    for layer in (0, 1):
        policy(q, k, k, kv_cache=cache, layer_id=layer)
    assert sum(1 for key in plan.launches if key[0] == "described") == 1  # every layer shares it
    with pytest.raises(ValueError, match="layer_id 2 is out of range"):
        policy(q, k, k, kv_cache=cache, layer_id=2)
    with pytest.raises(ValueError, match="layer_id -1 is out of range"):
        policy(q, k, k, kv_cache=cache, layer_id=-1)
    with pytest.raises(TypeError, match="layer_id must be an int, got bool"):
        policy(q, k, k, kv_cache=cache, layer_id=True)
    with pytest.raises(TypeError, match="layer_id must be an int, got str"):
        policy(q, k, k, kv_cache=cache, layer_id="0")
    with pytest.raises(ValueError, match="q has shape"):
        policy(q[:, :2], k[:, :2], k[:, :2], kv_cache=cache, layer_id=0)
    with pytest.raises(ValueError, match="fwd='decode' needs one new token per request"):
        policy(q, k, k, kv_cache=cache, layer_id=0, fwd="decode")
    decode = cache.plan(["a"], [1])
    assert not any(key[0] == "described" for key in decode.launches if isinstance(key, tuple))
    with pytest.raises(ValueError, match="q has shape"):  # the new batch adds one token
        policy(q, k, k, kv_cache=cache, layer_id=0)


def test_a_remembered_dense_shape_runs_any_layout():
    """Dense calls are remembered without their strides: the runner must not depend on them."""
    policy = AttentionPolicy([TorchNativeBackend()])
    for seed, causal in ((0, False), (1, True), (2, False)):
        q, k, v = qkv(seed, lq=5)
        k, v = k[:, :5], v[:, :5]
        layouts = [(q, k, v), tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)),
                   tuple(t.transpose(0, 3).contiguous().transpose(0, 3) for t in (q, k, v))]
        for q_, k_, v_ in layouts:
            torch.testing.assert_close(policy(q_, k_, v_, is_causal=causal).double(),
                                       attention_ref(q, k, v, is_causal=causal), **tolerance(torch.float32))
    assert len(policy._dense_calls) == 2


class _AppendingModule(FakeAppendingModule):
    APPEND_LAST = True  # the decode launch appends the step's keys/values itself, like the real module


class _CudaOnTheCpu(CudaBackend):
    """The CUDA backend for CPU tensors: its capability check passes, its launches go to a fake module."""

    def check(self, call):
        return None


def test_a_remembered_cuda_decode_call_is_validated_and_follows_the_batch_plan(monkeypatch):
    module = fake_module(monkeypatch, _AppendingModule())
    policy = AttentionPolicy([_CudaOnTheCpu()])
    cache, plan = decode_cache([6, 3])
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, HQ, D, generator=g).bfloat16()
    k, v = (torch.randn(2, 1, HKV, D, generator=g).bfloat16() for _ in range(2))
    for layer in (0, 1, 2):
        out = policy(q, k, v, kv_cache=cache, layer_id=layer)
        args = module.launches[-1]
        assert args[0] == (q.data_ptr(), (2, 1, HQ, D), q.stride(), 2)
        assert args[1][0] == cache.k_cache(layer).data_ptr() and args[3][0] == out.data_ptr()
        assert args[6][0] == plan.kv_lens.data_ptr() and args[-4][0] == k.data_ptr() and args[-3][0] == v.data_ptr()
    assert len(module.launches) == 3 and out.shape == q.shape and out.dtype == q.dtype
    described = [d for key, d in plan.launches.items() if key[0] == "described"]
    assert len(described) == 1 and described[0].selection[2] is not None  # the backend's eager runner ran them
    launches = len(module.launches)
    with pytest.raises(TypeError, match="q has dtype torch.float16 but kv_cache stores torch.bfloat16"):
        policy(q.half(), k.half(), v.half(), kv_cache=cache, layer_id=0)
    with pytest.raises(TypeError, match="v has dtype torch.float32 but q has torch.bfloat16"):
        policy(q, k, v.float(), kv_cache=cache, layer_id=0)
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        policy(q, k.to("meta"), v, kv_cache=cache, layer_id=0)
    with pytest.raises(ValueError, match="q has shape"):
        policy(q[:1], k[:1], v[:1], kv_cache=cache, layer_id=0)
    with pytest.raises(ValueError, match="layer_id 3 is out of range"):
        policy(q, k, v, kv_cache=cache, layer_id=3)
    assert len(module.launches) == launches  # nothing launched for a rejected call
    # the next batch: same shapes, a new plan; its launches read the new plan's page table
    cache.add_sequence(2)
    cache.plan([2], [5])
    step = cache.plan([0, 1], [1, 1])
    assert step is not plan and step.kv_lens.data_ptr() != plan.kv_lens.data_ptr()
    policy(q, k, v, kv_cache=cache, layer_id=1)
    assert module.launches[-1][6][0] == step.kv_lens.data_ptr()
    assert module.launches[-1][4][0] == step.kv_indptr.data_ptr()


class _Fp8AppendingModule(_AppendingModule):
    """Records each decode launch's keywords too (the FP8 layer's kv_scales)."""

    def __init__(self):
        super().__init__()
        self.keywords = []
        record = self.attn_paged_decode

        def attn_paged_decode(*args, **kwargs):
            self.keywords.append(kwargs)
            record(*args, **kwargs)

        self.attn_paged_decode = attn_paged_decode


def test_a_remembered_fp8_decode_call_passes_each_layers_scales(monkeypatch):
    """The eager runner serves FP8 caches too: each call passes its layer's scales, calibrated by
    the layer's first append as append() calibrates them."""
    from astrai.extension.kv_cache import PagedKVCache

    module = fake_module(monkeypatch, _Fp8AppendingModule())
    policy = AttentionPolicy([_CudaOnTheCpu()])
    cache = PagedKVCache(3, 16, 4, HKV, D, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                         kv_scale_granularity="head")
    cache.add_sequence(0)
    cache.plan([0], [1])  # the first token
    plan = cache.plan([0], [1])
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, HQ, D, generator=g).bfloat16()
    k, v = (torch.randn(1, 1, HKV, D, generator=g).bfloat16() * 3 for _ in range(2))
    cache.set_kv_scales(2, torch.full((HKV,), 0.5), torch.full((HKV,), 0.25))
    for layer in (0, 1, 2):
        assert (cache.kv_scales(layer) is None) == (layer < 2)
        policy(q, k, v, kv_cache=cache, layer_id=layer)
        k_scale, v_scale = cache.kv_scales(layer)
        assert [s[0] for s in module.keywords[-1]["kv_scales"]] == [k_scale.data_ptr(), v_scale.data_ptr()]
        assert module.launches[-1][1][0] == cache.k_cache(layer).data_ptr()
    torch.testing.assert_close(cache.kv_scales(0)[0], k.float().abs().amax(dim=(0, 1, 3)) / 448)  # calibrated on k
    assert cache.kv_scales(2)[0].tolist() == [0.5] * HKV  # set before: kept
    described = [d for key, d in plan.launches.items() if key[0] == "described"]
    assert len(described) == 1 and described[0].selection[2] is not None  # the eager runner ran them
