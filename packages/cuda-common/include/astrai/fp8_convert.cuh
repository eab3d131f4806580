// FP8 byte pairs into packed float16 pairs, exactly: what the attention plugin's fp8 pages and
// the FP8 plugin's weight GEMM convert into mma.sync fragments. One hardware conversion on
// sm_89+, which reads either half of a 32-bit word in place (NaN stays NaN); cuda_fp8.h's
// software form below that.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace astrai {

// Two fp8 values (bytes 0, 1 of x, or with kHigh bytes 2, 3) of the format with kExpBits
// exponent bits (4: e4m3, 5: e5m2) as a packed float16 pair.
template <int kExpBits, bool kHigh = false>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t x) {
    static_assert(kExpBits == 4 || kExpBits == 5, "e4m3 or e5m2");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t h;
    if constexpr (kExpBits == 4 && kHigh) {
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(h) : "r"(x));
    } else if constexpr (kExpBits == 4) {
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(h) : "r"(x));
    } else if constexpr (kHigh) {
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e5m2x2 %0, h;}" : "=r"(h) : "r"(x));
    } else {
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e5m2x2 %0, l;}" : "=r"(h) : "r"(x));
    }
    return h;
#else
    const uint32_t bytes = kHigh ? x >> 16 : x & 0xffffu;
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bytes), kExpBits == 4 ? __NV_E4M3 : __NV_E5M2);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
#endif
}

}  // namespace astrai
