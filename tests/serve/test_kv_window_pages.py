"""Pages left of every layer's sliding window go back to the pool (``PagedKVCache(window=W)``):
attention outputs equal a cache that keeps every page (torch path, float32 / float64, decode
and chunked prefill crossing page boundaries, the freed pages reused by another request and
filled with NaN), a model with one full-attention layer frees nothing, the engine serves a
request far longer than its pool, and bad arguments are refused naming them (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from astrai.extension import PagedKVCache, attention
from astrai.extension.kv_cache import CacheFullError
from astrai.extension.kv_window import pages_left_behind, shared_window
from astrai.serve import LLM, ModelConfig
from astrai.serve.graphs import capture_pages, grow, held_while_growing
from astrai.serve.model import DecoderModel
from astrai.serve.scheduler import Request, Scheduler

HQ, HKV, D = 4, 2, 8
PAGE = 4

# (request ids, q lengths) per step: chunked prefill crossing page boundaries, a second
# request arriving while the first decodes (ragged steps), then decode steps
SCHEDULE = (
    [(("a",), (7,)), (("a",), (6,)), (("a",), (5,)), (("a",), (1,)), (("a", "b"), (1, 9)), (("a", "b"), (1, 6))]
    + [(("a", "b"), (1, 1))] * 14 + [(("b", "a"), (7, 1)), (("b",), (3,))] + [(("a", "b"), (1, 1))] * 6
)


def _shuffled(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def _free_pages(cache: PagedKVCache) -> list[int]:
    """The pool's pages, from the public accounting: neither owned nor the null page."""
    owned = {p for s in cache.sequences for p in cache.page_table(s)} | {cache.null_page}
    return [p for p in range(cache.num_pages) if p not in owned]


def _run(windows: tuple[int, ...], dtype: torch.dtype, cache_window: int | None, num_pages: int,
         poison: bool) -> tuple[list[torch.Tensor], PagedKVCache]:
    """The outputs of every layer and step of SCHEDULE; ``poison``: the pool's pages hold NaN
    while the layers attend (a read of a released page would show)."""
    cache = PagedKVCache(len(windows), num_pages, PAGE, HKV, D, dtype=dtype, page_order=_shuffled(num_pages, 3),
                         window=cache_window)
    gen = torch.Generator().manual_seed(5)
    outs = []
    for ids, q_lens in SCHEDULE:
        for s in ids:
            if s not in cache.sequences:
                cache.add_sequence(s)
        with cache.step(ids, q_lens):
            if poison:
                free = _free_pages(cache)
                cache.k_pages[:, free] = float("nan")
                cache.v_pages[:, free] = float("nan")
            for layer, window in enumerate(windows):
                q = torch.randn(1, sum(q_lens), HQ, D, generator=gen, dtype=dtype)
                k = torch.randn(1, sum(q_lens), HKV, D, generator=gen, dtype=dtype)
                v = torch.randn(1, sum(q_lens), HKV, D, generator=gen, dtype=dtype)
                outs.append(attention(q, k, v, kv_cache=cache, layer_id=layer, window_left=window))
    return outs, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("windows", [(6, 3), (5, 5), (0, 0)])
def test_outputs_equal_a_cache_that_keeps_every_page(windows, dtype):
    want, _ = _run(windows, dtype, None, 64, poison=False)
    got, cache = _run(windows, dtype, shared_window(windows), 14, poison=True)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert not g.isnan().any(), f"output {step} read a released page"
        torch.testing.assert_close(g, w, msg=f"output {step} differs")
    # the long request released its leading pages, the null page stayed zeros
    table = cache.page_table("a")
    gone = pages_left_behind(cache.seq_len("a") - 1, max(windows), PAGE)
    assert gone >= 3 and table[:gone] == (cache.null_page,) * gone
    assert cache.null_page not in table[gone:]
    assert not cache.k_pages[:, cache.null_page].view(torch.uint8).any()
    assert not cache.v_pages[:, cache.null_page].view(torch.uint8).any()


