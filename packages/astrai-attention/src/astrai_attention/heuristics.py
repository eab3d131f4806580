"""The attention launch heuristics, as pure functions (mirror of ``csrc/heuristics.h``).

The compiled modules compute the same numbers (``decode_plan`` / ``prefill_plan``); the
plugin's CPU tests check the two agree. The ops layer uses ``decode_num_splits`` to size
the split-K workspace from shapes alone, so a decode call allocates nothing that depends
on data and can be captured in a CUDA graph.

>>> decode_num_splits(batch=1, kv_heads=8, group=4, head_dim=128, kv_len_hint=4096, num_sms=132)
32
>>> prefill_head_block(4), prefill_head_groups(8), prefill_warps(4, 128)
(4, 2, 8)
"""

from __future__ import annotations

Q_TILE_ROWS = 64  # rows per host Q tile (qo_indptr / q_tile_to_* metadata)
PREFILL_WARPS = 4  # mma prefill: 4 warps x 16 rows per block
MAX_DECODE_SPLITS = 64
DECODE_HEADS_PER_BLOCK = 16  # query heads per decode block (mma rows)
DECODE_BLOCKS_PER_SM = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_kv_tile(head_dim: int) -> int:
    """K/V rows per decode tile: 64 (4 warps x 16) for d <= 128, 32 (2 warps) for d = 256."""
    return 64 if head_dim <= 128 else 32


def decode_head_groups(group: int) -> int:
    return cdiv(group, DECODE_HEADS_PER_BLOCK)


def decode_num_splits(batch: int, kv_heads: int, group: int, head_dim: int, kv_len_hint: int,
                      num_sms: int) -> int:
    """Splits of each request's KV: 1 when the launch already fills a wave, else minimizes waves(s) * tiles_per_split(s) (+1 tile for the
    combine when s > 1) over s in [1, min(64, tiles)]; the smallest s wins ties."""
    units = batch * kv_heads * decode_head_groups(group)
    tiles = cdiv(max(kv_len_hint, 1), decode_kv_tile(head_dim))
    slots = max(num_sms, 1) * DECODE_BLOCKS_PER_SM
    if units <= 0 or tiles <= 1 or units >= slots:  # a full wave needs no split
        return 1
    best, best_cost = 1, cdiv(units, slots) * tiles
    for s in range(2, min(MAX_DECODE_SPLITS, tiles) + 1):
        cost = cdiv(units * s, slots) * cdiv(tiles, s) + 1
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def prefill_head_block(group: int) -> int:
    """Query heads per prefill block (HB): the largest power of two <= min(group, 4)."""
    hb = 1
    while hb * 2 <= min(group, PREFILL_WARPS):
        hb *= 2
    return hb


def prefill_head_groups(group: int) -> int:
    return cdiv(group, prefill_head_block(group))


def prefill_warps(group: int, head_dim: int) -> int:
    """Warps per mma prefill block: 8 (128 (row, head) pairs per K/V tile) when at least two
    heads share the block and head_dim <= 128, else the spec's 4-warp layout."""
    return 8 if prefill_head_block(group) >= 2 and head_dim <= 128 else PREFILL_WARPS


def prefill_blocks_per_tile(group: int, warps: int) -> int:
    """Blocks sharing one 64-row host Q tile: HB for 4 warps, HB / 2 for 8."""
    return prefill_head_block(group) * PREFILL_WARPS // warps


def num_q_tiles(q_len: int) -> int:
    return cdiv(q_len, Q_TILE_ROWS)


def decode_grid(batch: int, kv_heads: int, group: int, num_splits: int) -> tuple[int, int, int]:
    return batch * kv_heads * decode_head_groups(group), num_splits, 1


def prefill_grid(num_tiles: int, kv_heads: int, group: int, batch: int, head_dim: int = 128,
                 warps: int | None = None) -> tuple[int, int, int]:
    """(num_q_tiles * blocks_per_tile, kv_heads * head_groups, batch); batch = 1 for the
    packed schedule. ``warps`` defaults to :func:`prefill_warps`."""
    warps = prefill_warps(group, head_dim) if warps is None else warps
    return (num_tiles * prefill_blocks_per_tile(group, warps), kv_heads * prefill_head_groups(group), batch)


def workspace_numel(num_splits: int, batch: int, q_heads: int, head_dim: int) -> tuple[int, int]:
    """(ws_o, ws_lse) float32 elements of a decode launch; (0, 0) without a split."""
    if num_splits <= 1:
        return 0, 0
    return num_splits * batch * q_heads * head_dim, num_splits * batch * q_heads
