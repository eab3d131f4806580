// Consumer-warpgroup epilogue: out = scale * row_scale[row] * col_scale[col] * acc + bias
// (a missing row / column scale is 1), rounded to bf16 (or fp32 for the accuracy tests),
// written straight from the wgmma accumulator layout with row / column guards for ragged M
// and N. A quad of lanes covers 8 contiguous columns of one row.
// Swap (the swap-AB configs): the accumulator tile is out^T (rows over N, columns over M),
// so element (r, c) goes to out[c, r] and the bias is indexed by the row; p.M / p.N are
// the kernel's dimensions (N and M of the product), and so are its row / column scales.
#pragma once

#include <cuda_bf16.h>

#include "params.h"

namespace astrai::fp8::sm90 {

template <int BN, bool Swap = false>
struct Epilogue {
    static constexpr int kRegs = BN / 2;

    __device__ __forceinline__ static float row_factor(const GemmParams& p, int row, float scale) {
        return p.row_scale != nullptr ? scale * p.row_scale[row] : scale;
    }
    __device__ __forceinline__ static float col_factor(const GemmParams& p, int col) {
        return p.col_scale != nullptr ? p.col_scale[col] : 1.f;
    }

    __device__ __forceinline__ static void store_pair(const GemmParams& p, int row, int col,
                                                      float v0, float v1) {
        const bool two = col + 1 < p.N;
        if (p.out_f32) {
            float* o = static_cast<float*>(p.out) + static_cast<int64_t>(row) * p.ldc + col;
            if (two && p.vec_store) {
                *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
            } else {
                o[0] = v0;
                if (two) o[1] = v1;
            }
            return;
        }
        __nv_bfloat16* o =
            static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(row) * p.ldc + col;
        if (two && p.vec_store) {
            *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
        } else {
            o[0] = __float2bfloat16_rn(v0);
            if (two) o[1] = __float2bfloat16_rn(v1);
        }
    }

    __device__ __forceinline__ static void store_one(const GemmParams& p, int row, int col, float v) {
        const int64_t at = static_cast<int64_t>(row) * p.ldc + col;
        if (p.out_f32) {
            static_cast<float*>(p.out)[at] = v;
        } else {
            static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(v);
        }
    }

    // Swap: tile rows are output columns. A quad's 8 lanes write 8 consecutive columns of
    // one output row (16 bytes in bf16): the output is only M <= 64 rows tall here.
    __device__ __forceinline__ static void store_transposed(const GemmParams& p,
                                                            const float (&acc)[kRegs],
                                                            int row_base, int col_base,
                                                            float scale) {
        const int warp = (threadIdx.x / 32) % 4;
        const int lane = threadIdx.x % 32;
        const int row0 = row_base + warp * 16 + lane / 4;
        const int col0 = col_base + 2 * (lane % 4);
        const __nv_bfloat16* bias = static_cast<const __nv_bfloat16*>(p.bias);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;  // an output column (N)
            if (row >= p.M) continue;
            const float b = bias != nullptr ? __bfloat162float(bias[row]) : 0.f;
            const float f = row_factor(p, row, scale);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = col0 + 8 * j + e;  // an output row (M)
                    if (col < p.N) store_one(p, col, row, acc[4 * j + 2 * h + e] * f * col_factor(p, col) + b);
                }
            }
        }
    }

    // rows [row_base, row_base + 64) of the CTA tile belong to this warpgroup
    __device__ __forceinline__ static void store(const GemmParams& p, const float (&acc)[kRegs],
                                                 int row_base, int col_base, float scale) {
        if constexpr (Swap) {
            store_transposed(p, acc, row_base, col_base, scale);
            return;
        }
        const int warp = (threadIdx.x / 32) % 4;
        const int lane = threadIdx.x % 32;
        const int row0 = row_base + warp * 16 + lane / 4;
        const int col0 = col_base + 2 * (lane % 4);
        const __nv_bfloat16* bias = static_cast<const __nv_bfloat16*>(p.bias);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = col0 + 8 * j;
            if (col < p.N) {
                float b0 = 0.f, b1 = 0.f;
                if (bias != nullptr) {
                    b0 = __bfloat162float(bias[col]);
                    if (col + 1 < p.N) b1 = __bfloat162float(bias[col + 1]);
                }
                const float c0 = col_factor(p, col), c1 = col + 1 < p.N ? col_factor(p, col + 1) : 1.f;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = row0 + 8 * h;
                    if (row < p.M) {
                        const float f = row_factor(p, row, scale);
                        store_pair(p, row, col, acc[4 * j + 2 * h] * f * c0 + b0,
                                   acc[4 * j + 2 * h + 1] * f * c1 + b1);
                    }
                }
            }
        }
    }
};

}  // namespace astrai::fp8::sm90
