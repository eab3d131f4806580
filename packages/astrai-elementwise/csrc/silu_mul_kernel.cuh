// SiLU-and-multiply of a fused gate/up projection: out[r, c] = silu(gate[r, c]) * up[r, c]
// where row r of the input holds gate in its first `inter` channels and up in the next
// `inter` (the layout of one linear with the gate and up weights stacked).
//
// Rounding as the torch ops round in the input dtype T: g = T(silu(float(gate))), then
// out = T(float(g) * float(up)); silu(v) = v / (1 + exp(-v)) in float32 (the division
// correctly rounded, so a large negative v gives -0, never NaN).
//
// Work items: kElems consecutive output channels of one row (one 16-byte access of gate,
// of up and of out on the vector path, one element on the scalar path), in (row, item)
// order; each thread takes kItems items a block-width apart and issues all their loads
// before using any.
#pragma once

#include <cstdint>

#include "astrai/fast_divmod.cuh"
#include "elementwise.cuh"

namespace astrai::norm {

struct SiluMulParams {
    const void* in = nullptr;  // [rows, 2 * inter], row stride in_stride
    void* out = nullptr;       // [rows, inter], row stride out_stride
    int64_t in_stride = 0, out_stride = 0;  // elements
    int64_t inter = 0;         // channels of gate (and of up, and of out)
    uint32_t total = 0;        // items of the launch: rows * per_row
    FastDivmod per_row;        // items per row: inter / kElems
};

template <typename T, int kElems>
struct SiluMulConfig {
    static constexpr int kThreads = 256;
    static constexpr int kItems = 2;
    static constexpr int kBytes = kElems * int(sizeof(T));
    static_assert(kBytes == 16 || kElems == 1, "an access is 16 bytes (vector path) or one element");

    static uint32_t blocks(uint32_t total) {
        constexpr uint32_t per_block = uint32_t{kThreads} * kItems;
        return (total + per_block - 1) / per_block;
    }
};

__device__ __forceinline__ float silu(float v) { return __fdiv_rn(v, 1.f + __expf(-v)); }

template <typename T, int kElems>
__global__ void __launch_bounds__(SiluMulConfig<T, kElems>::kThreads)
silu_and_mul_kernel(const SiluMulParams p) {
    using Config = SiluMulConfig<T, kElems>;
    constexpr int kBytes = Config::kBytes;
    constexpr int kItems = Config::kItems;
    alignas(16) T gate[kItems][kElems];
    alignas(16) T up[kItems][kElems];
    int64_t out_at[kItems];  // -1: past the launch's items
    const uint32_t base = blockIdx.x * (Config::kThreads * kItems) + threadIdx.x;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
        const uint32_t g = base + k * Config::kThreads;
        out_at[k] = -1;
        if (g < p.total) {
            uint32_t row, item;
            p.per_row.divmod(g, row, item);
            const T* in = static_cast<const T*>(p.in) + (int64_t{row} * p.in_stride + int64_t{item} * kElems);
            elementwise::load<kBytes, elementwise::Cache::Stream>(in, gate[k]);
            elementwise::load<kBytes, elementwise::Cache::Stream>(in + p.inter, up[k]);
            out_at[k] = int64_t{row} * p.out_stride + int64_t{item} * kElems;
        }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
        if (out_at[k] < 0) continue;
#pragma unroll
        for (int e = 0; e < kElems; ++e) {
            const T g = elementwise::from_float<T>(silu(elementwise::to_float(gate[k][e])));
            gate[k][e] = elementwise::from_float<T>(elementwise::to_float(g) * elementwise::to_float(up[k][e]));
        }
        elementwise::store<kBytes, false>(static_cast<T*>(p.out) + out_at[k], gate[k]);
    }
}

}  // namespace astrai::norm
