"""The figures `astrai generate --compare hf` gives: a peer that fails is shown failed with its
error (never a ratio or an agreement), accuracy is the teacher-forced logit error against a
float32 reference beside the peer's own, on the CPU (fakes stand in for a failing peer)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from astrai.serve import LLM, compare
from astrai.serve.accuracy import float32_reference, logit_errors, relative_l2

transformers = pytest.importorskip("transformers")

INPLACE = "Inplace update to inference tensor outside InferenceMode"


class _RaisingModel:
    """A transformers stand-in whose generate / generate_batch raise, as transformers' did."""

    def __init__(self, device: str = "cpu") -> None:
        self._param = SimpleNamespace(device=torch.device(device))
        self.generation_config = SimpleNamespace(eos_token_id=None)

    def parameters(self):
        yield self._param

    def generate(self, *args, **kwargs):
        raise RuntimeError(INPLACE)

    def generate_batch(self, *args, **kwargs):
        raise RuntimeError(INPLACE)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(INPLACE)


class _BatchModel(_RaisingModel):
    """generate_batch that returns ``results`` (transformers keeps a request's failure in its output)."""

    def __init__(self, results) -> None:
        super().__init__("cuda")
        self.results = results

    def generate_batch(self, inputs, **kwargs):
        return {f"req_{i}": r for i, r in enumerate(self.results[: len(inputs)])}


def _output(tokens, error=None):
    return SimpleNamespace(generated_tokens=tokens, error=error)


def test_a_raising_generate_is_failed_without_figures():
    run = compare.hf_generate(_RaisingModel(), [[1, 2, 3]], 4)
    assert run.status == "failed" and INPLACE in run.failed and not run.ran
    summary = run.summary()
    assert summary["status"] == "failed" and summary["total_s"] is None and summary["tokens_per_s"] is None


@pytest.mark.parametrize(("results", "match"), [
    (None, INPLACE),  # raises
    ([_output([], error=INPLACE), _output([5, 6])], f"1 of 2 requests failed: {INPLACE}"),
    ([_output([5])], "returned 1 of 2 requests"),
    ([_output([]), _output([5])], "1 of 2 requests came back without tokens"),
])
def test_generate_batch_failures_are_failed(monkeypatch, results, match):
    monkeypatch.setattr(compare, "_sync", lambda device: None)  # the fakes claim CUDA
    model = _RaisingModel("cuda") if results is None else _BatchModel(results)
    run = compare.hf_generate_batch(model, [[1, 2], [3, 4]], 2)
    assert run.status == "failed" and match in run.failed
    assert run.summary()["total_s"] is None and run.tokens == []


def test_generate_batch_is_skipped_off_cuda():
    cpu_model = SimpleNamespace(parameters=lambda: iter([torch.zeros(1)]), generate_batch=None)
    run = compare.hf_generate_batch(cpu_model, [[1]], 2)
    assert run.status == "skipped" and "CUDA only" in run.skipped and run.failed is None


def test_relative_l2():
    a = [torch.tensor([3.0, 4.0]), torch.tensor([0.0])]
    assert relative_l2(a, a) == 0.0
    assert relative_l2([torch.tensor([3.0, 5.0]), torch.tensor([0.0])], a) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="shapes differ"):
        relative_l2([torch.zeros(2)], [torch.zeros(3)])


def test_bf16_engine_is_as_accurate_as_transformers_bf16():
    """The issue's measure on the CPU: the engine in bf16 against a float32 reference, beside
    transformers in bf16 on the same weights and tokens; and a peer that fails is named."""
    llm = LLM.from_preset("tiny", dtype=torch.bfloat16, device="cpu", seed=4)
    hf = llm.to_transformers("sdpa")
    reference = float32_reference(hf)
    assert next(reference.parameters()).dtype == torch.float32
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 30)]
    acc = logit_errors(llm, {"hf (bfloat16)": hf, "broken": _RaisingModel()}, reference, prompts, 6)
    assert acc["requests"] == 2 and acc["tokens"] == sum(len(t) for t in llm.generate(prompts, 6))
    peer, broken = acc["peers"]
    assert 0 < acc["astrai"] < 0.05 and 0 < peer["error"] < 0.05
    assert acc["astrai"] < 1.5 * peer["error"]  # no worse than transformers' own bf16 rounding, give or take
    assert broken["error"] is None and INPLACE in broken["failed"]


def test_float32_engine_matches_the_reference():
    llm = LLM.from_preset("tiny", dtype=torch.float32, device="cpu", seed=6)
    hf = llm.to_transformers("sdpa")
    acc = logit_errors(llm, {"hf": hf}, float32_reference(hf), [[5, 9, 11, 3]], 5)
    assert acc["astrai"] < 1e-5 and acc["peers"][0]["error"] == 0.0 and acc["peers"][0]["is_reference"]


def _generate_cli(tmp_path, capsys, *extra):
    from astrai.cli.main import main

    out = tmp_path / "gen.json"
    argv = ["generate", "--preset", "tiny", "--requests", "3", "--prompt-len", "4", "20", "--max-new-tokens", "4",
            "--dtype", "float32", "--compare", "hf", "--json", str(out), *extra]
    assert main(argv) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_cli_shows_a_failed_peer_as_failed_with_its_error(tmp_path, capsys, monkeypatch):
    def failing(model, prompts, new):
        return compare.HFRun("hf generate_batch").fail(f"generate_batch failed: RuntimeError: {INPLACE}")

    monkeypatch.setattr(compare, "hf_generate_batch", failing)
    text, result = _generate_cli(tmp_path, capsys)
    flat = " ".join(text.split())
    assert f"hf generate_batch: failed: generate_batch failed: RuntimeError: {INPLACE}" in flat
    assert "vs hf generate_batch" not in flat and "0.0%" not in flat
    assert "vs hf generate (sdpa): astrai" in flat  # the peer that ran keeps its ratios
    ran, failed = result["peers"]
    assert ran["status"] == "ran" and failed["status"] == "failed" and INPLACE in failed["failed"]
    assert failed["total_s"] is None and "agreement" not in failed


def test_cli_prints_the_teacher_forced_error_and_the_floor(tmp_path, capsys):
    text, result = _generate_cli(tmp_path, capsys)
    flat = " ".join(text.split())
    acc = result["accuracy"]
    assert acc["astrai"] < 1e-5 and acc["peers"][0]["name"] == "hf (float32)"
    assert "relative L2 error of the logits against transformers in float32, teacher-forced" in flat
    assert "agree" not in flat
    floor = result["engine"]["hbm_floor"]
    assert floor["floor_ms"] is None and "does not apply on the CPU" in floor["note"]
    assert "HBM floor: does not apply on the CPU" in flat


def test_cli_accuracy_that_cannot_be_measured_is_said(tmp_path, capsys, monkeypatch):
    from astrai.serve import accuracy

    def no_memory(hf):
        raise torch.OutOfMemoryError("no room for the float32 copy")

    monkeypatch.setattr(accuracy, "float32_reference", no_memory)
    text, result = _generate_cli(tmp_path, capsys)
    assert "no room" in result["accuracy"]["failed"]
    assert "accuracy: not measured: OutOfMemoryError: no room" in " ".join(text.split())
