// Policies that plug into the one kernel body per kind.
//
// Q schedules turn a block index into (request, request-local row range); a 64-row host Q
// tile is shared by blocks_per_tile blocks (HB * 64 / rows per block), or a block covers
// tiles_per_block whole tiles (the Hopper kernel's 128 rows of one query head). Causal
// launches take the host tiles last-first, so the longest rows of each head start first:
//   DenseQSchedule   grid (num_q_tiles * bpt / tpb, kv_heads * head_groups, batch)
//   PackedQSchedule  grid (num_q_tiles * bpt, kv_heads * head_groups, 1) over a packed
//                    [total_q, heads, dim] Q, O(1) through q_tile_to_batch / q_tile_to_index;
//                    with tpb = 2 a block starts at a request's even tiles, and the block of
//                    an odd tile (covered by the one before) has no rows.
// KV sources only give a request's KV length and the address of a logical position;
// they schedule nothing:
//   ContigKV  k[b, pos, h, :]
//   PagedKV   k_cache[kv_indices[kv_indptr[b] + pos / page_size], pos % page_size, h, :]
#pragma once

#include "common.h"

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

// A block's coordinates in the launch grid, (q tile block, kv head group, request). A
// persistent kernel walks the same coordinates as work items; grid_x is the grid's x extent.
struct BlockCoord {
    int x, y, z, grid_x;
    __device__ static BlockCoord of_launch() {
        return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), int(gridDim.x)};
    }
};

// The block's index along the Q tiles: reversed for causal launches.
__device__ __forceinline__ int q_block_index(const AttentionParams& p, const BlockCoord& c) {
    return p.causal ? c.grid_x - 1 - c.x : c.x;
}

struct DenseQSchedule {
    static constexpr bool kPacked = false;
    __device__ static QWork get(const AttentionParams& p, const BlockCoord& c = BlockCoord::of_launch()) {
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
};

struct PackedQSchedule {
    static constexpr bool kPacked = true;
    __device__ static QWork get(const AttentionParams& p, const BlockCoord& c = BlockCoord::of_launch()) {
        const int bpt = p.blocks_per_tile;
        const int bx = q_block_index(p, c);
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
};

// KV sources resolve a position in two steps so loaders can software-pipeline the
// dependent page-table read: fetch(pos) issues the (possibly global) lookup one tile ahead,
// offsets(handle, pos) is pure arithmetic when the copy is issued.
struct ContigKV {
    static constexpr bool kPaged = false;
    struct Request {
        int64_t k_base, v_base;
    };
    using Handle = int;
    __device__ static int kv_len(const AttentionParams& p, int /*b*/) { return p.kv_len; }
    __device__ static Request request(const AttentionParams& p, int b) {
        return {int64_t(b) * p.k_stride_b, int64_t(b) * p.v_stride_b};
    }
    __device__ static Handle fetch(const AttentionParams&, const Request&, int pos) { return pos; }
    // Element offsets of (position pos, kv head h) for K and for V.
    __device__ static void offsets(const AttentionParams& p, const Request& r, Handle, int pos, int h,
                                   int64_t& k_off, int64_t& v_off) {
        k_off = r.k_base + int64_t(pos) * p.k_stride_l + int64_t(h) * p.k_stride_h;
        v_off = r.v_base + int64_t(pos) * p.v_stride_l + int64_t(h) * p.v_stride_h;
    }
};

struct PagedKV {
    static constexpr bool kPaged = true;
    struct Request {
        const int32_t* pages;  // this request's page ids: kv_indices + kv_indptr[b]
        uint32_t magic;        // page_of(pos) = (umulhi(pos, magic) + pos) >> shift
        int shift;
    };
    using Handle = int;  // the page id holding the position
    __device__ static int kv_len(const AttentionParams& p, int b) { return p.kv_lens[b]; }
    // One reciprocal per block, so the per-position page lookup is branch-free for any
    // page size: magic = 0 and shift = log2(page) for a power of two; otherwise the
    // round-up reciprocal with shift = ceil(log2(page)), exact for 0 <= pos < 2^31.
    __device__ static Request request(const AttentionParams& p, int b) {
        Request r{p.kv_indices + p.kv_indptr[b], 0u, p.page_shift};
        if (p.page_shift < 0) {
            const uint32_t d = uint32_t(p.page_size);
            r.shift = 32 - __clz(d - 1);
            r.magic = uint32_t((uint64_t((uint64_t(1) << r.shift) - d) << 32) / d + 1);
        }
        return r;
    }
    __device__ static int page_of(const Request& r, int pos) {
        return int((__umulhi(uint32_t(pos), r.magic) + uint32_t(pos)) >> r.shift);
    }
    __device__ static Handle fetch(const AttentionParams&, const Request& r, int pos) {
        return __ldg(r.pages + page_of(r, pos));
    }
    __device__ static void offsets(const AttentionParams& p, const Request& r, Handle page, int pos, int h,
                                   int64_t& k_off, int64_t& v_off) {
        // Page ids, slots and strides are non-negative: unsigned 32 x 64-bit products are
        // two instructions each (a signed one needs the sign extension too).
        const uint64_t pg = uint32_t(page);
        const uint64_t slot = uint32_t(pos - page_of(r, pos) * p.page_size);
        k_off = int64_t(pg * uint64_t(p.k_stride_b) + slot * uint64_t(p.k_stride_l)) + int64_t(h) * p.k_stride_h;
        v_off = int64_t(pg * uint64_t(p.v_stride_b) + slot * uint64_t(p.v_stride_l)) + int64_t(h) * p.v_stride_h;
    }
};

}  // namespace astrai::attn
