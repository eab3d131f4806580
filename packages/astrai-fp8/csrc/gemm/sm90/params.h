// Run-time parameters of one Hopper FP8 GEMM launch (host-built POD, passed by value).
//   out[m, n] = scale * row_scale[m] * col_scale[n] * sum_k A[m, k] * B[n, k] + bias[n]
//   (A [M,K], B [N,K], K-major; row_scale / col_scale null: 1)
#pragma once

#include <cstdint>

namespace astrai::fp8::sm90 {

struct GemmParams {
    int M, N, K;
    int tiles_m, tiles_n, num_tiles;
    int k_blocks;       // ceil(K / kBK); the K tail is zero-filled by TMA
    int group_m;        // grouped raster: tile rows per group
    void* out;          // bf16 (or fp32 when out_f32) [M, ldc]
    int64_t ldc;        // elements
    int out_f32;        // 1: fp32 output (tests of the accumulation), 0: bf16
    int vec_store;      // 1: out and ldc allow 2-element stores
    const void* bias;   // bf16 [N] or nullptr
    const float* scale; // device scalar (combined dequant scale) or nullptr for 1
    const float* row_scale;  // float32 [M] (per row of the kernel's A) or nullptr
    const float* col_scale;  // float32 [N] (per row of the kernel's B) or nullptr
    int k_per_split;    // split-K: rank r sums k-blocks [r * k_per_split, (r + 1) * k_per_split) of k_blocks
};

}  // namespace astrai::fp8::sm90
