// Fp8CollectiveEpilogue: C = bf16(scale * acc + bias), staged through shared memory.
//
// 1. scatter: each accumulator pair (visited through the mainloop's `visit`, so the
//    epilogue knows nothing of fragment layouts) is scaled, biased, rounded to bf16 and
//    written to a padded [rows][cols + 8] bf16 tile in the (now free) ring memory. With
//    swap_ab the kernel computed C^T, so the pair is written transposed (two scalar
//    stores) and the bias is indexed by the kernel's row.
// 2. copy-out: the tile leaves in coalesced 16-byte row segments (8 bf16), falling back
//    to 2-byte stores at ragged right edges or when C's rows are not 16-byte aligned.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "../common.h"
#include "policy.cuh"

namespace astrai::fp8 {

template <class Policy>
struct Fp8CollectiveEpilogue {
  using T = typename Policy::Traits;
  static constexpr int kThreads = T::kThreads;
  static constexpr int kPad = Fp8GemmSmem<T>::kPitchPad;

  __device__ __forceinline__ static uint16_t to_bf16(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  __device__ __forceinline__ static float bias_at(const uint16_t* bias, int idx, int limit) {
    return (bias != nullptr && idx < limit) ? __bfloat162float(__ushort_as_bfloat16(bias[idx]))
                                            : 0.f;
  }

  template <class Mainloop>
  __device__ __forceinline__ static void run(const FP8Params& p, int m0, int n0, bool c_vec,
                                             const typename Mainloop::Accum& acc, uint8_t* smem) {
    uint16_t* tile = reinterpret_cast<uint16_t*>(smem);
    const float scale = *p.scale;
    // Output tile in C's own orientation: rows x cols, C rows starting at crow0.
    const bool swap = p.swap_ab != 0;
    const int rows = swap ? T::kBlockN : T::kBlockM;
    const int cols = swap ? T::kBlockM : T::kBlockN;
    const int pitch = cols + kPad;

    if (!swap) {
      Mainloop::visit(acc, [&](int r, int c, float v0, float v1) {
        const float b0 = bias_at(p.bias, n0 + c, p.n), b1 = bias_at(p.bias, n0 + c + 1, p.n);
        const uint32_t packed = static_cast<uint32_t>(to_bf16(v0 * scale + b0)) |
                                (static_cast<uint32_t>(to_bf16(v1 * scale + b1)) << 16);
        *reinterpret_cast<uint32_t*>(tile + r * pitch + c) = packed;
      });
    } else {
      Mainloop::visit(acc, [&](int r, int c, float v0, float v1) {
        const float b = bias_at(p.bias, m0 + r, p.m);
        tile[c * pitch + r] = to_bf16(v0 * scale + b);
        tile[(c + 1) * pitch + r] = to_bf16(v1 * scale + b);
      });
    }
    __syncthreads();

    const int crow0 = swap ? n0 : m0, ccol0 = swap ? m0 : n0;
    const int crows = swap ? p.n : p.m, ccols = swap ? p.m : p.n;
    constexpr int kVec = 8;  // bf16 per 16-byte store
    const int segs = cols / kVec;
    for (int i = threadIdx.x; i < rows * segs; i += kThreads) {
      const int r = i / segs, c = (i % segs) * kVec;
      const int grow = crow0 + r, gcol = ccol0 + c;
      if (grow >= crows) continue;
      uint16_t* dst = p.c + static_cast<int64_t>(grow) * p.ldc + gcol;
      const uint16_t* src = tile + r * pitch + c;
      if (c_vec && gcol + kVec <= ccols) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (gcol + j < ccols) dst[j] = src[j];
      }
    }
  }
};

}  // namespace astrai::fp8
