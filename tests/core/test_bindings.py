"""astrai.extension.bindings against the plugins' sources and the tests' fakes: every
pybind11 ``m.def`` of ``packages/*/csrc/*.cu`` takes the arguments ``BINDINGS`` states for
its entry point (names, order, which have a default), every stated entry point is bound
somewhere, and each fake of an entry point in ``tests/helpers/fakes.py`` has its signature. Parsed
from the text: nothing is compiled."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from fakes import FAKE_MODULES

from astrai.extension.bindings import BINDINGS, Binding

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(ROOT.glob("packages/*/csrc/*.cu"))
_ARG = re.compile(r'py::arg\("(\w+)"\)\s*(=)?')


def _call_text(text: str, start: int) -> str:
    """The text of the call whose ``(`` is at ``start``, up to its matching ``)`` (string
    literals and ``//`` comments skipped)."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif text.startswith("//", i):
            i = text.index("\n", i)
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
        i += 1
    raise ValueError(f"unbalanced call at {start}")


def bound_entry_points(path: Path) -> list[tuple[str, Binding]]:
    """``(entry point, its py::arg list)`` of each ``m.def`` in ``path``."""
    text = path.read_text()
    found = []
    for match in re.finditer(r'\bm\.def\(\s*"(\w+)"', text):
        call = _call_text(text, text.index("(", match.start()))
        args = _ARG.findall(call)
        required = tuple(name for name, default in args if not default)
        optional = tuple(name for name, default in args if default)
        assert required + optional == tuple(name for name, _ in args), (
            f"{path.name}: {match.group(1)} has an argument without a default after one with a default")
        found.append((match.group(1), Binding(required, optional)))
    return found


def _all_bound() -> list[tuple[str, str, Binding]]:
    return [(path.relative_to(ROOT).as_posix(), entry, binding)
            for path in SOURCES for entry, binding in bound_entry_points(path)]


def test_the_sources_are_found():
    assert len(SOURCES) >= 7, [str(p) for p in SOURCES]
    assert {"attn_paged_decode", "attn_paged_prefill", "rotary", "gemm", "rms_norm"} <= {e for _, e, _ in _all_bound()}


@pytest.mark.parametrize("source,entry,bound", _all_bound(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_binding_takes_the_stated_arguments(source, entry, bound):
    assert entry in BINDINGS, f"{source}: m.def({entry!r}) has no statement in astrai.extension.bindings.BINDINGS"
    stated = BINDINGS[entry]
    assert bound.args == stated.args, (f"{source}: {entry}'s py::arg list {bound.args} is not the stated "
                                       f"{stated.args} (astrai.extension.bindings)")
    assert bound.required == stated.required, (f"{source}: {entry}'s arguments without a default "
                                               f"{bound.required} are not the stated {stated.required}")


def test_every_stated_entry_point_is_bound():
    bound = {entry for _, entry, _ in _all_bound()}
    assert not set(BINDINGS) - bound, f"stated, but bound by no m.def: {sorted(set(BINDINGS) - bound)}"


def _fake_entry_points():
    for module in FAKE_MODULES:
        fake = module()
        for entry in BINDINGS:
            if callable(getattr(fake, entry, None)):
                yield f"{module.__name__}.{entry}", getattr(fake, entry), BINDINGS[entry]


@pytest.mark.parametrize("where,fake,stated", list(_fake_entry_points()), ids=lambda v: v if isinstance(v, str) else "")
def test_each_fake_takes_the_stated_arguments(where, fake, stated):
    params = list(inspect.signature(fake).parameters.values())
    assert tuple(p.name for p in params) == stated.args, f"{where}: takes {[p.name for p in params]}"
    required = tuple(p.name for p in params if p.default is inspect.Parameter.empty)
    assert required == stated.required, f"{where}: arguments without a default {required}"


def test_the_fakes_cover_the_paged_attention_entry_points():
    faked = {where.split(".")[1] for where, _, _ in _fake_entry_points()}
    assert {"attn_paged_decode", "attn_paged_prefill", "decode_plan", "kv_append"} <= faked
