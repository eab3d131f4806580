// A 4x4 byte transpose in registers (four PRMTs a pair): the FP8 quantize-transpose and the
// GEMM's crosswise loads both turn four row words into four column words with it.
#pragma once

#include <cstdint>

namespace astrai::fp8 {

// in w_r: bytes (row r, cols 0..3); out[c]: bytes (rows 0..3, col c).
__device__ __forceinline__ void transpose_bytes4x4(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                                   uint32_t (&out)[4]) {
  const uint32_t t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);
  const uint32_t t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);
  out[0] = __byte_perm(t0, t2, 0x5410);
  out[1] = __byte_perm(t0, t2, 0x7632);
  out[2] = __byte_perm(t1, t3, 0x5410);
  out[3] = __byte_perm(t1, t3, 0x7632);
}

}  // namespace astrai::fp8
