"""greedy_tokens on CUDA equals torch's argmax there (the two-stage reduction's tie and NaN
rules hold on the GPU kernels too)."""

from __future__ import annotations

import pytest
import torch

from astrai.serve.greedy import greedy_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_equals_argmax_on_cuda(rows, dtype):
    v = 128256
    x = torch.randn(rows, v, device="cuda").to(dtype)
    ties = torch.zeros(rows, v, dtype=dtype, device="cuda")
    ties[:, [5, v // 3, v - 1]] = 2
    nan = x.clone()
    nan[:, [9, v - 2]] = float("nan")
    for logits in (x, ties, nan):
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
