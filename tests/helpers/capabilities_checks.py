"""What the plugins' capabilities tests share: each plugin states what its kernels serve once
(src/<package>/capabilities.py), and its test reads the sources (no build) for a place that
states a capability on its own."""

from __future__ import annotations

import re
from pathlib import Path

from build_helpers import load_module

# The generators' shared pieces (the DType enumerator of each torch dtype name).
SHARED = load_module("astrai_capabilities_under_test", Path(__file__).resolve().parents[2] / "packages" / "cuda-common"
                     / "python" / "astrai_capabilities.py")


def cxx_code(text: str) -> str:
    """C++ without its comments (string literals kept)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def cmake_min_sms(cmake_lists: Path) -> dict[str, int | None]:
    """The MIN_SM of each astrai_add_kernel_module call (by module name; None: not passed)."""
    cmake = re.sub(r"#.*", "", cmake_lists.read_text())
    calls = re.findall(r"astrai_add_kernel_module\(\s*(\S+)([^)]*)\)", cmake)
    assert calls, f"{cmake_lists}: no astrai_add_kernel_module call"
    return {name: (int(m.group(1)) if (m := re.search(r"\bMIN_SM\s+(\d+)", args)) else None)
            for name, args in calls}


def dtype_list_in_a_string(names) -> tuple[str, str]:
    """(regex, what) of a string literal that lists two of the dtypes `names` ("a or b", "a, b")."""
    name = r"\b(?:" + "|".join(names) + r")\b"
    return rf'"[^"\n]*{name}(?:, | or ){name}[^"\n]*"', "a dtype list in a string"


def dtype_comparison_chain(dtypes) -> tuple[str, str]:
    """(regex, what) of a predicate over the DTypes of `dtypes` spelled in place (`t == A || t == B`)."""
    e = "(?:" + "|".join(SHARED.DTYPE_ENUMERATORS[d] for d in dtypes) + ")"
    return rf"==\s*DType::{e}\s*\|\|\s*[\w.>-]+\s*==\s*DType::{e}\b", "a dtype comparison chain"


def restatements_in(sources, rules, allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """'file: what: text' of every rule's match in the sources' code, but those `allowed` per file."""
    problems = []
    for path in sources:
        code = cxx_code(path.read_text())
        for pattern, what in rules:
            if what in allowed.get(path.name, ()):
                continue
            problems += [f"{path.name}: {what}: {m.group(0)!r}" for m in re.finditer(pattern, code)]
    return problems


def assert_nothing_restated(sources, rules, allowed: dict[str, tuple[str, ...]]) -> None:
    problems = restatements_in(sources, rules, allowed)
    assert not problems, "state it in capabilities.py and use capabilities.h:\n" + "\n".join(problems)


def rules_matching(rules, code: str) -> set[str]:
    """What the rules see in a piece of C++ (its comments dropped)."""
    code = cxx_code(code)
    return {what for pattern, what in rules if re.search(pattern, code)}
