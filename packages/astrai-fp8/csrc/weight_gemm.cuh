// The decode-size linear over FP8 weights: y [M, N] = x [M, K] . (W [N, K] * w_scale [N])^T
// for M <= 64 tokens, x and y 16-bit (bfloat16 / float16), W e4m3 or e5m2 with one float32
// scale per output channel. No activation quantization: a decode step reads every weight
// once, so one byte a weight is what halves its time (docs/fp8.md, "FP8 weights at decode").
// Op fp8_weight_gemm (ops.cu: weight_gemm, weight_gemm_plan); astrai.extension.fp8_weight_linear.
// Built, waiting for a GPU: csrc/tests/weight_gemm_test.cu checks and times it.
//
// mma.sync m16n8k16 on float16 with the channels as the mma's M and the tokens as its n8
// columns: a warp owns 16 output channels, whose bytes convert straight into A fragments (one
// hardware conversion per byte pair on sm_89+, astrai/fp8_convert.cuh), and every k-step's
// A fragment serves the NT n-tiles of tokens. The k dimension is permuted as the attention
// plugin's fp8 decode permutes it: lane (g, t) reads the 16 bytes at 16t of each 64-byte
// segment of channel rows g and g + 8 (four k-steps; k = 2t, 2t+1, 2t+8, 2t+9 of k-step kk
// are the bytes 4kk .. 4kk+3 of those 16), and x's B fragments are read in the same order.
//
// x is staged per 256-wide chunk of K in shared memory as float16, each token's row times a
// power of two that puts the largest |x| of the block's K range in [2^14, 2^15) (exact for
// bfloat16 inputs down to 2^-10 of that largest; found in a first pass over the range); the
// epilogue multiplies the inverse back with w_scale. Where the channels alone do not fill the
// GPU, grid.y splits K: the splits add float32 partials into a workspace that stays zero between
// calls (weight_gemm_finalize scales, rounds and zeroes it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "astrai/fp8_convert.cuh"
#include "astrai/mma.cuh"

namespace astrai::fp8 {

struct WeightGemmParams {
  const void* x;          // [m, k] rows of T, x_stride elements apart
  const uint8_t* w;       // [n, k] fp8 rows, w_stride bytes apart (16-byte aligned)
  const float* w_scale;   // [n]
  void* y;                // [m, n] rows of T, y_stride elements apart
  float* ws;              // [m, n] float32, zero on entry and exit; splits > 1 only
  int64_t x_stride, w_stride, y_stride;
  int m, n, k;
  int k_per_split;        // a multiple of kWeightGemmChunk
};

constexpr int kWeightGemmWarps = 8;
constexpr int kWeightGemmThreads = 32 * kWeightGemmWarps;
constexpr int kWeightGemmChannels = 16 * kWeightGemmWarps;  // output channels per block
constexpr int kWeightGemmChunk = 256;                        // K per staged x chunk

// Splits of K for n channels on sms SMs: the fewest (powers of two) that give every SM two
// blocks, while each split keeps whole chunks.
inline int weight_gemm_splits(int n, int k, int sms) {
  const int blocks = (n + kWeightGemmChannels - 1) / kWeightGemmChannels;
  int s = 1;
  while (blocks * s < 2 * sms && k % (2 * s * kWeightGemmChunk) == 0 && s < 16) s *= 2;
  return s;
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __half>) return __half22float2(*reinterpret_cast<const __half2*>(&v));
  else return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

// NT n-tiles of 8 tokens each (tokens past m read as zeros, their outputs are not stored).
template <typename T, int NT, int kExpBits>
__global__ void __launch_bounds__(kWeightGemmThreads) weight_gemm_kernel(const WeightGemmParams p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kRows = 8 * NT;
  // Rows 4 halves (2 banks) longer than the chunk: a half-warp's 8-byte B loads (rows g 0..3,
  // columns 16t ..) then fall in 32 distinct banks.
  constexpr int kPad = 4;
  __shared__ __align__(16) __half xs[kRows][kWeightGemmChunk + kPad];
  __shared__ float x_max[kRows], x_inv[kRows];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const int k0 = blockIdx.y * p.k_per_split, k1 = min(p.k, k0 + p.k_per_split);
  const T* x = static_cast<const T*>(p.x);
  constexpr int kLanes = kWeightGemmThreads / kRows;  // threads per token row in the passes over x
  const int row = tid / kLanes, part = tid % kLanes;

  // Pass 1: each token's largest |x| over [k0, k1), then the power of two that scales it.
  if (tid < kRows) x_max[tid] = 0.f;
  __syncthreads();
  float mx = 0.f;
  if (row < p.m) {
    for (int c = k0 + 8 * part; c < k1; c += 8 * kLanes) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(x + row * p.x_stride + c));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>((&v.x)[i]);
        mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
  }
  atomicMax(reinterpret_cast<int*>(&x_max[row]), __float_as_int(mx));  // non-negative floats order as ints
  __syncthreads();
  // mx in [2^(E-127), 2^(E-126)): times 2^(141-E) lands in [2^14, 2^15); a zero row keeps 1
  const float row_max = x_max[row];
  const int up = row_max > 0.f ? min(141 - int(__float_as_uint(row_max) >> 23), 126) : 0;
  const float factor = __uint_as_float(uint32_t(up + 127) << 23);
  if (part == 0) x_inv[row] = __uint_as_float(uint32_t(127 - up) << 23);
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const int n0 = blockIdx.x * kWeightGemmChannels + warp * 16;
  const int r0 = min(n0 + g, p.n - 1), r1 = min(n0 + g + 8, p.n - 1);  // rows past n: read, never stored
  const uint8_t* w0 = p.w + r0 * p.w_stride;
  const uint8_t* w1 = p.w + r1 * p.w_stride;

