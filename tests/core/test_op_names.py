"""astrai.extension.op_names against the manifests and the core: every op a plugin manifest
declares has its constant (and no constant names an op none declares), the core's per-op
tables hold exactly those ops, and the core's extension and CLI write an op's name only through
its constant. The manifests come from each plugin's own ``manifest()``, given a made-up build
record (nothing is compiled or installed)."""

from __future__ import annotations

import ast
from pathlib import Path

from build_helpers import declared_ops

from astrai.cli import doctor
from astrai.extension import op_names
from astrai.extension.abi import SUPPORTED_OP_ABI
from astrai.extension.ops._plugin import PLUGIN_OF_OP

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "packages" / "astrai" / "src" / "astrai"
# the core's packages that name ops (astrai.serve speaks transformers' names: a model's ``rotary_emb``)
NAMING_OPS = (CORE / "extension", CORE / "cli")


def _constants() -> dict[str, str]:
    return {name: value for name, value in vars(op_names).items() if name.isupper() and isinstance(value, str)}


def test_every_declared_op_has_a_constant_and_every_constant_is_declared():
    declared = set(declared_ops())
    assert set(op_names.ALL_OPS) == declared, (
        f"in manifests, not in op_names.ALL_OPS: {sorted(declared - set(op_names.ALL_OPS))}; "
        f"in op_names.ALL_OPS, declared by no manifest: {sorted(set(op_names.ALL_OPS) - declared)}")


def test_each_op_has_one_constant_named_after_it():
    constants = _constants()
    assert sorted(constants.values()) == sorted(op_names.ALL_OPS), "a constant missing from ALL_OPS, or twice in it"
    for name, value in constants.items():
        assert name == value.upper(), f"op_names.{name} = {value!r}: the constant is the op's name in capitals"


def test_the_core_tables_hold_every_op():
    declared = declared_ops()
    for table, keys in (("SUPPORTED_OP_ABI", SUPPORTED_OP_ABI), ("PLUGIN_OF_OP", PLUGIN_OF_OP),
                        ("doctor.FALLBACKS", doctor.FALLBACKS)):
        assert list(keys) == list(op_names.ALL_OPS), f"{table}: not the ops of op_names.ALL_OPS, in its order"
    assert PLUGIN_OF_OP == declared, "PLUGIN_OF_OP names another plugin than the one whose manifest declares the op"


def _bare_names(path: Path) -> list[str]:
    """``line: 'string'`` for each string constant in ``path`` that is an op's name (or the
    ``astrai::`` name of its custom op), other than the entries of an ``__all__``."""
    tree = ast.parse(path.read_text(), str(path))
    exported = {id(node) for assign in ast.walk(tree) if isinstance(assign, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in assign.targets)
                for node in ast.walk(assign.value)}
    ops = set(op_names.ALL_OPS)
    return [f"{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported
            and node.value.removeprefix("astrai::") in ops]


def test_the_core_names_ops_through_their_constants():
    found = {}
    for path in sorted(p for package in NAMING_OPS for p in package.rglob("*.py")):
        if path.name in ("op_names.py", "bindings.py"):  # bindings.py: entry points, some named like their op
            continue
        bare = _bare_names(path)
        if bare:
            found[str(path.relative_to(ROOT))] = bare
    assert not found, f"op names written as strings (use astrai.extension.op_names): {found}"
