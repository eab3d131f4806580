"""The scaling recipes and the FP8 formats they use."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Format(enum.Enum):
    """Which FP8 element format each tensor role uses."""

    E4M3 = "e4m3"  # everything in E4M3 (max 448, 3 mantissa bits)
    HYBRID = "hybrid"  # inputs and weights in E4M3, gradients in E5M2 (max 57344, 2 bits)

    @property
    def forward(self) -> str:
        return "e4m3"

    @property
    def backward(self) -> str:
        return "e5m2" if self is Format.HYBRID else "e4m3"


def _check_common(margin: object, fp8_format: object) -> None:
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"margin must be a non-negative int, got {margin!r}")
    if not isinstance(fp8_format, Format):
        raise TypeError(f"fp8_format must be a Format (E4M3 or HYBRID), got {fp8_format!r}")


@dataclass(frozen=True)
class DelayedScaling:
    """Scales from the amax history of earlier steps (TransformerEngine's delayed scaling).

    Each step quantizes with the scale computed at the end of the previous step and
    records its own amax; at the end of the step (exit of the outermost ``fp8_autocast``
    for inputs and weights, end of the backward pass for gradients) the history rolls
    and ``scale = amax * 2**margin / fp8_max`` with ``amax`` the maximum over the history
    (``"max"``) or the step just finished (``"most_recent"``). A zero or non-finite amax
    keeps the previous scale. Scales start at 1.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        _check_common(self.margin, self.fp8_format)
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")


@dataclass(frozen=True)
class DynamicScaling:
    """Current (just-in-time) scaling: every quantization measures its tensor's amax first
    and uses ``scale = amax * 2**margin / fp8_max`` for that tensor. One extra read of the
    tensor per quantization; no history."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_common(self.margin, self.fp8_format)


Recipe = DelayedScaling | DynamicScaling
