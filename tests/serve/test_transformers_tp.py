"""transformers' tensor parallelism with ``attn_implementation="astrai"``: ``torchrun
--nproc-per-node 2`` (gloo, CPU) of ``from_pretrained(..., tp_plan="auto")`` gives the logits
of a single-process sdpa run, float32, for a tiny Llama (GQA 4/2: one KV head per rank) and a
tiny Mistral whose window (8) is shorter than the sequences (40)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate (ci/requirements-dev.txt pins it)")

HERE = Path(__file__).resolve().parent
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral-window8": lambda: transformers.MistralConfig(sliding_window=8, **COMMON),
}


def _save(path: Path, name: str) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32)
    with torch.no_grad():  # sharp scores: a wrong mask or window changes the logits visibly
        for pname, p in model.named_parameters():
            if pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:  # torchrun's --master-port 0 hangs the gloo rendezvous: name a free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_parallel_logits_equal_single_process_sdpa(tmp_path, name):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH (it comes with torch)")
    model_dir = _save(tmp_path / name, name)
    out = tmp_path / "tp_logits.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    run = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(_free_port()), str(HERE / "transformers_tp_run.py"),
                          str(model_dir), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tp = torch.load(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    ids = torch.arange(3, 3 + 2 * 40).reshape(2, 40) % 290 + 1
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(tp, ref, atol=1e-5, rtol=1e-5)
