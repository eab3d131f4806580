"""A launched decode step's tokens on their way to the host, so the engine can plan the next
step before they arrive."""

from __future__ import annotations

import torch

__all__ = ["InFlight"]


class InFlight:
    """A launched decode step: its tokens on their way to the host (pinned memory on CUDA)."""

    def __init__(self, tokens: torch.Tensor, logits: torch.Tensor | None) -> None:
        self.logits = logits
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens.clone(), None

    def tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
