"""Resolver precedence, caching and traces, with plain fake candidates."""

import threading

import pytest

from astrai.extension.resolver import BackendUnavailableError, Resolver


class Fake:
    def __init__(self, name, reason=None):
        self.name, self.reason, self.checks = name, reason, 0

    def check(self, call):
        self.checks += 1
        return self.reason


def candidates(cuda_reason=None):
    return [Fake("cuda", cuda_reason), Fake("flash", "flash_attn is not installed"), Fake("torch_native")]


def test_default_priority_takes_first_capable():
    assert Resolver().resolve("attention", candidates(), None, "k").name == "cuda"
    assert Resolver().resolve("attention", candidates("no plugin"), None, "k").name == "torch_native"


def test_explicit_is_strict():
    with pytest.raises(BackendUnavailableError, match="'flash' was requested .* flash_attn is not installed"):
        Resolver().resolve("attention", candidates(), None, "k", explicit="flash")
    assert Resolver().resolve("attention", candidates(), None, "k", explicit="torch_native").name == "torch_native"


def test_env_preference_falls_back():
    r = Resolver()
    assert r.resolve("attention", candidates(), None, "k", preferred="flash").name == "cuda"
    (decision,) = r.decisions()
    assert decision.source == "env"
    assert [e.candidate for e in decision.trace] == ["flash", "cuda", "torch_native"]
    assert r.resolve("attention", candidates(), None, "k", preferred="torch_native").name == "torch_native"


def test_decisions_are_cached_per_key():
    r, cands = Resolver(), candidates()
    for _ in range(5):
        r.resolve("attention", cands, None, ("cuda:0", "bf16", 128))
    assert cands[0].checks == 1
    r.resolve("attention", cands, None, ("cuda:0", "bf16", 64))
    assert cands[0].checks == 2


def test_trace_explains_every_candidate():
    r = Resolver()
    r.resolve("attention", candidates("astrai-attention: no SASS for sm_75"), None, "k")
    text = str(r.decisions("attention")[0])
    assert "reject cuda: astrai-attention: no SASS for sm_75" in text
    assert "reject flash: flash_attn is not installed" in text
    assert "accept torch_native: capable" in text


def test_no_capable_backend_raises_with_trace():
    with pytest.raises(BackendUnavailableError, match="no backend can run attention"):
        Resolver().resolve("attention", [Fake("torch_native", "dtype int8")], None, "k")


def test_many_threads_first_use_make_one_decision():
    r, cands = Resolver(), candidates()
    barrier = threading.Barrier(16)
    results = []

    def worker():
        barrier.wait()
        results.append(r.resolve("attention", cands, None, "k").name)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["cuda"] * 16 and cands[0].checks == 1 and len(r.decisions()) == 1
