"""`astrai generate --accuracy`: every precision mode over the same weights, teacher-forced
against their float32 copy, side by side; a mode that fails is shown failed."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.serve import LLM
from astrai.serve.accuracy import float32_reference, precision_errors, top1_agreement

pytest.importorskip("transformers")


def test_top1_agreement_counts_rows_with_the_same_largest_logit():
    want = [torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])]
    assert top1_agreement(want, want) == 1.0
    assert top1_agreement([torch.tensor([[0.0, 2.0, 1.0], [0.0, 3.0, 0.0]])], want) == 0.5


def test_each_fp8_mode_shows_its_own_error_beside_the_model_dtype():
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=2)
    reference = float32_reference(llm.to_transformers("sdpa"))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 33)]
    modes = {"": {}, "FP8 weights": {"fp8_weights": True}, "FP8 KV cache (e4m3)": {"kv_cache_dtype": torch.float8_e4m3fn},
             "too small pages": {"page_size": 1}}
    base, weights, kv, bad = precision_errors(llm.model, reference, prompts, 6, modes)
    assert base["mode"] == "float32" and base["error"] < 1e-5 and base["top1"] == 1.0 and base["x_base"] == 1.0
    for row in (weights, kv):  # FP8's rounding shows: 3 mantissa bits, far above float32's
        assert 1e-3 < row["error"] < 0.2 and row["x_base"] > 100 and 0.5 <= row["top1"] <= 1.0
    assert weights["error"] != kv["error"]  # each mode measured on its own run
    assert bad["error"] is None and bad["x_base"] is None and "page_size" in bad["failed"]


def test_cli_prints_the_precision_table(tmp_path, capsys):
    from astrai.cli.main import main

    out = tmp_path / "gen.json"
    argv = ["generate", "--preset", "tiny", "--requests", "2", "--prompt-len", "4", "12", "--max-new-tokens", "3",
            "--dtype", "bfloat16", "--accuracy", "--json", str(out)]
    assert main(argv) == 0
    flat = " ".join(capsys.readouterr().out.split())
    acc = json.loads(out.read_text())["precision_accuracy"]
    assert [m["mode"] for m in acc["modes"]] == ["bfloat16", "FP8 weights", "FP8 weights, weight-only kernel",
                                                 "FP8 weights, W8A8", "FP8 linears", "FP8 KV cache (e4m3)"]
    assert all(m["failed"] is None and m["error"] > 0 for m in acc["modes"])
    # what each FP8-weights mode ran, said: the CPU has neither kernel, whatever a mode forces
    for mode in acc["modes"]:
        assert (set(mode["routes"]) == {"torch"}) == mode["mode"].startswith("FP8 weights"), mode
    assert "FP8 linears'" in flat and "torch 24" in flat  # 2 layers x 4 linears x (prefill + 2 steps)
    assert "accuracy by precision (bfloat16 weights, 2 requests, 3 new tokens" in flat
    assert "x bfloat16" in flat and "top-1 agreement" in flat
