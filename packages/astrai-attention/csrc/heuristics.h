// Launch heuristics as pure host functions (no CUDA calls): split counts, head packing,
// grid sizes. The one definition: the kernel modules bind them (decode_plan, prefill_plan)
// and csrc/tests/planner_module.cpp binds them for the CPU tests (host C++ only), so no
// Python copy of these rules exists.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace astrai::attn {

constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- decode ----
// Query heads per decode block (the 16 rows of one mma A operand).
constexpr int kDecodeHeadsPerBlock = 16;
// Resident decode blocks per SM the split search assumes (2 x ~100 KB rings on sm_90; over fp8
// pages 3 x 64 KB).
constexpr int kDecodeBlocksPerSm = 2;
constexpr int kDecodeBlocksPerSmFp8 = 3;

constexpr int decode_kv_tile(int head_dim) { return head_dim <= 128 ? 64 : 32; }
constexpr int decode_head_groups(int group) { return int(cdiv(group, kDecodeHeadsPerBlock)); }

// Splits of each request's KV for a decode launch over batch x kv_heads x head groups
// blocks, with kv_len_hint positions per request (exact for contiguous K/V, the mean
// for a paged cache), kv_bytes per K/V value (1: fp8 pages). A launch that already fills a
// wave is not split; otherwise minimizes waves(s) * tiles_per_split(s), plus one tile for the
// combine pass when s > 1; the smallest s wins ties. Over fp8 pages a block's prologue and
// merge weigh as much as a tile (half the bytes per tile: measured at B = 16, kv 4096, where
// 64 splits of one tile ran 1.8x slower than 2): each split's tiles count one more.
inline int decode_num_splits(int64_t batch, int64_t kv_heads, int64_t group, int head_dim,
                             int64_t kv_len_hint, int num_sms, int kv_bytes = 2) {
    const int64_t units = batch * kv_heads * decode_head_groups(int(group));
    const int64_t tiles = cdiv(std::max<int64_t>(kv_len_hint, 1), decode_kv_tile(head_dim));
    const int64_t slots =
        int64_t(std::max(num_sms, 1)) * (kv_bytes == 1 ? kDecodeBlocksPerSmFp8 : kDecodeBlocksPerSm);
    if (units <= 0 || tiles <= 1 || units >= slots) return 1;  // a full wave needs no split
    const int64_t max_s = std::min<int64_t>(kMaxDecodeSplits, tiles);
    const int64_t block_cost = kv_bytes == 1 ? 1 : 0;
    int best = 1;
    int64_t best_cost = cdiv(units, slots) * (tiles + block_cost);
    for (int64_t s = 2; s <= max_s; ++s) {
        const int64_t cost = cdiv(units * s, slots) * (cdiv(tiles, s) + block_cost) + 1;
        if (cost < best_cost) {
            best_cost = cost;
            best = int(s);
        }
    }
    return best;
}

// ---- prefill ----
// Query heads packed per prefill block: the largest power of two <= min(group, 4), so
// every head slot gets a whole number of 16-row warps (64 / HB rows).
constexpr int prefill_head_block(int group) {
    int hb = 1;
    while (hb * 2 <= std::min(group, kPrefillWarps)) hb *= 2;
    return hb;
}
constexpr int prefill_head_groups(int group) { return int(cdiv(group, prefill_head_block(group))); }
// Warps per mma prefill block: 8 (128 (row, head) pairs per K/V tile) when at least two
// heads share the block and D <= 128, else the 4-warp layout of one 64-row host tile.
constexpr int prefill_warps(int group, int head_dim) {
    return prefill_head_block(group) >= 2 && head_dim <= 128 ? 8 : kPrefillWarps;
}
// Blocks that share one 64-row host Q tile (grid.x = num_q_tiles * blocks_per_tile).
constexpr int prefill_blocks_per_tile(int group, int warps) {
    return prefill_head_block(group) * kPrefillWarps / warps;
}
constexpr int64_t num_q_tiles(int64_t q_len) { return cdiv(q_len, kQTileRows); }

// The block layout of an mma prefill launch for GQA group `group` (the wgmma kernel on
// sm_90a runs the same grid).
struct PrefillLaunch {
    int head_block;       // HB: query heads per block
    int head_groups;      // ceil(group / HB): grid.y = kv_heads * head_groups
    int warps;            // warps per block
    int blocks_per_tile;  // blocks sharing one host Q tile: grid.x = num_q_tiles * blocks_per_tile
};
constexpr PrefillLaunch prefill_launch(int group, int head_dim) {
    const int warps = prefill_warps(group, head_dim);
    return {prefill_head_block(group), prefill_head_groups(group), warps, prefill_blocks_per_tile(group, warps)};
}

}  // namespace astrai::attn
