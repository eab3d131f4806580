// Attention family: the parameter POD shared by every kernel, host and device. No torch.
#pragma once

#include <cstdint>

namespace astrai::attn {

// 64 query rows per host Q tile: the unit of qo_indptr / q_tile_to_* metadata.
constexpr int kQTileRows = 64;
// mma.sync prefill: 4 warps of 16 rows each cover one host Q tile.
constexpr int kPrefillWarps = 4;
// Largest split count a decode launch may use (bounds the split-K workspace).
constexpr int kMaxDecodeSplits = 64;

// Two physical layouts reach the kernels; both are described by strides alone.
enum class TensorLayout : int { BLHD = 0, BHLD = 1 };

// Everything a kernel reads. Strides are in elements; the last dim is contiguous.
// Contiguous K/V: k[b, pos, h, :] = k + b*k_stride_b + pos*k_stride_l + h*k_stride_h.
// Paged K/V:      k_cache[page, slot, h, :] with k_stride_b = page stride and
//                 k_stride_l = slot stride.
// Dense Q:  q[b, row, h, :]; packed Q: q[qo_indptr[b] + row, h, :] (q_stride_b unused).
struct AttentionParams {
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    void* o = nullptr;
    int64_t q_stride_b = 0, q_stride_l = 0, q_stride_h = 0;
    int64_t k_stride_b = 0, k_stride_l = 0, k_stride_h = 0;
    int64_t v_stride_b = 0, v_stride_l = 0, v_stride_h = 0;
    int64_t o_stride_b = 0, o_stride_l = 0, o_stride_h = 0;

    // Optional bool mask (True = keep): mask[b*ms_b + row*ms_q + col*ms_k];
    // a 2D [B, kv] mask has mask_stride_q = 0.
    const uint8_t* mask = nullptr;
    int64_t mask_stride_b = 0, mask_stride_q = 0, mask_stride_k = 0;

    int batch = 0;
    int q_len = 0;   // dense schedules (decode: 1)
    int kv_len = 0;  // contiguous K/V
    int q_heads = 0;
    int kv_heads = 0;
    int group = 1;        // q_heads / kv_heads
    int head_block = 1;   // prefill: query heads packed per block (HB)
    int blocks_per_tile = 1;  // prefill: blocks sharing one 64-row host Q tile (set by the launcher)
    int tiles_per_block = 1;  // prefill: host Q tiles one block covers (2: the Hopper kernel's 128-row
                              // blocks of one query head)
    int head_groups = 1;  // ceil(group / rows-per-block heads): grid.y = kv_heads * head_groups
    bool causal = false;  // bottom-right aligned: row i sees kv j <= i + kv_len - q_len
    // 12 bytes nothing reads (of a deleted persistent prefill's work grid and counter), kept so that
    // the fields below stay where the kernels were measured: without them the fp8 paged mma.sync
    // prefill at d128 takes 1-2 more registers.
    int reserved_a_ = 0;
    // ALiBi (variant.cuh): float32 [q_heads] slopes, natural units of the scaled score; null: none.
    const float* alibi_slopes = nullptr;
    int reserved_b_[2] = {};
    float scale_log2 = 0.f;  // what a raw score q.k is multiplied by before exp2 (variant.cuh)

    // The variant (variant.cuh; set by set_variant_params): soft-cap factors (cap_log2 = 0:
    // none), the window (-1: none) and the sinks (float32 [q_heads], natural-log units; null: none).
    float cap_in = 0.f, cap_log2 = 0.f;
    int window_left = -1;
    const float* sinks = nullptr;

    // FP8 pages (the paged decode kernel's KvE4M3 / KvE5M2 instantiations): the layer's float32
    // dequantization scales, one per tensor (kv_scale_stride 0) or per kv head (1).
    const float* k_scale = nullptr;
    const float* v_scale = nullptr;
    int kv_scale_stride = 0;

    // Paged K/V.
    const int32_t* kv_indptr = nullptr;
    const int32_t* kv_indices = nullptr;
    const int32_t* kv_lens = nullptr;
    int page_size = 1;
    int page_shift = 0;  // log2(page_size) when a power of two, else -1
    int num_pages = 0;   // pages in the cache (k_cache.size(0)); 0: unknown

    // Packed (ragged) Q.
    const int32_t* qo_indptr = nullptr;
    const int32_t* q_tile_to_batch = nullptr;
    const int32_t* q_tile_to_index = nullptr;
    int num_q_tiles = 0;
    int q_total_rows = 0;  // rows of the packed Q tensor (0: unknown; its TMA map needs it)

    // Split-K decode: partial outputs [num_splits][batch*q_heads][head_dim] and their
    // log2-sum-exp [num_splits][batch*q_heads]; unused when num_splits == 1.
    int num_splits = 1;
    float* ws_o = nullptr;
    float* ws_lse = nullptr;
    // Optional arrival counters, one per decode unit (request, kv head, head group), all 0
    // at launch and left 0: with them the mma decode kernel merges its own splits (the
    // last block of a unit does) and no combine kernel runs.
    int* ws_count = nullptr;

    // Paged decode's in-kernel append (decode_mma_kernel<PagedKV>; null: none): request b's
    // new key / value, the token at its last position kv_lens[b] - 1, are the rows
    // k_new + b * k_new_stride_b + h * k_new_stride_h (v_new alike; 16-byte aligned rows).
    const void* k_new = nullptr;
    const void* v_new = nullptr;
    int64_t k_new_stride_b = 0, k_new_stride_h = 0;
    int64_t v_new_stride_b = 0, v_new_stride_h = 0;
};

// Query rows a prefill block covers per head slot (rows_blk): a share of one host Q tile, or
// (tiles_per_block = 2) two whole tiles.
#ifdef __CUDACC__
__host__ __device__
#endif
inline int prefill_block_rows(const AttentionParams& p) {
    return kQTileRows * p.tiles_per_block / p.blocks_per_tile;
}

}  // namespace astrai::attn
