"""The parts of the FP8 strategy layer (``astrai.extension.fp8`` is its public face):
recipes, per-role scaling state and its end-of-step update, the per-weight state with its
FP8 weight cache, and the FP8 linear (autograd Function and plan)."""
