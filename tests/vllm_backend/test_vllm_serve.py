"""A tiny random-weight model served end to end through ``vllm.LLM`` with AstrAI's backend gives
the greedy tokens of vLLM's own CPU backend (CPU_ATTN), in float32 and bfloat16, for a Llama
(GQA) and a Mistral with a sliding window shorter than the prompts.

vLLM's CPU platform runs CPU_ATTN whatever backend is selected, so the AstrAI run sets
``ASTRAI_VLLM_REPLACE_CPU_ATTN=1``: the plugin, which vLLM loads through its entry point,
then points CPU_ATTN at AstrAI's backend. The run also counts AstrAI's forward calls (it must
have served every layer of every step). Prompts of up to 150 tokens with a 64-token step
budget give chunked prefills and mixed prefill/decode steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: ci/vllm-env makes .venv-vllm, "
                                   "which runs these tests (.venv-vllm/bin/python -m pytest tests/vllm_backend)")

from tiny_llama import save_tiny  # noqa: E402

HERE = Path(__file__).resolve().parent


def _serve(model_dir: Path, dtype: str, tmp_path: Path, astrai: bool) -> dict:
    out = tmp_path / f"{dtype}-{'astrai' if astrai else 'cpu_attn'}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CACHE_ROOT": str(tmp_path / "cache"), "VLLM_RPC_BASE_PATH": str(tmp_path),
           "ASTRAI_VLLM_REPLACE_CPU_ATTN": "1" if astrai else "0"}
    run = subprocess.run([sys.executable, str(HERE / "serve_tiny.py"), str(model_dir), dtype, str(out)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("model,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("mistral-window16", "float32")])
def test_llm_greedy_tokens_match_cpu_attn(tmp_path, model, dtype):
    model_dir = save_tiny(tmp_path / model, sliding_window=16 if model.startswith("mistral") else None)
    ref = _serve(model_dir, dtype, tmp_path, astrai=False)
    ours = _serve(model_dir, dtype, tmp_path, astrai=True)
    assert ref["astrai_forward_calls"] == 0
    assert ours["astrai_forward_calls"] >= 2 * 16  # 2 layers, at least 16 steps
    assert ours["tokens"] == ref["tokens"]
    assert len({tuple(t) for t in ref["tokens"]}) > 1  # the prompts lead somewhere different