  for (int kc = k0; kc < k1; kc += kWeightGemmChunk) {
    // this chunk's weight bytes first: their round trip overlaps the staging of x below
    uint4 wa[4], wb[4];
#pragma unroll
    for (int seg = 0; seg < 4; ++seg) {
      wa[seg] = __ldcs(reinterpret_cast<const uint4*>(w0 + kc + 64 * seg + 16 * t));
      wb[seg] = __ldcs(reinterpret_cast<const uint4*>(w1 + kc + 64 * seg + 16 * t));
    }
    __syncthreads();  // the previous chunk's x is read
    for (int c = 8 * part; c < kWeightGemmChunk; c += 8 * kLanes) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < p.m) v = __ldg(reinterpret_cast<const uint4*>(x + row * p.x_stride + kc + c));
      uint32_t h[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>((&v.x)[i]);
        const __half2 s = __floats2half2_rn(f.x * factor, f.y * factor);
        h[i] = *reinterpret_cast<const uint32_t*>(&s);
      }
      *reinterpret_cast<uint2*>(&xs[row][c]) = make_uint2(h[0], h[1]);  // rows are 8-byte aligned
      *reinterpret_cast<uint2*>(&xs[row][c + 4]) = make_uint2(h[2], h[3]);
    }
    __syncthreads();
#pragma unroll
    for (int seg = 0; seg < 4; ++seg) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t lo = (&wa[seg].x)[kk], hi = (&wb[seg].x)[kk];  // channels g, g + 8
        const uint32_t a[4] = {fp8x2_to_half2<kExpBits>(lo), fp8x2_to_half2<kExpBits>(hi),
                               fp8x2_to_half2<kExpBits, true>(lo), fp8x2_to_half2<kExpBits, true>(hi)};
        const int e = 64 * seg + 16 * t + 4 * kk;  // x^T's rows for k = 2t, 2t+1 (e, e+1) and 2t+8, 2t+9
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint2 b = *reinterpret_cast<const uint2*>(&xs[8 * j + g][e]);
          mma_sync<__half>(acc[j], a, {b.x, b.y});
        }
      }
    }
  }

  // acc[j]: channels n0 + g (0, 1) and n0 + g + 8 (2, 3), tokens 8j + 2t and 8j + 2t + 1
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = 8 * j + 2 * t + (e & 1), channel = n0 + g + 8 * (e >> 1);
      if (token >= p.m || channel >= p.n) continue;
      const float v = acc[j][e] * x_inv[token];
      if (gridDim.y == 1) {
        T* y = static_cast<T*>(p.y) + token * p.y_stride + channel;
        *y = T(v * __ldg(p.w_scale + channel));
      } else {
        atomicAdd(p.ws + int64_t(token) * p.n + channel, v);
      }
    }
  }
#endif
}

// The split partials of weight_gemm_kernel into y (times w_scale, rounded to T); zeroes ws.
template <typename T>
__global__ void weight_gemm_finalize(const WeightGemmParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(p.m) * p.n) return;
  const int token = int(i / p.n), channel = int(i % p.n);
  T* y = static_cast<T*>(p.y) + token * p.y_stride + channel;
  *y = T(p.ws[i] * __ldg(p.w_scale + channel));
  p.ws[i] = 0.f;
}

// Launch for p (p.k_per_split set by the caller, e.g. k / weight_gemm_splits(...)). Needs
// m <= 64, k % kWeightGemmChunk == 0, 16-byte aligned rows of x and W; kExpBits 4 (e4m3) or 5.
template <typename T, int kExpBits>
void launch_weight_gemm(const WeightGemmParams& p, cudaStream_t stream) {
  const dim3 grid((p.n + kWeightGemmChannels - 1) / kWeightGemmChannels, (p.k + p.k_per_split - 1) / p.k_per_split);
  if (p.m <= 8) weight_gemm_kernel<T, 1, kExpBits><<<grid, kWeightGemmThreads, 0, stream>>>(p);
  else if (p.m <= 16) weight_gemm_kernel<T, 2, kExpBits><<<grid, kWeightGemmThreads, 0, stream>>>(p);
  else if (p.m <= 32) weight_gemm_kernel<T, 4, kExpBits><<<grid, kWeightGemmThreads, 0, stream>>>(p);
  else weight_gemm_kernel<T, 8, kExpBits><<<grid, kWeightGemmThreads, 0, stream>>>(p);
  if (grid.y > 1) {
    const int64_t total = int64_t(p.m) * p.n;
    weight_gemm_finalize<T><<<unsigned((total + 255) / 256), 256, 0, stream>>>(p);
  }
}

}  // namespace astrai::fp8
