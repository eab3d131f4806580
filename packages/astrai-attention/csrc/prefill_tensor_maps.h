// TMA tensor maps for the Hopper prefill's Q and K/V: with them one producer thread moves a
// whole tile panel per instruction instead of 128 threads issuing a cp.async per 16 bytes
// (whose address arithmetic took a third of the kernel's issued instructions).
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cstdint>

#include "astrai/tensor_map.h"
#include "common.h"
#include "prefill_schedule.h"

namespace astrai::attn {

struct PrefillTensorMaps {  // CUtensorMap carries its own (64-byte+) alignment
    CUtensorMap k, v, q;
    // Paged K/V whose pages follow each other in memory: the cache as one run of rows
    // (page after page), a box of a whole tile per panel (k_run / v_run, where run_maps).
    CUtensorMap k_run, v_run;
    // O, written by TMA from each consumer warpgroup's half of the staged tile (o_tma): a box
    // of head_block / 2 heads x rows_blk rows per 64-column panel (one head: 64 rows of it).
    CUtensorMap o;
    // kCpAsync: the producer copies K/V with cp.async. kTma: every tile by TMA (contiguous
    // K/V, zeros past kv_len). kTmaWholeTiles: paged K/V, a box of box_rows positions per
    // page; tiles that end past kv_len by cp.async, which zero-fills instead of reading
    // stale page slots.
    enum Mode : int { kCpAsync = 0, kTma = 1, kTmaWholeTiles = 2 };
    int mode = kCpAsync;
    int box_rows = 0;
    bool q_tma = false;  // the Q tile by TMA (q), else by cp.async
    bool run_maps = false;
    bool o_tma = false;
};

// A 4-D tensor of 16-bit elements, dims[0] = head_dim contiguous, read in boxes whose first
// extent is 64 elements (128 bytes, the 128-byte swizzle): each box lands as panels of the
// kernel's PanelTile layout. Coordinates past a dimension read as zeros. False where TMA
// cannot address the tensor (unaligned base or strides).
inline bool encode_panel_map(CUtensorMap* map, const void* base, const int64_t (&dims)[4],
                             const int64_t (&elem_strides)[3], const cuuint32_t (&box)[4]) {
    const EncodeTiledFn encode = encode_tiled_fn();
    if (encode == nullptr || dims[0] % 64 != 0 || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
    cuuint64_t extents[4], strides[3];
    for (int i = 0; i < 4; ++i) {
        if (dims[i] < 1 || box[i] < 1 || box[i] > 256) return false;
        extents[i] = cuuint64_t(dims[i]);
    }
    for (int i = 0; i < 3; ++i) {
        // A dimension of extent 1 is never stepped: any valid stride describes it.
        const int64_t bytes = dims[i + 1] == 1 ? 16 : elem_strides[i] * 2;
        if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t(1) << 40)) return false;
        strides[i] = cuuint64_t(bytes);
    }
    const cuuint32_t steps[4] = {1u, 1u, 1u, 1u};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), extents, strides,
                  const_cast<cuuint32_t*>(box), steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// K or V [outer, rows, kv_heads, head_dim] (contiguous K/V: outer = batch, rows = kv_len;
// paged: outer = pages, rows = page slots) in boxes of box_rows rows x 64 elements of one head.
inline bool encode_kv_map(CUtensorMap* map, const void* base, int outer, int rows, int kv_heads, int head_dim,
                          int64_t stride_outer, int64_t stride_row, int64_t stride_h, int box_rows) {
    return encode_panel_map(map, base, {head_dim, kv_heads, rows, outer}, {stride_h, stride_row, stride_outer},
                            {64u, 1u, cuuint32_t(box_rows), 1u});
}

// A map over Q or O (the same layout: [batch, q_len, q_heads, head_dim] dense, or [total rows,
// q_heads, head_dim] packed, q_total_rows > 0) for blocks of head_block heads x rows_blk rows
// (128 rows, head slot major, as the block's tile), a box of box_rows rows x box_heads heads.
inline bool encode_rows_map(CUtensorMap* map, const AttentionParams& p, const void* base, int64_t stride_l,
                            int64_t stride_h, int64_t stride_b, int head_dim, bool packed, int box_rows,
                            int box_heads) {
    if (p.head_block * prefill_block_rows(p) != 128) return false;
    const int rows = packed ? p.q_total_rows : p.q_len;
    const int outer = packed ? 1 : p.batch;
    return encode_panel_map(map, base, {head_dim, rows, p.q_heads, outer}, {stride_l, stride_h, stride_b},
                            {64u, cuuint32_t(box_rows), cuuint32_t(box_heads), 1u});
}

