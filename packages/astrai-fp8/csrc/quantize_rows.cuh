// Per-token (per-row) e4m3 quantize of a decode step's activations, the W8A8 route's first step:
//
//   scale[r] = amax(|x[r, :]|) * (1 / 448) (1 where the row's amax is not > 0), q[r, :] = x[r, :] / scale[r]
//
// One block a row. The first pass reduces the row's amax from 16-byte loads (block_amax, into
// shared memory); the second reads the row again (from L1/L2: a row is at most tens of KB) and
// writes 8 bytes a thread-step. Rounding
// is IEEE (__fmul_rn, __fdiv_rn, cvt.rn.satfinite) whatever the fast-math flags, so the bytes and
// scales equal torch's (x.float() / (amax * (1 / 448))).to(float8_e4m3fn) (the scale as a multiply
// by the float32 reciprocal: torch's CUDA division by a Python scalar is one). One launch replaces the
// seven element-wise kernels of that torch expression (~20 us of a 64-row step's linear, measured).
// No torch; K % 8 == 0, x's rows 16-byte and q's 8-byte aligned: the caller checks (ops.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "astrai/check.h"
#include "quantize.cuh"

namespace astrai::fp8 {

struct FP8QuantizeRowsParams {
  const void* x;  // [rows][cols], row stride ldx elements
  uint8_t* q;     // [rows][cols], row stride ldq bytes, e4m3
  float* scale;   // [rows] dequantization scales
  int rows, cols;
  int64_t ldx, ldq;
};

constexpr int kQuantRowsThreads = 256;
constexpr float kInvE4M3Max = 1.f / 448.f;  // e4m3's largest finite value is 448

template <class InT>
__global__ void __launch_bounds__(kQuantRowsThreads)
    fp8_quantize_rows_kernel(const FP8QuantizeRowsParams p) {
  using Tr = quant_in_traits<InT>;
  __shared__ float row_amax;  // block_amax's atomicMax target, in shared memory here
  if (threadIdx.x == 0) row_amax = 0.f;
  __syncthreads();
  const int r = blockIdx.x;
  const InT* x = static_cast<const InT*>(p.x) + r * p.ldx;
  uint32_t bits = 0u;
  for (int c = threadIdx.x * 8; c < p.cols; c += kQuantRowsThreads * 8) {
    float f[8];
    Tr::load8(x + c, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) bits = max(bits, abs_bits(f[i]));
  }
  block_amax(bits, &row_amax);
  __syncthreads();
  const float amax = row_amax;
  const float s = amax > 0.f ? __fmul_rn(amax, kInvE4M3Max) : 1.f;  // a NaN amax gets 1, as torch.where gives
  if (threadIdx.x == 0) p.scale[r] = s;
  uint8_t* q = p.q + r * p.ldq;
  for (int c = threadIdx.x * 8; c < p.cols; c += kQuantRowsThreads * 8) {
    float f[8];
    Tr::load8(x + c, f);
    uint32_t word[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      word[h] = to_fp8x2<FP8Format::E4M3>(__fdiv_rn(f[4 * h], s), __fdiv_rn(f[4 * h + 1], s)) |
                (to_fp8x2<FP8Format::E4M3>(__fdiv_rn(f[4 * h + 2], s), __fdiv_rn(f[4 * h + 3], s)) << 16);
    *reinterpret_cast<uint2*>(q + c) = make_uint2(word[0], word[1]);
  }
}

template <class InT>
void quantize_rows_launch(const FP8QuantizeRowsParams& p, cudaStream_t stream) {
  fp8_quantize_rows_kernel<InT><<<p.rows, kQuantRowsThreads, 0, stream>>>(p);
  ASTRAI_CHECK_LAUNCH();
}

}  // namespace astrai::fp8
