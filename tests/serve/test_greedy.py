"""greedy_tokens is logits.argmax(-1) exactly: random rows, ties, NaN, -inf, a vocabulary
with and without a remainder chunk, and a leading batch shape."""

from __future__ import annotations

import pytest
import torch

from astrai.serve.greedy import CHUNK, greedy_tokens

SHAPES = [(1, 128256), (64, 128256), (3, 5 * CHUNK), (2, 3 * CHUNK + 17), (5, 100), (4, 2, 9000)]


def cases(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).to(dtype)
    ties = torch.zeros(shape, dtype=dtype)
    v = shape[-1]
    ties[..., [7, v // 2, v - 1]] = 1  # first-of-equal across chunks
    nan = x.clone()
    nan[..., [11, v - 3]] = float("nan")
    return {"random": x, "ties": ties, "nan": nan, "-inf": torch.full(shape, float("-inf"), dtype=dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_argmax(shape, dtype):
    for name, logits in cases(shape, dtype).items():
        got = greedy_tokens(logits)
        assert got.dtype == torch.int64 and got.shape == logits.shape[:-1], name
        assert torch.equal(got, logits.argmax(-1)), name
