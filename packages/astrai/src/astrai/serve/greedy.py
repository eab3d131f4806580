"""Greedy next tokens: the argmax over the vocabulary, in two stages.

``torch.argmax`` over one long row (a 128k vocabulary at batch 1) reduces it in few blocks:
36 us per decode step on an H200, for 256 KB of logits. Splitting each row into chunks
first gives the GPU ``rows x chunks`` reductions, then a short one over the chunk maxima.
The result is ``logits.argmax(-1)`` exactly: the first index of the maximum (NaN counts as
the maximum, as in torch), since each stage keeps the first of equal values.
"""

from __future__ import annotations

import torch

CHUNK = 2048  # logits per first-stage reduction


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[..., vocab]`` logits, as int64."""
    vocab = logits.shape[-1]
    chunks = vocab // CHUNK
    if chunks < 2:
        return logits.argmax(-1)
    rows = logits.reshape(-1, vocab)
    body = rows[:, : chunks * CHUNK].reshape(rows.shape[0], chunks, CHUNK)
    best, where = body.max(-1)  # first maximum of each chunk
    if vocab > chunks * CHUNK:  # the tail as one more chunk
        tail_best, tail_where = rows[:, chunks * CHUNK:].max(-1, keepdim=True)
        best = torch.cat([best, tail_best], 1)
        where = torch.cat([where, tail_where], 1)
    chunk = best.argmax(-1, keepdim=True)  # the first chunk holding the maximum
    index = chunk * CHUNK + where.gather(1, chunk)
    return index.reshape(logits.shape[:-1])
