"""What the plugins' gen_wgmma.py generators write alike into their `wgmma.mma_async` wrappers.

The PTX operand list of one wgmma names every accumulator register (N/2 per thread), so the
wrappers are generated rather than typed; each plugin's generator keeps its own shapes,
types and C++ around these pieces. Build-time only: the generators put this folder on
sys.path (through the plugin's cuda-common link).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def operands(first: int, count: int) -> str:
    """The PTX operand references %first .. %(first + count - 1), comma-separated."""
    return ", ".join(f"%{i}" for i in range(first, first + count))


def accumulators(count: int, register: Callable[[int], str]) -> str:
    """The read-write asm constraints of `count` fp32 accumulators; register(i) is the C++
    expression of the i-th."""
    return ", ".join(f'"+f"({register(i)})' for i in range(count))


def scale_d_predicate(operand: int) -> str:
    """The asm prologue that sets predicate p from operand %operand (scale_d: 0 overwrites d)."""
    return f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{operand}, 0;\\n"


def mnemonic(n: int, k: int) -> str:
    """The instruction up to its operand types: an fp32-accumulating m64nNkK wgmma."""
    return f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32."


def write_beside(generator: str, name: str, text: str) -> None:
    """Writes the generated header `name` into the generator's own folder."""
    Path(generator).with_name(name).write_text(text)
