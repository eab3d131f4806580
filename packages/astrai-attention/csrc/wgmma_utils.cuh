// Hopper (sm_90a) helpers of the warp-specialized prefill: register fences around asynchronous MMAs, and shared-memory descriptors of
// 128-byte-swizzled tiles (the MMAs themselves: wgmma_ops.cuh). Callers guard device code
// with ASTRAI_ATTN_SM90 (sm_90a only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "astrai/device.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ASTRAI_ATTN_SM90 1
#else
#define ASTRAI_ATTN_SM90 0
#endif

namespace astrai::attn {

// built_for_sm90(): astrai/device.cuh (whether the module holds the sm_90a kernels).

#if ASTRAI_ATTN_SM90
// Keeps the compiler from reading accumulators before the wait or moving writes across an issue.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[i][e])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_fragments(uint32_t (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}
#endif

// Descriptor of a tile stored as 128-byte rows with the 16-byte chunks of row r XOR-ed by
// (r & 7), 8-row atoms 1024 bytes apart (the tile base 1024-byte aligned). lead / stride are
// the PTX leading / stride dimension byte offsets: for a K-major operand lead is unused and
// stride = 1024 (the next 8 rows); for an MN-major one lead steps to the next 64-element
// panel along M / N and stride to the next 8 rows along K.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lead, uint32_t stride) {
    uint64_t d = uint64_t((saddr & 0x3FFFF) >> 4);
    d |= uint64_t((lead >> 4) & 0x3FFF) << 16;
    d |= uint64_t((stride >> 4) & 0x3FFF) << 32;
    d |= uint64_t(1) << 62;  // 128-byte swizzle
    return d;
}

}  // namespace astrai::attn
