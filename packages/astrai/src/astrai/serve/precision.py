"""The engine's precision modes for its linears: the combinations ``LLM`` takes, and where a mode
is measured to lose to another at serving sizes."""

from __future__ import annotations

__all__ = ["FP8_LINEARS_NOTE", "check_linear_precision"]

# Measured on an H100 (docs/fp8.md, "FP8 linears or FP8 weights for serving").
FP8_LINEARS_NOTE = ("FP8 linears (fp8=True, --fp8) quantize each linear's activations per tensor on every call: at "
                    "decode sizes that costs more than the halved weight bytes save (an H100, 64 requests: 0.90x the "
                    "16-bit tokens/s, where FP8 weights ran at 1.19x). To serve, use FP8 weights (fp8_weights=True, "
                    "--fp8-weights); FP8 linears are for training and prefill-heavy work.")


def check_linear_precision(model, fp8: bool, fp8_weights: bool) -> str | None:
    """Raises ``ValueError`` for ``LLM(model, fp8=, fp8_weights=)`` it cannot run; returns the
    measured advice for the mode chosen (``LLM.precision_note``), None where there is none."""
    if fp8 and fp8_weights:
        raise ValueError("fp8 (FP8 weights and activations) and fp8_weights (FP8 weights only) exclude each other")
    if model.linears_released and not fp8_weights:
        raise ValueError("the model's decoder linears hold only FP8 copies: pass fp8_weights=True")
    return FP8_LINEARS_NOTE if fp8 else None
