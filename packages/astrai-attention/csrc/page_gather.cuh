// A batch's K/V pages copied in page-table order into consecutive pages of the compute dtype,
// FP8 pages dequantized on the way: what the core runs before a long prefill over FP8 or
// scattered pages (backend/attention/ordered_pages.py), so the Hopper prefill reads 16-bit pages
// a box per panel. One launch for K and V: a block per page of each, 8 values (16 output bytes)
// a thread, two at a time.
//
// out[i] = pages[source[i]] (16-bit pages), or T(float(stored) * scale[head]) (fp8 pages):
// the byte pair widened exactly to float16 by the hardware, the product rounded once in IEEE
// float32 (mul.rn.f32, no flush to zero whatever the build's flags), then to T with round to
// nearest even: kv_quant.dequantize's arithmetic. A source page outside [0, num_pages) writes
// NaN (a loud result, never a read outside the cache).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "astrai/check.h"
#include "kv_fp8.cuh"

namespace astrai::attn {

struct PageGatherParams {
    const void* src[2] = {};  // K, V pages [num_pages, page, Hkv, D] (pages `page_stride` elements apart)
    void* dst[2] = {};        // K, V out [n, page, Hkv, D], contiguous
    const int64_t* source = nullptr;  // [n]: the cache page of out page i
    int64_t n = 0, num_pages = 0, page_stride = 0;
    int vectors_per_page = 0;  // page * Hkv * D / 8
    int head_dim = 0, kv_heads = 0;
    const float* scale[2] = {};  // fp8 pages: K, V scales, per tensor (stride 0) or per kv head
    int scale_stride = 0;
};

__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

template <typename T>
__device__ __forceinline__ uint32_t pack_rn(float lo, float hi) {
    if constexpr (std::is_same_v<T, __half>) {
        const __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&h);
    } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&h);
    }
}

// Four fp8 values (one 32-bit word) times `scale`, as two packed pairs of T.
template <typename T, class KvFmt>
__device__ __forceinline__ uint2 dequantize4(uint32_t word, float scale) {
    uint2 out;
    uint32_t* o = &out.x;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint32_t h2 = half ? fp8x2_to_half2<KvFmt, true>(word) : fp8x2_to_half2<KvFmt>(word);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
        o[half] = pack_rn<T>(mul_rn(f.x, scale), mul_rn(f.y, scale));
    }
    return out;
}

// Block 2i + t copies out page i of tensor t (0: K, 1: V), 16 bytes a thread and pass. The
// tensor's pointers are picked by selects: an index into the parameter arrays would copy them to
// local memory.
template <typename T, class KvFmt>
__global__ void __launch_bounds__(256) page_gather_kernel(const PageGatherParams p) {
    const bool is_v = blockIdx.x & 1;
    const int64_t i = blockIdx.x >> 1;
    const void* src = is_v ? p.src[1] : p.src[0];
    T* dst = static_cast<T*>(is_v ? p.dst[1] : p.dst[0]) + i * p.vectors_per_page * 8;
    const float* scale = is_v ? p.scale[1] : p.scale[0];
    const int64_t from = __ldg(p.source + i);
    if (from < 0 || from >= p.num_pages) {
        const uint32_t nan = pack_rn<T>(__int_as_float(0x7fffffff), __int_as_float(0x7fffffff));
        for (int v = threadIdx.x; v < p.vectors_per_page; v += blockDim.x)
            reinterpret_cast<uint4*>(dst)[v] = make_uint4(nan, nan, nan, nan);
        return;
    }
    // two vectors a pass, both loads issued before either store (twice the bytes in flight)
    using Load = std::conditional_t<KvFmt::kBytes == 2, uint4, uint2>;
    const Load* page = reinterpret_cast<const Load*>(static_cast<const uint8_t*>(src) +
                                                     from * p.page_stride * KvFmt::kBytes);
    for (int v0 = threadIdx.x; v0 < p.vectors_per_page; v0 += 2 * blockDim.x) {
        const int v1 = v0 + blockDim.x;
        const bool second = v1 < p.vectors_per_page;
        const Load a = __ldcs(page + v0);
        const Load b = second ? __ldcs(page + v1) : a;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int v = k ? v1 : v0;
            if (k && !second) break;
            const Load x = k ? b : a;
            if constexpr (KvFmt::kBytes == 2) {
                reinterpret_cast<uint4*>(dst)[v] = x;
            } else {
                const float sc = __ldg(scale + ((v * 8) / p.head_dim % p.kv_heads) * p.scale_stride);
                const uint2 lo = dequantize4<T, KvFmt>(x.x, sc), hi = dequantize4<T, KvFmt>(x.y, sc);
                reinterpret_cast<uint4*>(dst)[v] = make_uint4(lo.x, lo.y, hi.x, hi.y);
            }
        }
    }
}

template <typename T, class KvFmt>
void launch_page_gather(const PageGatherParams& p, cudaStream_t stream) {
    if (p.n == 0) return;
    page_gather_kernel<T, KvFmt><<<unsigned(2 * p.n), 256, 0, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
}

}  // namespace astrai::attn
