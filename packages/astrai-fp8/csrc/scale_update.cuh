// Delayed-scaling update: one kernel for a whole step's amax-history roll and rescale.
//
//   scale_update_kernel<MostRecent>   one block per row of hist [rows][len]:
//     hist[r]   <- [pending[r], hist[r][0], ..., hist[r][len-2]]   (newest first, in place)
//     amax      =  pending[r] (most_recent) or the max of the new row, NaN-propagating
//     s         =  amax * factor if amax is finite and > 0, else prev_scale[r]
//     scale[r] = s, scale_inv[r] = 1 / s, pending[r] = 0
//
// The values are bit for bit those of the torch ops the core used before
// (cat / amax / nan_to_num / where / reciprocal on CUDA, IEEE float32 with subnormals):
// the product and the reciprocal are inline PTX mul.rn.f32 / rcp.rn.f32, so neither the
// plugin's --use_fast_math (ftz, approximate division) nor -ftz can change them, and every
// comparison is on integer keys of the IEEE bits (order_key), never on float compares.
//
// The roll: each warp owns one segment of the row. Every warp first reads the element
// just before its segment (warp 0: pending[r]), one __syncthreads, then walks its segment
// front to back 32 x kUnroll elements at a time: lane i writes the value lane i-1 read
// (a shuffle), lane 0 the previous step's last value. No thread writes an element another
// thread reads after the barrier, so any len works without a staging buffer.
// No torch; argument checks are the caller's job (ops.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "astrai/check.h"

namespace astrai::fp8 {

struct ScaleUpdateParams {
  float* hist;              // [rows][len], contiguous, updated in place
  float* pending;           // [rows]: the step's amaxes; zeroed
  const float* prev_scale;  // [rows]: kept where the amax is unusable; may alias scale
  float* scale;             // [rows]
  float* scale_inv;         // [rows]
  float factor;             // 2**margin / fp8_max
  int64_t rows;             // the grid
  int64_t len;              // history length L >= 1
  int64_t segment;          // elements per warp (set by scale_update_launch)
  int most_recent;          // 1: amax = pending[r]; 0: max over the new row
};

// Launch shape: a pure function of len (testable without a GPU).
struct ScaleUpdateConfig {
  static constexpr int kMaxWarps = 8;
  static constexpr int kUnroll = 4;              // elements per lane per step
  static constexpr int kStep = 32 * kUnroll;     // elements per warp per step
  static_assert(kMaxWarps >= 1 && kMaxWarps <= 32, "the block reduce keeps one key per warp");
  static_assert(kUnroll >= 1 && kUnroll <= 8, "1..8 elements per lane per step");

  int warps;        // ceil(len / kStep), 1..kMaxWarps
  int64_t segment;  // ceil(len / warps) rounded up to a warp (trailing warps may get less or none)

  int threads() const { return warps * 32; }
};

inline ScaleUpdateConfig scale_update_config(int64_t len) {
  int64_t warps = (len + ScaleUpdateConfig::kStep - 1) / ScaleUpdateConfig::kStep;
  if (warps < 1) warps = 1;
  if (warps > ScaleUpdateConfig::kMaxWarps) warps = ScaleUpdateConfig::kMaxWarps;
  const int64_t per_warp = (len + warps - 1) / warps;
  return ScaleUpdateConfig{static_cast<int>(warps), (per_warp + 31) / 32 * 32};
}

// Total order on float32 bit patterns as unsigned keys: -inf < ... < -0 < +0 < ... < +inf,
// every NaN (either sign) on top, so an unsigned max is a NaN-propagating float max.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
constexpr uint32_t kKeyPlusZero = 0x80000000u;  // order_key(+0.0f)
constexpr uint32_t kKeyPlusInf = 0xff800000u;   // order_key(+inf)

// IEEE round-to-nearest multiply and reciprocal with subnormals, whatever the flags.
__device__ __forceinline__ float mul_rn_ieee(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float rcp_rn_ieee(float a) {
  float r;
  asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

template <bool MostRecent>
__global__ void __launch_bounds__(ScaleUpdateConfig::kMaxWarps * 32)
    scale_update_kernel(const ScaleUpdateParams p) {
  constexpr int kUnroll = ScaleUpdateConfig::kUnroll;
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ uint32_t warp_key[ScaleUpdateConfig::kMaxWarps];

  const int64_t row = blockIdx.x;
  float* h = p.hist + row * p.len;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t begin = warp * p.segment;
  const int64_t end = begin + p.segment < p.len ? begin + p.segment : p.len;

  // Thread 0 fetches prev_scale now (its load overlaps the roll; scale is written last).
  const float prev = threadIdx.x == 0 ? p.prev_scale[row] : 0.f;
  // The value entering this segment's first slot, read before any warp writes.
  float carry = 0.f;
  if (begin < end) carry = begin == 0 ? p.pending[row] : h[begin - 1];
  const float step_amax = carry;  // warp 0: pending[r]
  __syncthreads();

  uint32_t key = 0;  // below every order_key
  for (int64_t base = begin; base < end; base += 32 * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      v[u] = i < end ? h[i] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float from_left = __shfl_up_sync(kAll, v[u], 1);
      const float out = lane == 0 ? carry : from_left;
      carry = __shfl_sync(kAll, v[u], 31);
      const int64_t i = base + u * 32 + lane;
      if (i < end) {
        h[i] = out;
        key = max(key, order_key(out));
      }
    }
  }

  if constexpr (!MostRecent) {
    key = __reduce_max_sync(kAll, key);
    if (lane == 0) warp_key[warp] = key;
    __syncthreads();
  }
  if (threadIdx.x != 0) return;

  uint32_t amax = order_key(step_amax);
  if constexpr (!MostRecent) {
    amax = warp_key[0];
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) amax = max(amax, warp_key[w]);
  }
  // finite and > 0; the key of a positive float is its bits with the sign bit set
  const float s = amax > kKeyPlusZero && amax < kKeyPlusInf
                      ? mul_rn_ieee(__uint_as_float(amax ^ kKeyPlusZero), p.factor)
                      : prev;
  p.scale[row] = s;
  p.scale_inv[row] = rcp_rn_ieee(s);
  p.pending[row] = 0.f;
}

// Arguments must already be validated (rows in 1..INT_MAX, len >= 1).
inline void scale_update_launch(ScaleUpdateParams p, cudaStream_t stream) {
  const ScaleUpdateConfig c = scale_update_config(p.len);
  p.segment = c.segment;
  const dim3 grid(static_cast<unsigned>(p.rows)), block(static_cast<unsigned>(c.threads()));
  if (p.most_recent)
    scale_update_kernel<true><<<grid, block, 0, stream>>>(p);
  else
    scale_update_kernel<false><<<grid, block, 0, stream>>>(p);
  ASTRAI_CHECK_LAUNCH();
}

}  // namespace astrai::fp8
