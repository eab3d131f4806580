// Which query rows and heads each prefill block takes: the launch grids, the Q schedules that
// turn a block's coordinates into (request, request-local rows), and a block's head slots.
// Host and device code alike (no CUDA types), so the CPU tests walk every block of a launch
// through this very code (tests/planner_module.cpp: each (row, head) computed exactly once).
//
// A 64-row host Q tile is shared by blocks_per_tile blocks (HB * 64 / rows per block), or a
// block covers tiles_per_block whole tiles (the Hopper kernel's 128 rows of one query head).
// Dense causal launches take the host tiles last-first, so the longest rows of each head start
// first; a packed launch takes its tiles in the order of its tile list, which the host orders
// (BatchPlan.q_tiles: the requests last-first, or the tiles by their keys, longest first):
//   DenseQSchedule   grid (num_q_tiles * bpt / tpb, kv_heads * head_groups, batch)
//   PackedQSchedule  grid (num_q_tiles * bpt, kv_heads * head_groups, 1) over a packed
//                    [total_q, heads, dim] Q, O(1) through q_tile_to_batch / q_tile_to_index;
//                    with tpb = 2 a block starts at a request's even tiles, and the block of
//                    an odd tile (covered by the one before) has no rows.
#pragma once

#include "common.h"
#include "heuristics.h"

#ifdef __CUDACC__
#define ASTRAI_HD __host__ __device__ __forceinline__
#else
#define ASTRAI_HD inline
#endif

namespace astrai::attn {

// A block's share of Q: request b, rows [row_base, row_base + rows) of that request,
// with q_len rows in the request; q_off / o_off are element offsets of its row 0.
struct QWork {
    int b;
    int row_base;
    int q_len;
    int64_t q_off;
    int64_t o_off;
};

// A block's coordinates in the launch grid, (q tile block, kv head group, request); grid_x is
// the grid's x extent.
struct BlockCoord {
    int x, y, z, grid_x;
#ifdef __CUDACC__
    __device__ static BlockCoord of_launch() {
        return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), int(gridDim.x)};
    }
#endif
};

// A dense block's index along the Q tiles: reversed for causal launches.
ASTRAI_HD int q_block_index(const AttentionParams& p, const BlockCoord& c) {
    return p.causal ? c.grid_x - 1 - c.x : c.x;
}

struct DenseQSchedule {
    static constexpr bool kPacked = false;
    ASTRAI_HD static QWork get(const AttentionParams& p, const BlockCoord& c) {
        const int bpt = p.blocks_per_tile;
        const int bx = q_block_index(p, c);
        const int b = c.z;
        QWork w;
        w.b = b;
        w.row_base = (bx / bpt) * kQTileRows * p.tiles_per_block + (bx % bpt) * (kQTileRows / bpt);
        w.q_len = p.q_len;
        w.q_off = int64_t(b) * p.q_stride_b;
        w.o_off = int64_t(b) * p.o_stride_b;
        return w;
    }
#ifdef __CUDACC__
    __device__ static QWork get(const AttentionParams& p) { return get(p, BlockCoord::of_launch()); }
#endif
};

struct PackedQSchedule {
    static constexpr bool kPacked = true;
    ASTRAI_HD static QWork get(const AttentionParams& p, const BlockCoord& c) {
        const int bpt = p.blocks_per_tile;
        const int bx = c.x;  // in the tile list's order (the host's)
        const int host_tile = bx / bpt;
        const int b = p.q_tile_to_batch[host_tile];
        const int start = p.qo_indptr[b];
        const int index = p.q_tile_to_index[host_tile];
        QWork w;
        w.b = b;
        w.q_len = p.qo_indptr[b + 1] - start;
        w.row_base = index % p.tiles_per_block ? w.q_len : index * kQTileRows + (bx % bpt) * (kQTileRows / bpt);
        w.q_off = int64_t(start) * p.q_stride_l;
        w.o_off = int64_t(start) * p.o_stride_l;
        return w;
    }
#ifdef __CUDACC__
    __device__ static QWork get(const AttentionParams& p) { return get(p, BlockCoord::of_launch()); }
#endif
};

