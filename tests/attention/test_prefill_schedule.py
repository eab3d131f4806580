"""The prefill's host-checkable pieces, through the host-only ``_attn_planner`` module: which rows
and heads each block computes and stores, walked through the kernels' own schedule code
(``csrc/prefill_schedule.h``): every (request, row, query head) of a launch exactly once, for the
mma.sync blocks and the Hopper kernel's, dense and packed, causal (blocks taken last-first) or
not, multi-head attention and GQA groups whose heads leave block slots empty."""

from __future__ import annotations

from pathlib import Path

import pytest
from build_helpers import host_module

CSRC = Path(__file__).resolve().parents[2] / "packages" / "astrai-attention" / "csrc"

HEADS = [(8, 8), (16, 8), (24, 8), (32, 8), (40, 8), (56, 8), (64, 2)]  # groups 1, 2, 3, 4, 5, 7, 32
DENSE = [[70], [64, 64], [65, 65, 65], [128], [129, 129], [1000]]
PACKED = [[70, 10, 130], [1, 1, 1000], [64, 65, 128, 129], [200, 3, 64]]


@pytest.fixture(scope="module")
def planner():
    return host_module("_attn_planner", CSRC / "tests" / "planner_module.cpp",
                       [CSRC / "heuristics.h", CSRC / "common.h", CSRC / "prefill_schedule.h"],
                       include_dirs=(CSRC,))


def kernels(q_heads: int, kv_heads: int) -> list[str]:
    """The block layouts a launch may take for this group (8 warps and the plain Hopper kernel
    pack at least two heads)."""
    packed_heads = q_heads // kv_heads >= 2
    return ["mma4", "ws_mha"] + (["mma8", "ws"] if packed_heads else [])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("q_lens,packed", [(q, False) for q in DENSE] + [(q, True) for q in PACKED])
def test_every_row_and_head_is_computed_once(planner, q_lens, packed, heads, causal):
    for kernel in kernels(*heads):
        cover = planner.prefill_coverage(q_lens, packed, *heads, kernel, causal)
        assert (cover["min"], cover["max"]) == (1, 1), (kernel, cover)
        if kernel.startswith("ws"):  # the Hopper kernel's O: TMA boxes and chunks, each pair once
            assert (cover["store_min"], cover["store_max"]) == (1, 1), (kernel, cover)
            assert cover["pairs_outside_boxes"] == 0, (kernel, cover)


def test_one_head_blocks_take_two_host_tiles(planner):
    # dense: a block every second host tile, none empty
    cover = planner.prefill_coverage([129, 129], False, 8, 8, "ws_mha", True)
    assert (cover["head_block"], cover["rows_per_block"]) == (1, 128)
    assert cover["blocks"] == 2 * 2 * 8 and cover["empty_blocks"] == 0  # batch x ceil(3 tiles / 2) x heads
    # packed: a block per host tile, those of a request's odd tiles empty
    cover = planner.prefill_coverage([70, 10, 130], True, 8, 8, "ws_mha", False)
    assert cover["blocks"] == 6 * 8 and cover["empty_blocks"] == 2 * 8  # tiles 2 + 1 + 3, odd ones: 1 + 1
    # O by TMA where a warpgroup's 64 rows lie in the request: rows 0-63 of the 70 and of the 130,
    # 64-127 of the 130; the 70's rows 64-69, the 10 and the 130's last 2 by chunks
    assert cover["tma_boxes"] == 3 * 8


@pytest.mark.parametrize("group,packed_heads", [(2, 2), (3, 1), (4, 4), (5, 1), (6, 1), (7, 1), (8, 4), (32, 4)])
def test_one_head_blocks_where_head_slots_would_stay_empty(planner, group, packed_heads):
    cover = planner.prefill_coverage([256], False, 8 * group, 8, "ws_mha", True)
    assert cover["head_block"] == packed_heads
    assert cover["head_block"] * cover["rows_per_block"] == 128  # (row, head) pairs per block
    plain = planner.prefill_coverage([256], False, 8 * group, 8, "ws", True)
    assert plain["head_block"] == planner.prefill_launch(group, 128)[0]  # the mma.sync block's packing
