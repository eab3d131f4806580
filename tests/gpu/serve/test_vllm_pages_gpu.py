"""The vLLM backend's CUDA path without vLLM: the astrai-attention plugin's paged kernels over
page views of a vLLM-shaped layer cache ([num_blocks, kv_heads, block_size, 2 * head_size], the
views strided, never copied) and a shuffled block table, against the backend's own torch path
on the same pages: decode and mixed prefill/decode batches, bf16 and e4m3 pages, plain and
with a window and a soft-cap."""

from __future__ import annotations

import random

import pytest
import torch

from astrai.extension.backend.attention.variant import PLAIN, AttentionVariant
from astrai.integrations.vllm.pages import attend, block_table_plan, page_views, write_pages

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
HQ, HKV, D, PAGE, BLOCKS = 8, 2, 128, 16, 96


@pytest.mark.parametrize("variant", [PLAIN, AttentionVariant(window_left=40, logits_soft_cap=30.0)],
                         ids=["plain", "window+softcap"])
@pytest.mark.parametrize("storage", [BF16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [37, 1, 5, 1]], ids=["decode", "mixed"])
def test_the_kernels_read_vllm_pages_as_the_torch_path_does(q_lens, storage, variant):
    g = torch.Generator(device="cuda").manual_seed(len(q_lens) + sum(q_lens))
    raw = torch.randn(BLOCKS, HKV, PAGE, 2 * D, device="cuda", generator=g)
    cache = raw.to(BF16) if storage == BF16 else (raw * 4).to(E4M3).view(torch.uint8)  # FP8 arrives as bytes
    k_pages, v_pages = page_views(cache, D, storage)
    assert k_pages.data_ptr() == cache.data_ptr() and not k_pages.is_contiguous()  # views, not copies
    scales = (torch.tensor([0.25], device="cuda"), torch.tensor([0.5], device="cuda")) if storage == E4M3 else (None,) * 2
    context = [150, 23, 300, 64]
    kv_lens = [c + q for c, q in zip(context, q_lens)]
    width = max(-(-n // PAGE) for n in kv_lens) + 2
    order = random.Random(5).sample(range(BLOCKS), len(q_lens) * width)
    block_table = torch.tensor(order, dtype=torch.int32, device="cuda").view(len(q_lens), width)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    plan = block_table_plan(block_table, starts, torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
                            q_lens, kv_lens, PAGE)
    total = sum(q_lens)
    key, value = (torch.randn(total, HKV, D, device="cuda", generator=g).to(BF16) for _ in range(2))
    slots = torch.cat([block_table[b, (n - q + torch.arange(q, device="cuda")) // PAGE] * PAGE
                       + (n - q + torch.arange(q, device="cuda")) % PAGE
                       for b, (q, n) in enumerate(zip(q_lens, kv_lens))]).long()
    write_pages(k_pages, v_pages, key, value, slots, *scales)
    q = torch.randn(total, HQ, D, device="cuda", generator=g).to(BF16)
    got = attend(q, k_pages, v_pages, plan, variant, kernels=True, k_scale=scales[0], v_scale=scales[1])
    want = attend(q, k_pages, v_pages, plan, variant, kernels=False, k_scale=scales[0], v_scale=scales[1])
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