// What one block works on, besides its rows (QWork): kv head kvh, query heads head0 ..
// head0 + nslots - 1 (HB slots of rows_blk rows each), and K/V positions [0, kv_end) in
// tiles of BN rows, of which the n_tiles from t_begin on are read (prefill_span; t_begin > 0
// only where a window hides the first ones); diag aligns causal masks bottom-right.
struct PrefillSpan {
    int kvh, head0, nslots, rows_blk;
    int kv_len, diag, kv_end, n_tiles, t_begin;
};

// The head slots and rows of the block in head group head_group_index (grid.y).
ASTRAI_HD PrefillSpan prefill_heads(const AttentionParams& p, int head_group_index) {
    PrefillSpan s{};
    s.rows_blk = prefill_block_rows(p);
    s.kvh = head_group_index / p.head_groups;
    s.head0 = s.kvh * p.group + (head_group_index % p.head_groups) * p.head_block;
    const int left = s.kvh * p.group + p.group - s.head0;  // the group's heads from head0 on
    s.nslots = p.head_block < left ? p.head_block : left;
    return s;
}

// The box of O that one consumer warpgroup (64 of the block's 128 (row, head) pairs) of the
// Hopper kernel stores by TMA, the O tensor map's box (encode_o_map): half the block's head
// slots (rows_blk rows x head_block / 2 heads), or with one head half its rows (64 x 1).
struct OBoxShape {
    int rows, heads;
};

ASTRAI_HD OBoxShape o_box_shape(const AttentionParams& p) {
    return p.head_block == 1 ? OBoxShape{64, 1} : OBoxShape{prefill_block_rows(p), p.head_block / 2};
}

// Warpgroup wg's (0 or 1) box in a block: its first row past the block's row_base, its first
// head, and whether it lies in the request and the head group (else the warpgroup stores its
// pairs in 16-byte chunks).
struct OStoreBox {
    OBoxShape shape;
    int row_off, head;
    bool inside;
};

ASTRAI_HD OStoreBox o_store_box(const AttentionParams& p, const QWork& qw, const PrefillSpan& sp, int wg) {
    const bool one_head = p.head_block == 1;
    OStoreBox b;
    b.shape = o_box_shape(p);
    b.row_off = one_head ? 64 * wg : 0;
    b.head = sp.head0 + (one_head ? 0 : wg * b.shape.heads);
    b.inside = qw.row_base + b.row_off + b.shape.rows <= qw.q_len && sp.nslots == p.head_block;
    return b;
}

// A launch grid (CUDA's dim3, without CUDA).
struct PrefillGrid {
    unsigned x, y, z;
};

// The mma.sync prefill's grid for `warps` warps per block; sets p.blocks_per_tile.
inline PrefillGrid prefill_mma_grid(AttentionParams& p, unsigned num_q_tiles, unsigned batch, int warps) {
    p.blocks_per_tile = prefill_blocks_per_tile(p.group, warps);
    return {num_q_tiles * unsigned(p.blocks_per_tile), unsigned(p.kv_heads * p.head_groups), batch};
}

// The warp-specialized Hopper prefill's grid (128 (row, head) pairs per block): blocks packed
// like the 8-warp mma.sync block (HB >= 2), or of one head's 128 rows (HB = 1: two host Q tiles
// per block). With one_head_blocks (ASTRAI_PREFILL_WS_MHA) a group the head slots do not divide
// (3, 5, 6, 7), which would leave slots empty, takes one-head blocks too: they compute the same
// (row, head) pairs per K/V tile, none of them wasted. Sets p.head_block / head_groups /
// blocks_per_tile / tiles_per_block.
inline PrefillGrid prefill_ws_grid(AttentionParams& p, unsigned num_q_tiles, unsigned batch, bool packed,
                                   bool one_head_blocks) {
    if (one_head_blocks && p.group % p.head_block != 0) {
        p.head_block = 1;
        p.head_groups = p.group;
    }
    p.blocks_per_tile = p.head_block == 1 ? 1 : prefill_blocks_per_tile(p.group, 8);
    p.tiles_per_block = p.head_block == 1 ? 2 : 1;
    const unsigned tiles = packed ? num_q_tiles : unsigned(cdiv(num_q_tiles, p.tiles_per_block));
    return {tiles * unsigned(p.blocks_per_tile), unsigned(p.kv_heads * p.head_groups), batch};
}

}  // namespace astrai::attn
