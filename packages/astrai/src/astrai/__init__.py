"""AstrAI kernels: attention, rotary and FP8 GEMM for LLMs.

Importing :mod:`astrai` never imports a plugin binary; see :mod:`astrai.extension`.
"""

__version__ = "0.1.0"
