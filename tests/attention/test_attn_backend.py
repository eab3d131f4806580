"""Attention backend selection: precedence, strictness and caching (flash-attn: test_attn_backend_flash.py)."""

import threading

import pytest
import torch
from fakes import entry_points
from reference import attention_ref, random_qkv as qkv, tolerance

from astrai.extension.backend import attention as attn
from astrai.extension.backend.attention import (
    ATTN_BACKEND,
    AttentionBackend,
    AttentionCall,
    AttentionPolicy,
    TorchNativeBackend,
    attention,
    attn_backend,
)
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.registry import Registry
from astrai.extension.resolver import BackendUnavailableError
from astrai.extension.runtime import Runtime, use_runtime


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)


class Recording(AttentionBackend):
    """A backend that can run everything (unless told why not) and records what it ran."""

    def __init__(self, name, reason=None):
        self.name, self.reason = name, reason
        self.checks, self.runs = 0, []

    def check(self, call):
        self.checks += 1
        return self.reason

    def fwd_decode(self, q, k, v, **kw):
        self.runs.append("decode")
        return TorchNativeBackend().fwd_decode(q, k, v, **kw)

    def fwd_prefill(self, q, k, v, **kw):
        self.runs.append("prefill")
        return TorchNativeBackend().fwd_prefill(q, k, v, **kw)


def policy(cuda=None, flash_reason=None):
    backends = (Recording("cuda", cuda), Recording("flash", flash_reason), Recording("torch_native"))
    return AttentionPolicy(backends), {b.name: b for b in backends}


# -- names and parsing ------------------------------------------------------------------


def test_backend_names():
    assert [b.value for b in ATTN_BACKEND] == ["cuda", "flash", "torch_native"]
    assert str(ATTN_BACKEND.TORCH_NATIVE) == "torch_native"
    assert [b.name for b in attn.default_policy.backends] == ["cuda", "flash", "torch_native"]


def test_attn_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"backend='triton' is not an attention backend: valid values are cuda, flash, torch_native"):
        with attn_backend("triton"):
            pass


def test_env_rejects_unknown_names(runtime, monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "sdpa")
    with pytest.raises(ValueError, match=r"ASTR_BACKEND='sdpa' is not an attention backend: valid values are cuda, flash, torch_native"):
        attention(*qkv())


def test_attn_backend_accepts_strings_and_nests():
    with attn_backend("FLASH") as outer:
        assert outer is ATTN_BACKEND.FLASH and attn._explicit.get() is ATTN_BACKEND.FLASH
        with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
            assert attn._explicit.get() is ATTN_BACKEND.TORCH_NATIVE
            with attn_backend(None):
                assert attn._explicit.get() is None
        assert attn._explicit.get() is ATTN_BACKEND.FLASH
    assert attn._explicit.get() is None


def test_selection_is_per_thread():
    seen = []
    with attn_backend(ATTN_BACKEND.CUDA):
        thread = threading.Thread(target=lambda: seen.append(attn._explicit.get()))
        thread.start()
        thread.join()
    assert seen == [None]


# -- precedence -------------------------------------------------------------------------


def test_default_priority(runtime):
    pol, b = policy()
    pol(*qkv())
    assert b["cuda"].runs == ["prefill"] and not b["torch_native"].runs
    pol, b = policy(cuda="no plugin")
    pol(*qkv(lq=1), fwd="decode")
    assert b["flash"].runs == ["decode"]
    (decision, *_) = runtime.explain("attention")
    assert decision.source == "default"


def test_explicit_is_strict(runtime):
    pol, b = policy(cuda="astrai-attention is not installed")
    with attn_backend(ATTN_BACKEND.CUDA):
        with pytest.raises(BackendUnavailableError, match="'cuda' was requested .* astrai-attention is not installed"):
            pol(*qkv())
    assert not any(x.runs for x in b.values())
    with attn_backend("torch_native"):
        pol(*qkv())
    assert b["torch_native"].runs == ["prefill"] and not b["cuda"].runs