// The Q map: a box is the block's whole Q tile. It may reach past the block's request or head
// group: those rows are computed and never stored.
inline bool encode_q_map(CUtensorMap* map, const AttentionParams& p, int head_dim, bool packed) {
    return encode_rows_map(map, p, p.q, p.q_stride_l, p.q_stride_h, p.q_stride_b, head_dim, packed,
                           prefill_block_rows(p), p.head_block);
}

// The O map: a box is one consumer warpgroup's 64 (row, head) pairs (o_box_shape): half the
// block's head slots (an even head_block), or the first or second 64 rows of its one head.
inline bool encode_o_map(CUtensorMap* map, const AttentionParams& p, int head_dim, bool packed) {
    if (p.head_block != 1 && p.head_block % 2 != 0) return false;
    const OBoxShape box = o_box_shape(p);
    return encode_rows_map(map, p, p.o, p.o_stride_l, p.o_stride_h, p.o_stride_b, head_dim, packed, box.rows,
                           box.heads);
}

// Both K/V maps of a contiguous-K/V launch (tiles of tile_rows positions), or kCpAsync where
// either cannot be encoded.
inline PrefillTensorMaps contig_kv_maps(const AttentionParams& p, int head_dim, int tile_rows) {
    PrefillTensorMaps m;
    const bool ok = encode_kv_map(&m.k, p.k, p.batch, p.kv_len, p.kv_heads, head_dim, p.k_stride_b, p.k_stride_l,
                                  p.k_stride_h, tile_rows) &&
                    encode_kv_map(&m.v, p.v, p.batch, p.kv_len, p.kv_heads, head_dim, p.v_stride_b, p.v_stride_l,
                                  p.v_stride_h, tile_rows);
    m.mode = ok ? PrefillTensorMaps::kTma : PrefillTensorMaps::kCpAsync;
    m.box_rows = tile_rows;
    return m;
}

// Paged K/V [num_pages, page_size, kv_heads, head_dim]: the same encoding with pages as the
// batch dimension, boxes of min(page_size, tile_rows) slots. Needs page sizes that split
// a tile into whole 8-row swizzle atoms (8 | page_size, and page_size | tile_rows or
// tile_rows | page_size); kCpAsync otherwise.
inline PrefillTensorMaps paged_kv_maps(const AttentionParams& p, int head_dim, int tile_rows) {
    PrefillTensorMaps m;
    const int page = p.page_size;
    const bool shape_ok = p.num_pages > 0 && page % 8 == 0 && page <= 256 &&
                          (tile_rows % page == 0 || page % tile_rows == 0);
    const int box = std::min(page, tile_rows);
    const bool ok = shape_ok &&
                    encode_kv_map(&m.k, p.k, p.num_pages, page, p.kv_heads, head_dim, p.k_stride_b, p.k_stride_l,
                                  p.k_stride_h, box) &&
                    encode_kv_map(&m.v, p.v, p.num_pages, page, p.kv_heads, head_dim, p.v_stride_b, p.v_stride_l,
                                  p.v_stride_h, box);
    m.mode = ok ? PrefillTensorMaps::kTmaWholeTiles : PrefillTensorMaps::kCpAsync;
    m.box_rows = box;
    // A tile over pages with consecutive ids is one run of rows where pages are stored back
    // to back: one box per panel instead of tile_rows / page_size (the page-16 tiles' 8 boxes
    // per panel cost 10-15 % against 1; a fresh cache hands out pages in order).
    const int64_t run_rows = int64_t(p.num_pages) * page;
    m.run_maps = ok && box < tile_rows && run_rows < (int64_t(1) << 31) && p.k_stride_b == page * p.k_stride_l &&
                 p.v_stride_b == page * p.v_stride_l &&
                 encode_kv_map(&m.k_run, p.k, 1, int(run_rows), p.kv_heads, head_dim, 0, p.k_stride_l, p.k_stride_h,
                               tile_rows) &&
                 encode_kv_map(&m.v_run, p.v, 1, int(run_rows), p.kv_heads, head_dim, 0, p.v_stride_l, p.v_stride_h,
                               tile_rows);
    return m;
}

}  // namespace astrai::attn
