// Division by a run-time constant with a multiply-high and a shift (Granlund-Montgomery),
// for index math in kernels: the divisor is prepared once on the host, then
// div/divmod cost ~4 instructions instead of the ~20 of an integer division.
// Exact for every dividend n < 2^31 (the host check in the kernel's launcher keeps it so).
#pragma once

#include <cstdint>

#include "astrai/check.h"

namespace astrai {

struct FastDivmod {
    uint32_t divisor = 1;
    uint32_t multiplier = 1;
    uint32_t shift = 0;

    FastDivmod() = default;

    explicit FastDivmod(uint32_t d) : divisor(d) {
        ASTRAI_CHECK(d >= 1 && d <= (1u << 31), "FastDivmod: divisor ", d, " out of range");
        shift = 0;
        while ((uint64_t{1} << shift) < d) ++shift;
        multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
    }

    __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
        const uint32_t hi = __umulhi(n, multiplier);
#else
        const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
        return (hi + n) >> shift;
    }

    __host__ __device__ __forceinline__ void divmod(uint32_t n, uint32_t& quotient,
                                                    uint32_t& remainder) const {
        quotient = div(n);
        remainder = n - quotient * divisor;
    }
};

}  // namespace astrai