def test_env_prefers_then_falls_back(runtime, monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    pol, b = policy()
    pol(*qkv())
    assert b["torch_native"].runs == ["prefill"]
    monkeypatch.setenv("ASTR_BACKEND", "flash")
    pol, b = policy(flash_reason="flash_attn is not installed")
    pol(*qkv())
    assert b["cuda"].runs == ["prefill"]  # flash preferred but incapable: the default order follows
    decision = [d for d in runtime.explain("attention") if d.chosen == "cuda"][0]
    assert decision.source == "env"
    assert [(e.candidate, e.accepted) for e in decision.trace][:2] == [("flash", False), ("cuda", True)]


def test_explicit_beats_env(runtime, monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "cuda")
    pol, b = policy()
    with attn_backend(ATTN_BACKEND.FLASH):
        pol(*qkv())
    assert b["flash"].runs == ["prefill"] and not b["cuda"].runs


def test_strict_failure_leaves_the_cache_untouched(runtime):
    cache = PagedKVCache(1, 8, 4, 2, 32, dtype=torch.float32)
    cache.k_pages.normal_()
    before = cache.k_pages.clone()
    cache.add_sequence(0)
    cache.plan([0], [6])
    q, k, v = qkv(b=1)
    with attn_backend("flash"), pytest.raises(BackendUnavailableError):
        attention(q, k, v, kv_cache=cache, layer_id=0)  # the real flash backend rejects CPU tensors
    assert torch.equal(cache.k_pages, before)


def test_real_backends_on_cpu(runtime, monkeypatch):
    q, k, v = qkv()
    out = attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, is_causal=True), **tolerance(torch.float32))
    (decision,) = runtime.explain("attention")
    assert decision.chosen == "torch_native" and decision.source == "default"
    rejected = {e.candidate: e.reason for e in decision.trace if not e.accepted}
    assert "flash" in rejected
    monkeypatch.setenv("ASTR_BACKEND", "flash")
    attention(q, k, v)  # env falls back instead of raising
    with attn_backend("flash"), pytest.raises(BackendUnavailableError, match="'flash' was requested"):
        attention(q, k, v)


class BreaksOnFirstUse(Recording):
    """Capable until its first run fails the way a plugin whose module can't load does."""

    def fwd_prefill(self, q, k, v, **kw):
        self.reason = "importing the compiled module failed"
        raise RuntimeError("attn_paged_prefill: importing the compiled module failed")


def test_backend_that_breaks_on_first_use_falls_back(runtime):
    broken = BreaksOnFirstUse("cuda")
    pol = AttentionPolicy((broken, Recording("torch_native")))
    q, k, v = qkv(seed=3)
    out = pol(q, k, v, is_causal=True)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, is_causal=True), **tolerance(torch.float32))
    assert pol.backends[1].runs == ["prefill"]
    (decision,) = runtime.explain("attention")
    assert decision.chosen == "torch_native" and "failed" in decision.trace[0].reason
    with attn_backend("cuda"), pytest.raises(BackendUnavailableError, match="importing the compiled module failed"):
        pol(q, k, v)


def test_errors_of_a_working_backend_propagate(runtime):
    class Raises(Recording):
        def fwd_prefill(self, q, k, v, **kw):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    pol = AttentionPolicy((Raises("cuda"), Recording("torch_native")))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pol(*qkv())
    assert not pol.backends[1].runs


# -- the call summary and the decision cache ----------------------------------------------


def test_decisions_are_cached_per_call_class(runtime):
    pol, b = policy(cuda="declines")
    for seed in range(3):  # new tensors, same shape class: one decision
        pol(*qkv(seed=seed, lq=5 + seed, lkv=9))
    assert b["cuda"].checks == 1 and b["flash"].checks == 1
    pol(*qkv(), mask=torch.ones(2, 6, dtype=torch.bool))  # a mask is another class
    pol(*qkv(d=64))  # so is another head_dim
    assert b["cuda"].checks == 3
    assert len(runtime.explain("attention")) == 3


