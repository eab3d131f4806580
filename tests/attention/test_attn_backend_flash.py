"""The flash-attn backend's capability checks and its dense / paged wiring, through a stand-in module."""

import importlib
import math
import random
import sys
import types

import pytest
import torch
from reference import attention_ref, random_qkv as qkv, tolerance

from astrai.extension.backend.attention import AttentionCall, AttentionPolicy, TorchNativeBackend, flash
from astrai.extension.kv_cache import PagedKVCache


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)


def flash_attn_stand_in(calls):
    """A module providing ``flash_attn_varlen_func``: records its arguments, computes with the reference."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False):
        calls.append(dict(q=q.shape, k=k.shape, cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_k.tolist(),
                          max_q=max_seqlen_q, max_k=max_seqlen_k, dropout_p=dropout_p, scale=softmax_scale,
                          causal=causal))
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        out = torch.empty_like(q)
        for b in range(len(cu_seqlens_q) - 1):
            rq = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
            rk = slice(cu_seqlens_k[b], cu_seqlens_k[b + 1])
            out[rq] = attention_ref(q[rq][None], k[rk][None], v[rk][None], is_causal=causal)[0].to(q.dtype)
        return out

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


@pytest.fixture
def stand_in(monkeypatch):
    """``flash_attn`` replaced in ``sys.modules`` and the flash backend module re-imported over it."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_stand_in(calls))
    importlib.reload(flash)
    yield calls
    monkeypatch.undo()
    importlib.reload(flash)
    assert flash._flash_attn is None or flash._flash_attn.__name__ == "flash_attn"


CUDA_BF16 = AttentionCall(device=torch.device("cuda:0"), dtype=torch.bfloat16, head_dim=128, q_heads=32, kv_heads=8, mode="prefill",
                          fwd=None, causal=True, mask_ndim=0, paged=False, page_size=None, needs_grad=True)


def test_flash_capability_with_the_module(stand_in):
    backend = flash.FlashAttnBackend()
    assert backend.module is sys.modules["flash_attn"]
    assert backend.check(CUDA_BF16) is None
    assert backend.check(CUDA_BF16._replace(paged=True, page_size=16, mode="decode")) is None
    for change, reason in [
        (dict(device=torch.device("cpu")), "CUDA tensors only"),
        (dict(dtype=torch.float32), "float16 or bfloat16"),
        (dict(mask_ndim=2), "no explicit mask"),
        (dict(head_dim=264), "multiple of 8 up to 256"),
        (dict(head_dim=36), "multiple of 8"),
    ]:
        assert reason in backend.check(CUDA_BF16._replace(**change))


def test_flash_without_the_module():
    backend = flash.FlashAttnBackend(module=None, unavailable="flash_attn is not installed")
    assert backend.check(CUDA_BF16) == "flash_attn is not installed"


def cpu_flash():
    """The (re-imported) flash backend, its device check answered as if CPU tensors were on CUDA."""

    class CpuFlash(flash.FlashAttnBackend):
        def check(self, call):
            return super().check(call._replace(device=torch.device("cuda:0")))

    return CpuFlash()


@pytest.mark.parametrize("lq, lkv, causal", [(7, 7, True), (3, 11, True), (9, 5, False), (1, 13, False)])
def test_flash_dense_wiring(stand_in, runtime, lq, lkv, causal):
    pol = AttentionPolicy((cpu_flash(), TorchNativeBackend()))
    q, k, v = qkv(b=3, lq=lq, lkv=lkv, hq=8, hkv=2, d=64, dtype=torch.bfloat16, seed=lq)
    out = pol(q, k, v, is_causal=causal)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, is_causal=causal), **tolerance(torch.bfloat16))
    (call,) = stand_in
    assert call == dict(q=(3 * lq, 8, 64), k=(3 * lkv, 2, 64), cu_q=list(range(0, 3 * lq + 1, lq)),
                        cu_k=list(range(0, 3 * lkv + 1, lkv)), max_q=lq, max_k=lkv, dropout_p=0.0,
                        scale=1 / math.sqrt(64), causal=causal)


def test_flash_declines_masks_so_torch_runs(stand_in, runtime):
    pol = AttentionPolicy((cpu_flash(), TorchNativeBackend()))
    q, k, v = qkv(dtype=torch.bfloat16)
    pol(q, k, v, mask=torch.rand(2, 6) > 0.5)
    assert stand_in == []
    (decision,) = runtime.explain("attention")
    assert decision.chosen == "torch_native" and "no explicit mask" in decision.trace[0].reason


def test_flash_paged_wiring(stand_in, runtime):
    order = list(range(40))
    random.Random(0).shuffle(order)
    cache = PagedKVCache(2, 40, 16, 2, 64, dtype=torch.bfloat16, page_order=order)
    pol = AttentionPolicy((cpu_flash(), TorchNativeBackend()))
    gen = torch.Generator().manual_seed(0)
    for s in range(3):
        cache.add_sequence(s)
    history = {s: (torch.empty(0, 2, 64, dtype=torch.bfloat16),) * 2 for s in range(3)}
    for q_lens in ([70, 10, 130], [1, 1, 1]):
        plan = cache.plan([0, 1, 2], q_lens)
        q = torch.randn(1, plan.total_q, 8, 64, generator=gen).bfloat16()
        k = torch.randn(1, plan.total_q, 2, 64, generator=gen).bfloat16()
        v = torch.randn(1, plan.total_q, 2, 64, generator=gen).bfloat16()
        cache.append(0, k, v)  # every layer writes the step (the test attends in layer 1)
        out = pol(q, k, v, kv_cache=cache, layer_id=1)
        for b, n in enumerate(q_lens):
            rows = slice(plan.qo_indptr[b], plan.qo_indptr[b + 1])
            history[b] = (torch.cat([history[b][0], k[0, rows]]), torch.cat([history[b][1], v[0, rows]]))
            expected = attention_ref(q[:, rows], history[b][0][None], history[b][1][None], is_causal=True)
            torch.testing.assert_close(out[:, rows].double(), expected, **tolerance(torch.bfloat16))
    prefill, decode = stand_in
    assert prefill["cu_q"] == [0, 70, 80, 210] and prefill["cu_k"] == [0, 70, 80, 210] and prefill["causal"]
    assert (prefill["max_q"], prefill["max_k"]) == (130, 130)
    assert decode["cu_q"] == [0, 1, 2, 3] and decode["cu_k"] == [0, 71, 82, 213] and decode["max_k"] == 131
