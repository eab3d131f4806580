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
//
// silu_and_mul_fp8_kernel writes the row as e4m3 with its per-token scale instead (row_fp8.cuh:
// the W8A8 down projection's quantize, fused; the bytes equal silu_and_mul then quantize). The
// amax needs the whole row, so there one block takes one row: its kVecs accesses a thread held
// in registers across the amax's barrier, or with kVecs = 0 two passes (the amax, then the bytes).
// With kCluster (sm_90, few rows: silu_fp8_split) a cluster of 2-4 blocks shares a row, block
// rank r taking accesses [r * p.accesses, (r + 1) * p.accesses) of p.row_accesses, their amaxes
// met through distributed shared memory (ClusterRow): 64 rows fill 128 SMs, not 64. Every block
// of the row writes its scale (the same value).
#pragma once

#include <cstdint>
#include <type_traits>

#include "astrai/check.h"
#include "astrai/fast_divmod.cuh"
#include "elementwise.cuh"
#include "norm_kernel.cuh"
#include "row_fp8.cuh"

namespace astrai::norm {

struct SiluMulParams {
    const void* in = nullptr;  // [rows, 2 * inter], row stride in_stride
    void* out = nullptr;       // [rows, inter], row stride out_stride
    int64_t in_stride = 0, out_stride = 0;  // elements
    int64_t inter = 0;         // channels of gate (and of up, and of out)
    uint32_t total = 0;        // items of the launch: rows * per_row
    FastDivmod per_row;        // items per row: inter / kElems
    uint8_t* q = nullptr;      // fp8 kernel: out as e4m3 [rows, inter], row stride q_stride bytes
    float* scale = nullptr;    // fp8 kernel: [rows] dequantization scales
    int64_t q_stride = 0;
    int32_t accesses = 0;      // fp8 kernel: per row (per block of a cluster), of inter / kElems
    int32_t row_accesses = 0;  // fp8 cluster kernel: per row, inter / kElems
};

// Blocks of a cluster to share each row of the e4m3 SiLU-and-mul (1: a block a row): on sm_90
// code and device, as many as the SMs leave room for (at most 4) while each keeps >= 128 accesses.
inline int silu_fp8_split(int64_t rows, int64_t accesses, int sms, bool sm90) {
    if (!sm90 || rows <= 0) return 1;
    int64_t split = sms / rows;
    if (split > 4) split = 4;
    if (split > accesses / 128) split = accesses / 128;
    return split < 2 ? 1 : static_cast<int>(split);
}

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

// gate = T(float(T(silu(gate))) * float(up)).
template <typename T, int kElems>
__device__ __forceinline__ void silu_times(T (&gate)[kElems], const T (&up)[kElems]) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
        const T g = elementwise::from_float<T>(silu(elementwise::to_float(gate[e])));
        gate[e] = elementwise::from_float<T>(elementwise::to_float(g) * elementwise::to_float(up[e]));
    }
}

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
        silu_times(gate[k], up[k]);
        elementwise::store<kBytes, false>(static_cast<T*>(p.out) + out_at[k], gate[k]);
    }
}

template <typename T, int kElems, int kVecs, bool kCluster = false>
__global__ void __launch_bounds__(NormConfig<T, kElems, kVecs>::kMaxThreads)
silu_and_mul_fp8_kernel(const SiluMulParams p) {
    using Config = NormConfig<T, kElems, kVecs>;
    constexpr int kBytes = Config::kBytes;
    using elementwise::Cache;
    __shared__ uint32_t partial_max[Config::kMaxWarps];
    uint32_t* cluster_word = nullptr;
    int64_t row = blockIdx.x;
    int accesses = p.accesses;  // this block's of the row
    const T* in = static_cast<const T*>(p.in);
    uint8_t* q = p.q;
    if constexpr (kCluster) {
        __shared__ uint32_t word;
        unsigned rank, blocks;
        elementwise::cluster_place(rank, blocks);
        cluster_word = &word;
        row = blockIdx.x / blocks;
        const int first = static_cast<int>(rank) * p.accesses;
        accesses = max(0, min(p.accesses, p.row_accesses - first));
        in += int64_t{first} * kElems;
        q += int64_t{first} * kElems;
    }
    in += row * p.in_stride;
    q += row * p.q_stride;
    // the row's scale from a thread's largest |y| bits: the block's (BlockRow) or the cluster's
    using ScaleOf = std::conditional_t<kCluster, elementwise::ClusterRow, elementwise::BlockRow>;
    const ScaleOf scale_of{cluster_word};
    // the product at access `at` (into gate)
    const auto product = [&](int at, T (&gate)[kElems]) {
        alignas(16) T up[kElems];
        elementwise::load<kBytes, Cache::Plain>(in + int64_t{at} * kElems, gate);
        elementwise::load<kBytes, Cache::Plain>(in + p.inter + int64_t{at} * kElems, up);
        silu_times(gate, up);
    };
    if constexpr (kVecs == 0) {
        elementwise::store_row_fp8_twice<T, kElems>(q, accesses, partial_max, p.scale, row, product, scale_of);
    } else {
        alignas(16) T gate[kVecs][kElems];
        alignas(16) T up[kVecs][kElems];
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
            const int at = i * blockDim.x + threadIdx.x;
            if (at < accesses) {
                elementwise::load<kBytes, Cache::Stream>(in + int64_t{at} * kElems, gate[i]);
                elementwise::load<kBytes, Cache::Stream>(in + p.inter + int64_t{at} * kElems, up[i]);
            }
        }
        elementwise::store_row_fp8(q, gate, accesses, partial_max, p.scale, row,
                                   [&](int i) { silu_times(gate[i], up[i]); }, scale_of);
    }
    if constexpr (kCluster) elementwise::end_cluster_row();
}

// Each row over a cluster of blocks (the e4m3 SiLU-and-mul's split: p.row_accesses in blocks of
// p.accesses).
template <typename Kernel>
void launch_cluster_rows(Kernel kernel, const SiluMulParams& p, int64_t rows, int threads, cudaStream_t stream) {
    const unsigned split = static_cast<unsigned>((p.row_accesses + p.accesses - 1) / p.accesses);
    cudaLaunchAttribute cluster[1];
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = split;
    cluster[0].val.clusterDim.y = cluster[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(rows) * split);
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.stream = stream;
    config.attrs = cluster;
    config.numAttrs = 1;
    ASTRAI_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

}  // namespace astrai::norm