class WithRunner(Recording):
    """Records the eager runners the policy asks it for, and the calls they run."""

    def __init__(self, name, reason=None):
        super().__init__(name, reason)
        self.runners, self.runner_calls = [], 0

    def eager_runner(self, call, q, k, v, kv_cache):
        self.runners.append((q.shape, q.stride()))

        def run(q, k, v, kv_cache, layer_id, appended):
            self.runner_calls += 1
            return self.forward(call, q, k, v, kv_cache=kv_cache, layer_id=layer_id, is_causal=False)

        return run


def test_a_remembered_call_selects_again_when_the_precedence_changes(runtime, monkeypatch):
    backends = (WithRunner("cuda"), WithRunner("flash"), WithRunner("torch_native"))
    pol, b = AttentionPolicy(backends), {x.name: x for x in backends}
    q, k, v = qkv()
    ran = lambda: {name: len(x.runs) for name, x in b.items()}  # noqa: E731
    for _ in range(3):
        torch.testing.assert_close(pol(q, k, v).double(), attention_ref(q, k, v), **tolerance(torch.float32))
    assert ran() == {"cuda": 3, "flash": 0, "torch_native": 0}
    assert b["cuda"].runners == [(q.shape, q.stride())] and b["cuda"].runner_calls == 3  # built once, then run
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")  # a change of the environment: the next call follows it
    pol(q, k, v)
    assert ran() == {"cuda": 3, "flash": 0, "torch_native": 1}
    with attn_backend("flash"):
        pol(q, k, v)
    assert ran() == {"cuda": 3, "flash": 1, "torch_native": 1}
    monkeypatch.delenv("ASTR_BACKEND")
    pol(q, k, v)
    assert ran()["cuda"] == 4
    b["cuda"].reason = "its plugin became unusable"
    pol(q, k, v)  # the resolver's decision stands until it is cleared
    assert ran()["cuda"] == 5
    runtime.resolver.clear()
    pol(q, k, v)
    assert ran() == {"cuda": 5, "flash": 2, "torch_native": 1}
    with use_runtime(Runtime(Registry(entry_points()))):  # another runtime decides for itself
        b["cuda"].reason = None
        pol(q, k, v)
    assert ran()["cuda"] == 6
    assert len(b["cuda"].runners) == 3 and b["cuda"].runner_calls == 6  # one per selection


def test_an_invalid_environment_value_raises_on_every_call_of_a_remembered_shape(runtime, monkeypatch):
    pol, b = policy()
    q, k, v = qkv()
    pol(q, k, v)
    monkeypatch.setenv("ASTR_BACKEND", "sdpa")
    for _ in range(2):
        with pytest.raises(ValueError, match="ASTR_BACKEND='sdpa' is not an attention backend"):
            pol(q, k, v)
    monkeypatch.setenv("ASTR_BACKEND", "flash")
    pol(q, k, v)
    assert b["flash"].runs == ["prefill"]


def test_call_summary():
    q, k, v = qkv(lq=1, lkv=9)
    call, causal = attn.describe_call(q, k, v, None, None, None, None, None)
    assert call == AttentionCall(device=torch.device("cpu"), dtype=torch.float32, head_dim=32, q_heads=8, kv_heads=2, mode="decode",
                                 fwd=None, causal=False, mask_ndim=0, paged=False, page_size=None, needs_grad=False)
    assert not causal and call.group == 4 and call.training and call.device_type == "cpu"
    assert hash(call) == hash(call._replace())
    q.requires_grad_()
    call, _ = attn.describe_call(q, k, v, None, None, "prefill", None, True)
    assert call.mode == "prefill" and call.needs_grad and call.causal and not call.training
    with torch.no_grad():
        assert not attn.describe_call(q, k, v, None, None, None, None, None)[0].needs_grad
    cache = PagedKVCache(1, 8, 4, 2, 32, dtype=torch.float32)
    cache.add_sequence("s")
    cache.plan(["s"], [1])
    call, causal = attn.describe_call(*qkv(b=1, lq=1, lkv=1), cache, 0, None, None, None)
    assert call.paged and call.page_size == 4 and call.mode == "decode" and causal and not call.training
