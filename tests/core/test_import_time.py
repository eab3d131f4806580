"""``import astrai.extension`` stays cheap: nothing of torch.compile loads until something
is compiled (dynamo pulls in inductor and sympy: 0.7 s here, 6 s on a fresh GPU machine)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from astrai.extension import compiling

COMPILE_MODULES = ("torch._dynamo", "torch._inductor", "sympy")


def test_import_loads_nothing_of_torch_compile():
    script = textwrap.dedent(f"""
        import sys
        import torch
        before = {{m for m in {COMPILE_MODULES!r} if m in sys.modules}}
        import astrai.extension, astrai.extension.ops, astrai.extension.fp8
        print(",".join(sorted(m for m in {COMPILE_MODULES!r} if m in sys.modules and m not in before)))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import astrai.extension imported {result.stdout.strip()}"


def test_the_mark_is_the_one_dynamo_makes(monkeypatch):
    def cold():  # marked as at import, before anything imported torch._dynamo
        pass

    def by_dynamo():
        pass

    import torch._dynamo

    with monkeypatch.context() as m:
        m.delitem(sys.modules, "torch._dynamo")
        assert compiling.assume_constant_result(cold) is cold
    torch._dynamo.assume_constant_result(by_dynamo)
    assert vars(cold) == vars(by_dynamo) != {}


def test_a_marked_function_runs_once_at_trace_time():
    calls = []

    @compiling.assume_constant_result
    def decide(n: int) -> int:
        calls.append(n)
        return 2

    def f(x):
        return x * decide(3)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(compiled(x), x * 2)
    torch.testing.assert_close(compiled(x + 1), (x + 1) * 2)
    assert calls == [3]  # traced once, a constant in the graph
