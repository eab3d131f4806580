"""A user's mistake gets a short answer, never a traceback: ``astrai <command>: ...`` on
stderr and exit status 2, before any work (no model built, no benchmark timed), and
``astrai doctor`` flags the environment values the other commands refuse."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from fakes import FakeEntryPoint, entry_points, manifest
from rich.console import Console

from astrai.cli import bench, doctor
from astrai.cli.checks import UsageError, environment_problems
from astrai.cli.main import build_parser, main
from astrai.extension.ops._plugin import PLUGIN_OF_OP
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime

ENV = ("ASTR_BACKEND", "ASTRAI_DEBUG", "ASTRAI_DISABLE_PLUGINS", "ASTRAI_PLUGINS_ALLOW", "ASTRAI_PLUGINS_DENY")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def refused(capsys, argv: list[str], *expected: str) -> str:
    """Run ``astrai argv`` in this process: exit status 2, one or two lines on stderr naming
    the command and every ``expected`` text, nothing of the work on stdout."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith(f"astrai {argv[0]}: "), err
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err and "astrai bench on" not in out and "model:" not in out
    return err


def without(monkeypatch, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError


# -- optional dependencies, checked before the work ---------------------------------------


def test_bench_plot_without_matplotlib_names_the_extra_before_benchmarking(monkeypatch, capsys, tmp_path):
    without(monkeypatch, "matplotlib")
    refused(capsys, ["bench", "--quick", "--plot", str(tmp_path / "b.png")], "matplotlib", "pip install 'astrai[plot]'")
    assert not (tmp_path / "b.png").exists()


def test_generate_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    without(monkeypatch, "matplotlib")
    refused(capsys, ["generate", "--preset", "tiny", "--plot", str(tmp_path / "g.png")], "pip install 'astrai[plot]'")


def test_compare_hf_without_transformers_names_the_extra(monkeypatch, capsys):
    without(monkeypatch, "transformers")
    refused(capsys, ["generate", "--preset", "tiny", "--compare", "hf"], "--compare hf needs transformers",
            "pip install 'astrai[transformers]'")


def test_checkpoint_without_transformers_names_the_extra(monkeypatch, capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    without(monkeypatch, "transformers")
    refused(capsys, ["generate", "--checkpoint", str(tmp_path)], "--checkpoint needs transformers",
            "pip install 'astrai[transformers]'")


def test_the_plot_extra_is_declared():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "packages" / "astrai" / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("matplotlib") for req in extras["plot"])
    assert any(req.startswith("transformers") for req in extras["transformers"])


# -- bad values: one or two lines with what is valid, exit 2 ------------------------------


def test_an_unknown_preset_lists_the_presets(capsys):
    refused(capsys, ["generate", "--preset", "bogus"], "'bogus'", "tiny", "llama3-8b")


@pytest.mark.parametrize("argv, text", [
    (["generate", "--checkpoint", "/nonexistent/model"], "is not a folder"),
    (["generate", "--requests", "0"], "--requests must be >= 1"),
    (["generate", "--prompt-len", "9", "3"], "MIN <= MAX"),
    (["generate", "--preset", "tiny", "--json", "/nonexistent/out.json"], "does not exist"),
    (["bench", "--json", "/nonexistent/out.json"], "does not exist"),
])
def test_bad_arguments_are_refused_before_the_work(capsys, argv, text):
    refused(capsys, argv, text)


def test_layers_with_a_checkpoint_is_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    refused(capsys, ["generate", "--checkpoint", str(tmp_path), "--layers", "2"], "--layers")


def test_prompts_longer_than_the_model_are_refused_before_generating(capsys):
    refused(capsys, ["generate", "--preset", "tiny", "--requests", "1", "--prompt-len", "2040", "2040",
                     "--max-new-tokens", "20"], "2048 positions")


@pytest.mark.parametrize("command", [["generate", "--preset", "tiny"], ["bench", "--quick"]])
def test_a_bad_backend_in_the_environment_lists_the_backends(monkeypatch, capsys, command):
    monkeypatch.setenv("ASTR_BACKEND", "bogus")
    refused(capsys, command, "ASTR_BACKEND='bogus'", "cuda, flash, torch_native")


@pytest.mark.parametrize("name, value, text", [
    ("ASTRAI_DEBUG", "maybe", "set 1 (on) or 0 (off)"),
    ("ASTRAI_DISABLE_PLUGINS", "True", "1, true, yes"),
    ("ASTRAI_PLUGINS_DENY", "bogus", "astrai-fp8"),
])
def test_other_bad_environment_values_are_refused(monkeypatch, capsys, name, value, text):
    monkeypatch.setenv(name, value)
    refused(capsys, ["bench", "--quick"], f"{name}", text)


@pytest.mark.parametrize("op", ["bogus", "attn_decode", ""])
def test_bench_ops_that_select_nothing_list_the_valid_names(capsys, op):
    err = refused(capsys, ["bench", "--quick", "--ops", op], "paged decode", "attn_paged_decode", "fp8_gemm")
    assert ("does not time" in err) == (op == "attn_decode")


def test_bench_ops_take_the_op_names_doctor_prints():
    assert bench.select(["attn_paged_decode"]) == {"paged decode"}
    assert bench.select(["rotary_emb", "decode"]) == {"rotary", "paged decode"}
    assert bench.select(["fp8_gemm"]) == {"fp8 gemm vs bf16", "fp8 linear forward"}
    for op in PLUGIN_OF_OP:  # every op doctor lists: timed, or refused by name
        try:
            assert bench.select([op])
        except UsageError as exc:
            assert "does not time" in str(exc)


def test_every_benchmark_is_in_the_table_select_reads():
    import torch

    assert {case.name for case in bench.cases(torch.device("cpu"), quick=True)} <= set(bench.BENCHMARKS)


def test_help_lists_every_subcommand(capsys):
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == {"doctor", "bench", "generate"}
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in commands:
        assert f"    {command} " in out, out


def test_the_console_script_answers_in_short(tmp_path):
    """The same through a fresh interpreter: no traceback on stderr, exit status 2."""
    for argv, env in ((["generate", "--preset", "bogus"], {}), (["generate"], {"ASTR_BACKEND": "bogus"})):
        proc = subprocess.run([sys.executable, "-m", "astrai.cli.main", *argv], capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k not in ENV} | env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 2, proc.stderr


# -- doctor: flags the environment, shows disabled plugins, commands that match ----------


def test_doctor_flags_bad_environment_values(monkeypatch, capsys):
    monkeypatch.setenv("ASTR_BACKEND", "bogus")
    monkeypatch.setenv("ASTRAI_DEBUG", "maybe")
    monkeypatch.setenv("ASTRAI_PLUGINS_DENY", "bogus")
    assert main(["doctor", "--json"]) == 0
    problems = json.loads(capsys.readouterr().out)["environment"]
    assert len(problems) == 3
    assert "cuda, flash, torch_native" in problems[0] and "set 1 (on) or 0 (off)" in problems[1]
    assert "'bogus' names no plugin" in problems[2] and "astrai-elementwise" in problems[2]
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.count("environment: ") == 3 and "ASTR_BACKEND='bogus'" in out


def test_good_environment_values_are_not_flagged():
    environ = {"ASTR_BACKEND": "TORCH_NATIVE", "ASTRAI_DEBUG": "1", "ASTRAI_DISABLE_PLUGINS": "yes",
               "ASTRAI_PLUGINS_DENY": "astrai-fp8,rotary", "ASTRAI_PLUGINS_ALLOW": "my-plugin"}
    assert environment_problems(environ, plugin_names={"my-plugin", "astrai-my-plugin"}) == []


def fake_plugins(**registry):
    eps = entry_points(FakeEntryPoint("elementwise", manifest),
                       FakeEntryPoint("fp8", manifest(name="astrai-fp8")),
                       FakeEntryPoint("broken", AssertionError("an entry point doctor must not load"), "astrai-x"))
    return Runtime(Registry(eps, **registry))


def rendered(report: dict) -> str:
    console = Console(file=io.StringIO(), width=200)
    doctor.render(report, console)
    return console.file.getvalue()


def test_doctor_reports_disabled_plugins_as_disabled(monkeypatch):
    monkeypatch.setenv("ASTRAI_DISABLE_PLUGINS", "1")
    report = doctor.collect(fake_plugins(enabled=False))
    assert [row["name"] for row in report["plugins"]] == ["astrai-elementwise", "astrai-fp8", "astrai-x"]
    assert all(row["disabled"] and row["reason"] == "disabled (ASTRAI_DISABLE_PLUGINS=1)" for row in report["plugins"])
    text = rendered(report)
    assert "(none installed)" not in text and "plugins disabled (ASTRAI_DISABLE_PLUGINS=1)" in text
    assert 'pip install "astrai[rotary,fp8]"' in text  # what is installed, though disabled


@pytest.mark.parametrize("registry", [{}, {"enabled": False}, {"deny": ["elementwise", "fp8"]}])
def test_doctor_install_commands_match_the_installed_plugins(registry):
    text = rendered(doctor.collect(fake_plugins(**registry)))
    pip = [line for line in text.splitlines() if line.startswith("install (pip): ")]
    assert pip == [line for line in pip if 'pip install "astrai[rotary,fp8]" --extra-index-url' in line] != []
    assert "astrai-elementwise astrai-fp8" in text  # conda and pixi name the same plugins


def test_the_module_examples_hold():
    import doctest

    import astrai.cli.checks as module

    assert doctest.testmod(module).failed == 0
