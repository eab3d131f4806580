"""What the plugins' gen_capabilities.py generators share: reading a plugin's capabilities
statement (src/<package>/capabilities.py, plain data) and spelling its lists in C++.

Build-time only: the generators put this folder on sys.path (through the plugin's
cuda-common link).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

# The DType enumerator (astrai/dtype.h) of each torch dtype name a statement may use.
DTYPE_ENUMERATORS = {"float32": "Float32", "float16": "Float16", "bfloat16": "BFloat16",
                     "float8_e4m3fn": "Float8E4M3", "float8_e5m2": "Float8E5M2"}


def statement_of(generator: str, package: str) -> ModuleType:
    """The statement of the plugin whose csrc/ holds `generator`, loaded by path (the plugin
    package is not imported)."""
    path = Path(generator).resolve().parents[1] / "src" / package / "capabilities.py"
    spec = importlib.util.spec_from_file_location(f"{package}_capabilities", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def either(items) -> str:
    """'a', 'a or b', 'a, b or c'."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def names(items) -> str:
    """C++ string literals, comma-separated (the arguments of py::make_tuple)."""
    return ", ".join(f'"{i}"' for i in items)


def dtype_predicate(dtypes) -> str:
    """The C++ test that DType `t` is one of the torch dtype names `dtypes` (false for none)."""
    unknown = [d for d in dtypes if d not in DTYPE_ENUMERATORS]
    if unknown:
        raise SystemExit(f"astrai_capabilities.py: no DType enumerator for {unknown}; add it to DTYPE_ENUMERATORS")
    return " || ".join(f"t == DType::{DTYPE_ENUMERATORS[d]}" for d in dtypes) or "false"


def write_header(generator: str, text: str) -> None:
    """Writes capabilities.h beside `generator`."""
    Path(generator).with_name("capabilities.h").write_text(text)
