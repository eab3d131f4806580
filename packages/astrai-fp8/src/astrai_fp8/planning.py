"""The FP8 GEMM's launch planning as pure Python: a line-for-line mirror of
``plan_gemm`` / ``canonicalize_gemm`` in ``csrc/gemm.cuh``, importable without the
compiled module (and without torch). The tests hold the two to the same answers over a
grid of shapes through ``_fp8_ops.plan``.

>>> plan(1024, 8192, 8192, trans_a=False, trans_b=True, sms=132).tile
'128x128'
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TILES", "Plan", "TileShape", "choose_tile", "plan"]

# Time of a 128x64 tile over a 128x128 tile on one SM (measured on sm_89).
NARROW_OVER_BIG = 0.53
_RESERVED_SMEM_PER_CTA = 1024


@dataclass(frozen=True)
class TileShape:
    name: str
    bm: int
    bn: int
    threads: int
    smem_bytes: int  # kStages+1 = 4 ring slots of (bm + bn) x 64 bytes
    reg_ctas: int    # resident CTAs the register budget allows


TILES = {
    "64x64": TileShape("64x64", 64, 64, 128, 4 * (64 + 64) * 64, 4),
    "128x64": TileShape("128x64", 128, 64, 128, 4 * (128 + 64) * 64, 2),
    "128x128": TileShape("128x128", 128, 128, 256, 4 * (128 + 128) * 64, 1),
}


@dataclass(frozen=True)
class Plan:
    tile: str
    block_m: int
    block_n: int
    swap_ab: bool
    layouts: str  # kernel operand layouts: C(ongruous, K-contiguous) / X (crosswise)
    tiles_m: int
    tiles_n: int
    grid: int
    threads: int
    smem_bytes: int
    group_m: int
    ctas_per_sm: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _tiles(m: int, n: int, tile: str) -> int:
    s = TILES[tile]
    return _ceil_div(m, s.bm) * _ceil_div(n, s.bn)


def ctas_per_sm(tile: str, smem_per_sm: int) -> int:
    s = TILES[tile]
    return min(smem_per_sm // (s.smem_bytes + _RESERVED_SMEM_PER_CTA), s.reg_ctas)


def _fits(tile: str, smem_per_sm: int, smem_per_block: int) -> bool:
    return TILES[tile].smem_bytes <= smem_per_block and ctas_per_sm(tile, smem_per_sm) >= 1


def choose_tile(m: int, n: int, a_congruous: bool, b_congruous: bool, sms: int,
                smem_per_sm: int = 233472, smem_per_block: int = 232448) -> str:
    """The CTA tile for the kernel problem ``m x n`` (rules in ``gemm.cuh``)."""
    big = _tiles(m, n, "128x128")
    sms = max(sms, 1)
    if m <= 64:
        tile = "64x64"
    elif (m % 128 or n % 128) and m % 64 == 0 and n % 64 == 0:
        tile = "64x64"
    elif not a_congruous or not b_congruous:
        tile = "64x64" if 2 * big < 3 * sms else "128x128"
    elif big < sms:
        tile = "64x64" if 8 * big < 3 * sms else "128x64" if 8 * big < 5 * sms else "128x128"
    else:
        t_big = _ceil_div(big, sms) * 1.0
        t_narrow = _ceil_div(_tiles(m, n, "128x64"), sms) * NARROW_OVER_BIG
        tile = "128x64" if t_narrow < t_big else "128x128"
    if tile == "128x128" and not _fits(tile, smem_per_sm, smem_per_block):
        tile = "128x64" if a_congruous and b_congruous else "64x64"  # no crosswise 128x64
    if tile == "128x64" and not _fits(tile, smem_per_sm, smem_per_block):
        tile = "64x64"
    return tile


def plan(m: int, n: int, k: int, *, trans_a: bool, trans_b: bool, sms: int,
         smem_per_sm: int = 233472, smem_per_block: int = 232448) -> Plan:
    """The launch plan of ``op(a) [m, k] @ op(b) [k, n]`` (``a`` stored ``[k, m]`` when
    ``trans_a``, ``b`` stored ``[n, k]`` when ``trans_b``). Defaults: an H100/H200's
    shared memory."""
    if min(m, n, k) <= 0:
        raise ValueError(f"m, n, k must be positive, got {m}, {n}, {k}")
    a_cong, b_cong = not trans_a, trans_b
    swap = not a_cong and b_cong
    if swap:  # crosswise A + congruous B runs as C^T = op(b)^T op(a)^T
        m, n = n, m
        layouts = "CX"
    else:
        layouts = "CC" if a_cong and b_cong else "CX" if a_cong else "XX"
    tile = choose_tile(m, n, layouts != "XX", layouts == "CC", sms, smem_per_sm, smem_per_block)
    s = TILES[tile]
    tm, tn = _ceil_div(m, s.bm), _ceil_div(n, s.bn)
    return Plan(tile, s.bm, s.bn, swap, layouts, tm, tn, tm * tn, s.threads, s.smem_bytes,
                min(tm, 8), ctas_per_sm(tile, smem_per_sm))
