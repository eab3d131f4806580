"""A small generation engine on AstrAI's kernels: continuous batching over a paged KV cache,
chunked prefill, decode steps replayed from CUDA graphs. See docs/serve.md."""

from .config import PRESETS, ModelConfig, preset
from .engine import LLM
from .stats import GenerationStats

__all__ = ["LLM", "PRESETS", "GenerationStats", "ModelConfig", "preset"]
