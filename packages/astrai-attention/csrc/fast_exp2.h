// 2^x on the FMA pipe, for some of the softmax's exponents: at d64 a Hopper prefill tile needs
// as many special-function-unit cycles (ex2: 16 results per clock per SM) as tensor-core
// cycles, so the Hopper prefill can hand a share of its exponents to the FMA pipe
// (ASTRAI_PREFILL_EXP2_EMULATE; FlashAttention-4 does this on Blackwell). Host and device code
// alike, so the CPU tests check this very function (tests/planner_module.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define ASTRAI_EXP2_HD __host__ __device__ __forceinline__
#else
#define ASTRAI_EXP2_HD inline
#endif

namespace astrai::attn {

// The bits of a float as another 4-byte type (memcpy: one register move on the GPU).
template <class To, class From>
ASTRAI_EXP2_HD To bit_cast(const From& from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
    To to;
    std::memcpy(&to, &from, sizeof to);
    return to;
}

// 2^x with a relative error below 1e-4 (P is rounded to bf16 / fp16 next: 4e-3 / 5e-4), 0 for
// x < -126 (masked scores are -inf), NaN for NaN. x = j + f, j = round(x) by the 1.5 * 2^23
// trick (x + 1.5 * 2^23 keeps j in its low mantissa bits), f in [-0.5, 0.5]; 2^f by a degree-3
// polynomial fitted for relative error, and 2^j added to its exponent bits.
ASTRAI_EXP2_HD float exp2_fma(float x) {
    constexpr float kRound = 12582912.f;
    const float xc = fmaxf(x, -126.f);
    const float shifted = xc + kRound;
    const float f = xc - (shifted - kRound);
    const float p = fmaf(fmaf(fmaf(0.05517167f, f, 0.24261115f), f, 0.69326097f), f, 0.99992806f);
    const float r = bit_cast<float>(bit_cast<uint32_t>(p) + (bit_cast<uint32_t>(shifted) << 23));
    return x >= -126.f ? r : x < -126.f ? 0.f : x;  // the last: NaN
}

}  // namespace astrai::attn