def test_a_long_decode_runs_on_a_pool_too_small_for_its_history():
    """8 pages of 16 tokens, a window of 32: 400 tokens, a page back to the pool as each leaves it."""
    cache = PagedKVCache(1, 8, 16, HKV, D, dtype=torch.float32, window=32)
    assert cache.free_pages == 7  # the null page left the pool
    cache.add_sequence("a")
    for n in range(1, 401):
        with cache.step(["a"], [1]):
            k = torch.randn(1, 1, HKV, D)
            attention(torch.randn(1, 1, HQ, D), k, torch.randn_like(k), kv_cache=cache, layer_id=0, window_left=32)
        held = -(-n // 16) - pages_left_behind(n - 1, 32, 16)
        assert cache.free_pages == 7 - held  # a page back to the pool as the window leaves it
    assert len(cache.page_table("a")) == 25 and cache.free_pages == 4
    cache.release("a")
    assert cache.free_pages == 7

    full = PagedKVCache(1, 8, 16, HKV, D, dtype=torch.float32)
    full.add_sequence("a")
    with pytest.raises(CacheFullError):
        for _ in range(400):
            full.plan(["a"], [1])


def test_a_rolled_back_step_keeps_the_accounting():
    cache = PagedKVCache(1, 10, 4, HKV, D, dtype=torch.float32, window=5)
    cache.add_sequence("a")
    cache.plan(["a"], [23])
    with pytest.raises(RuntimeError, match="boom"):
        with cache.step(["a"], [6]):  # releases 4 pages, takes 2, then fails
            raise RuntimeError("boom")
    assert cache.seq_len("a") == 23
    table = cache.page_table("a")
    assert table[:4] == (cache.null_page,) * 4 and len(table) == 6
    assert cache.free_pages + 2 + 1 == cache.num_pages  # free + owned + the null page
    cache.release("a")
    assert cache.free_pages == cache.num_pages - 1


def test_graph_capture_sequences_get_every_column_on_a_pool_of_their_windows():
    """A decode graph's throw-away sequences reach a real step's page-table length (released
    columns included) while each holds only a window's pages: the pool need not hold their history."""
    held = held_while_growing(6, PAGE)
    assert held == 3 and held_while_growing(None, PAGE) is None
    cache = PagedKVCache(1, 3 * held + 1, PAGE, HKV, D, dtype=torch.float32, window=6)  # + the null page
    pages = capture_pages(cache.free_pages, 3, 25, held)
    assert pages == [25] * 3 and capture_pages(cache.free_pages, 3, 25) == [3] * 3
    ids = [("capture", b) for b in range(3)]
    for s in ids:
        cache.add_sequence(s)
    grow(cache, ids, [n * PAGE - 2 for n in pages])  # raises CacheFullError if a sequence held more
    for _ in range(2):  # the warm-up and the captured decode steps
        cache.plan(ids, [1] * 3)
    assert [len(cache.page_table(s)) for s in ids] == [25] * 3


def test_one_layer_without_a_window_frees_nothing():
    assert shared_window([7, -1, 7]) is None
    assert shared_window([7, 3, 7]) == 7
    assert shared_window([]) is None
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=17,
                         sliding_layers=(1,))  # layer 0 attends to every key
    llm = LLM(DecoderModel.random(config, dtype=torch.float32, seed=1), page_size=4, max_batch_tokens=8)
    assert [layer.window_left for layer in llm.model.layers] == [-1, 16]
    assert llm.cache_window is None
    prompt, new = [3, 1, 4, 1, 5], 60
    llm.reserve([prompt], new)
    cache = llm.kv_cache
    assert cache.window is None and cache.null_page is None
    free_seen = []
    cache.add_preparer("free pages", lambda c, plan: free_seen.append(c.free_pages))
    assert len(llm.generate([prompt], max_new_tokens=new)[0]) == new
    assert free_seen == sorted(free_seen, reverse=True)  # never a page back before the request ends


def _hf_mistral(window: int, seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                        pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                        max_position_embeddings=512)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # scores large enough that the window changes the result
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4)
    return model.eval()


def test_engine_serves_a_request_longer_than_its_pool():
    """Window 8 (sliding_window 9), pages of 4: 97 and 106 tokens on a pool of 12 pages (their
    histories need 25 and 27), the prompts chunked by 8, the logits equal transformers' over
    the whole sequences."""
    hf = _hf_mistral(9, seed=31)
    gen = torch.Generator().manual_seed(32)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 14)]
    new = 92
    llm = LLM.from_transformers(hf, page_size=4, max_batch_size=2, max_batch_tokens=8)
    assert llm.cache_window == 8
    llm.reserve(prompts, new)
    cache = llm.kv_cache
    # 5 pages per request (8 keys + a step's 8 tokens, misaligned), the pad page, the null page
    assert cache.window == 8 and cache.num_pages == 12
    with pytest.raises(ValueError, match="needs 27 cache pages"):  # the pool holds no full history
        Scheduler([Request(0, prompts[1], new)], page_size=4, num_pages=cache.free_pages, max_batch_size=2,
                  max_batch_tokens=8)
    seen = []  # (free pages, the longest page table) at every plan
    cache.add_preparer("pages", lambda c, plan: seen.append((c.free_pages, max(len(c.page_table(s))
                                                                                for s in plan.seq_ids))))
    tokens, logits = llm.generate(prompts, max_new_tokens=new, return_logits=True)
    assert llm.kv_cache is cache
    assert max(cols for _, cols in seen) == 27 and min(free for free, _ in seen) >= 0
    assert cache.free_pages == cache.num_pages - 2  # all back, but the pad page and the null page
    for prompt, out, got in zip(prompts, tokens, logits):
        assert len(out) == new
        with torch.no_grad():
            full = hf(torch.tensor([prompt + out])).logits[0]
        torch.testing.assert_close(got, full[len(prompt) - 1: len(prompt) - 1 + new], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("window", "error", "match"), [
    (-1, ValueError, "window must be None or an int >= 0"),
    (2.0, TypeError, "window must be None or an int >= 0"),
    (True, TypeError, "window must be None or an int >= 0"),
])
def test_bad_window_is_refused(window, error, match):
    with pytest.raises(error, match=match):
        PagedKVCache(1, 8, 4, HKV, D, dtype=torch.float32, window=window)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="needs num_pages >= 2"):
        PagedKVCache(1, 1, 4, HKV, D, dtype=torch.float32, window=3)
    with pytest.raises(ValueError, match="window_lefts must be ints >= -1"):
        shared_window([3, -2])
    with pytest.raises(ValueError, match="window_lefts must be ints >= -1"):
        shared_window([3, "4"])
    cache = PagedKVCache(1, 8, 4, HKV, D, dtype=torch.float32, window=6)
    cache.add_sequence("a")
    cache.plan(["a"], [3])
    q, k = torch.randn(1, 3, HQ, D), torch.randn(1, 3, HKV, D)
    for window_left in (-1, 7):
        with pytest.raises(ValueError, match=f"window_left={window_left} needs keys the kv_cache releases"):
            attention(q, k, k, kv_cache=cache, layer_id=0, window_left=window_left)
    with pytest.raises(ValueError, match="window 32"):  # too small even for the window
        Scheduler([Request(0, [1] * 40, 10)], page_size=16, num_pages=3, max_batch_size=1, max_batch_tokens=16,
                  window=32)
