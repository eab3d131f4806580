// TMA tensor maps for the Hopper prefill's contiguous K/V: with them one producer thread
// moves a whole tile panel per instruction instead of 128 threads issuing a cp.async per
// 16 bytes (whose address arithmetic took a third of the kernel's issued instructions).
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cstdint>

#include "astrai/tensor_map.h"
#include "common.h"

namespace astrai::attn {

struct KvTensorMaps {  // CUtensorMap carries its own (64-byte+) alignment
    CUtensorMap k, v;
    // kCpAsync: the producer copies K/V with cp.async. kTma: every tile by TMA (contiguous
    // K/V, zeros past kv_len). kTmaWholeTiles: paged K/V, a box of box_rows positions per
    // page; tiles that end past kv_len by cp.async, which zero-fills instead of reading
    // stale page slots.
    enum Mode : int { kCpAsync = 0, kTma = 1, kTmaWholeTiles = 2 };
    int mode = kCpAsync;
    int box_rows = 0;
};

// A [outer, rows, kv_heads, head_dim] tensor of 16-bit elements with these element strides
// (contiguous K/V: outer = batch, rows = kv_len; paged: outer = pages, rows = page slots),
// read in boxes of box_rows rows x 64 elements of one head with the 128-byte swizzle: one
// panel of the kernel's PanelTile layout per box. Rows past `rows` read as zeros. False
// where TMA cannot address the tensor (unaligned base or strides).
inline bool encode_kv_map(CUtensorMap* map, const void* base, int outer, int rows, int kv_heads, int head_dim,
                          int64_t stride_outer, int64_t stride_row, int64_t stride_h, int box_rows) {
    const EncodeTiledFn encode = encode_tiled_fn();
    if (encode == nullptr || outer < 1 || rows < 1 || kv_heads < 1 || head_dim % 64 != 0) return false;
    if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
    // A dimension of extent 1 is never stepped: any valid stride describes it.
    const int64_t extents[3] = {kv_heads, rows, outer};
    const int64_t elem_strides[3] = {stride_h, stride_row, stride_outer};
    cuuint64_t strides[3];
    for (int i = 0; i < 3; ++i) {
        const int64_t bytes = extents[i] == 1 ? 16 : elem_strides[i] * 2;
        if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t(1) << 40)) return false;
        strides[i] = cuuint64_t(bytes);
    }
    const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(kv_heads), cuuint64_t(rows), cuuint64_t(outer)};
    const cuuint32_t box[4] = {64u, 1u, cuuint32_t(box_rows), 1u};
    const cuuint32_t steps[4] = {1u, 1u, 1u, 1u};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box, steps,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Both maps of a contiguous-K/V launch (tiles of tile_rows positions), or kCpAsync where
// either cannot be encoded.
inline KvTensorMaps contig_kv_maps(const AttentionParams& p, int head_dim, int tile_rows) {
    KvTensorMaps m;
    const bool ok = encode_kv_map(&m.k, p.k, p.batch, p.kv_len, p.kv_heads, head_dim, p.k_stride_b,
                                         p.k_stride_l, p.k_stride_h, tile_rows) &&
                    encode_kv_map(&m.v, p.v, p.batch, p.kv_len, p.kv_heads, head_dim, p.v_stride_b,
                                         p.v_stride_l, p.v_stride_h, tile_rows);
    m.mode = ok ? KvTensorMaps::kTma : KvTensorMaps::kCpAsync;
    m.box_rows = tile_rows;
    return m;
}

// Paged K/V [num_pages, page_size, kv_heads, head_dim]: the same encoding with pages as the
// batch dimension, boxes of min(page_size, tile_rows) slots. Needs page sizes that split
// a tile into whole 8-row swizzle atoms (8 | page_size, and page_size | tile_rows or
// tile_rows | page_size); kCpAsync otherwise.
inline KvTensorMaps paged_kv_maps(const AttentionParams& p, int head_dim, int tile_rows) {
    KvTensorMaps m;
    const int page = p.page_size;
    const bool shape_ok = p.num_pages > 0 && page % 8 == 0 && page <= 256 &&
                          (tile_rows % page == 0 || page % tile_rows == 0);
    const int box = std::min(page, tile_rows);
    const bool ok = shape_ok &&
                    encode_kv_map(&m.k, p.k, p.num_pages, page, p.kv_heads, head_dim, p.k_stride_b,
                                         p.k_stride_l, p.k_stride_h, box) &&
                    encode_kv_map(&m.v, p.v, p.num_pages, page, p.kv_heads, head_dim, p.v_stride_b,
                                         p.v_stride_l, p.v_stride_h, box);
    m.mode = ok ? KvTensorMaps::kTmaWholeTiles : KvTensorMaps::kCpAsync;
    m.box_rows = box;
    return m;
}

}  // namespace astrai::attn
