// What the element-wise kernels of this plugin share: float conversions of the three
// dtypes and memory accesses of a fixed width (16 bytes on the vector paths).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace astrai::elementwise {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float(float v) { return v; }
template <>
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }

// One memory access of kBytes.
template <int kBytes>
struct Word;
template <>
struct Word<16> { using type = uint4; };
template <>
struct Word<8> { using type = uint2; };
template <>
struct Word<4> { using type = unsigned int; };
template <>
struct Word<2> { using type = unsigned short; };
template <>
struct Word<1> { using type = unsigned char; };

// How a load meets the caches: Stream reads evict-first (data read once), ReadOnly through
// the read-only cache (data every block reads, never written by the kernel), Plain as an
// ordinary coherent load (data the kernel writes and reads again).
enum class Cache { Stream, ReadOnly, Plain };

// N values of T from src in accesses of kChunk bytes (src aligned to kChunk).
template <int kChunk, Cache kCache, typename T, int N>
__device__ __forceinline__ void load(const T* src, T (&dst)[N]) {
    using W = typename Word<kChunk>::type;
    static_assert(N * sizeof(T) % kChunk == 0, "whole accesses only");
#pragma unroll
    for (int w = 0; w < int(N * sizeof(T) / kChunk); ++w) {
        const W* from = reinterpret_cast<const W*>(src) + w;
        if constexpr (kCache == Cache::Stream) {
            reinterpret_cast<W*>(dst)[w] = __ldcs(from);
        } else if constexpr (kCache == Cache::ReadOnly) {
            reinterpret_cast<W*>(dst)[w] = __ldg(from);
        } else {
            reinterpret_cast<W*>(dst)[w] = *from;
        }
    }
}

// N values of T to dst in accesses of kChunk bytes; kStream writes evict-first (not read
// again soon), else as plain stores (the next kernel reads them).
template <int kChunk, bool kStream = true, typename T, int N>
__device__ __forceinline__ void store(T* dst, const T (&src)[N]) {
    using W = typename Word<kChunk>::type;
#pragma unroll
    for (int w = 0; w < int(N * sizeof(T) / kChunk); ++w) {
        W* to = reinterpret_cast<W*>(dst) + w;
        const W value = reinterpret_cast<const W*>(src)[w];
        if constexpr (kStream) {
            __stcs(to, value);
        } else {
            *to = value;
        }
    }
}

}  // namespace astrai::elementwise
