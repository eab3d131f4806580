"""Pages left of every layer's window go back to the pool on the GPU too: the CUDA kernels
(decode, the paged prefill's Hopper and mma.sync kernels, FP8 pages) over a cache that releases
them (``PagedKVCache(window=W)``, its released columns on the null page, the pool's free pages
NaN while the layers attend) equal the torch path over a cache that keeps every page."""

from __future__ import annotations

import random

import pytest
import torch

from astrai.extension import ATTN_BACKEND, PagedKVCache, attention, attn_backend, explain
from astrai.extension.kv_window import shared_window

pytestmark = pytest.mark.gpu

HQ, HKV, PAGE = 8, 2, 16

# (request ids, q lengths) per step: chunked prefill over page boundaries, a second request
# arriving while the first decodes (ragged), then decode steps far past the windows
SCHEDULE = ([(("a",), (70,)), (("a",), (45,)), (("a", "b"), (1, 90)), (("a", "b"), (1, 33))]
            + [(("a", "b"), (1, 1))] * 40 + [(("b", "a"), (50, 1))] + [(("a", "b"), (1, 1))] * 20)


def _free_pages(cache: PagedKVCache) -> list[int]:
    owned = {p for s in cache.sequences for p in cache.page_table(s)} | {cache.null_page}
    return [p for p in range(cache.num_pages) if p not in owned]


def _run(windows, d, dtype, kv_dtype, cache_window, num_pages, backend):
    order = list(range(num_pages))
    random.Random(3).shuffle(order)
    cache = PagedKVCache(len(windows), num_pages, PAGE, HKV, d, dtype=dtype, device="cuda", page_order=order,
                         kv_dtype=kv_dtype, window=cache_window)
    gen = torch.Generator(device="cuda").manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(dtype)  # noqa: E731
    outs = []
    with torch.no_grad(), attn_backend(backend):
        for ids, q_lens in SCHEDULE:
            for s in ids:
                if s not in cache.sequences:
                    cache.add_sequence(s)
            with cache.step(ids, q_lens):
                if cache_window is not None:  # a read of a released page would show
                    free = _free_pages(cache)
                    cache.k_pages[:, free] = float("nan")
                    cache.v_pages[:, free] = float("nan")
                for layer, window in enumerate(windows):
                    n = sum(q_lens)
                    q, k, v = rand(1, n, HQ, d), rand(1, n, HKV, d), rand(1, n, HKV, d)
                    outs.append(attention(q, k, v, kv_cache=cache, layer_id=layer, window_left=window))
    return outs, cache


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("windows,d", [((40, 17), 128), ((63, 63), 64), ((31, 0), 256)])
def test_cuda_kernels_over_released_pages_equal_the_torch_path(windows, d, kv_dtype):
    dtype = torch.bfloat16
    want, _ = _run(windows, d, dtype, kv_dtype, None, 128, ATTN_BACKEND.TORCH_NATIVE)
    got, cache = _run(windows, d, dtype, kv_dtype, shared_window(windows), 24, ATTN_BACKEND.CUDA)
    assert any(x.chosen == "cuda" for x in explain("attention"))
    assert cache.page_table("a")[0] == cache.null_page  # the long request gave pages back
    for step, (g, w) in enumerate(zip(got, want)):
        assert not g.isnan().any(), f"output {step} read a released page"
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2, msg=f"output {step} differs")
