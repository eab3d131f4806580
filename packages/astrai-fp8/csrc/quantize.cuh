// FP8 quantize kernels: q = saturate(x * scale) in e4m3 / e5m2, amax = max |x| (input domain).
//
//   fp8_quantize_kernel<InT, Fmt>            out_layout 0: q [rows][cols]; 8 elements per
//                                            thread-step (one 16-byte load for 16-bit inputs,
//                                            two for f32; one 8-byte store), grid-stride
//   fp8_quantize_transpose_kernel<InT, Fmt>  out_layout 1 (q_t [cols][rows]) and 2 (q and
//                                            q_t): a 64x64 tile through shared memory, so
//                                            both outputs leave in coalesced words
//
// Rounding is round-to-nearest-even with saturation to the largest finite value (cvt.rn
// .satfinite), the same bytes torch gives for (x.float() * scale).clamp(-max, max).to(fp8).
// amax is reduced as the IEEE bits of |x| (an integer max orders non-negative floats and
// keeps a NaN, which torch.amax also propagates), one atomicMax per block. The caller
// zeroes *amax before the launch (quantize_launch does).
// No torch; rows, cols > 0 and argument checks are the caller's job (ops.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "astrai/check.h"
#include "byte_transpose.cuh"
#include "common.h"

namespace astrai::fp8 {

// ------------------------------------------------------------ input unpack
template <class InT>
struct quant_in_traits;

template <>
struct quant_in_traits<__nv_bfloat16> {
  static constexpr int kBytes = 2;
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  // 8 consecutive elements from a 16-byte aligned address.
  __device__ static void load8(const __nv_bfloat16* p, float (&f)[8]) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

template <>
struct quant_in_traits<__half> {
  static constexpr int kBytes = 2;
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static void load8(const __half* p, float (&f)[8]) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};

template <>
struct quant_in_traits<float> {
  static constexpr int kBytes = 4;
  __device__ static float to_float(float v) { return v; }
  __device__ static void load8(const float* p, float (&f)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
    f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  }
};

// ------------------------------------------------------------ conversion + amax
template <FP8Format Fmt>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  constexpr __nv_fp8_interpretation_t kind = Fmt == FP8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind));
}

// Two values -> two bytes (low byte = first), one cvt.satfinite x2 instruction.
template <FP8Format Fmt>
__device__ __forceinline__ uint32_t to_fp8x2(float a, float b) {
  constexpr __nv_fp8_interpretation_t kind = Fmt == FP8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind));
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Block-wide max of `bits`, then one atomicMax by thread 0. Every thread must call it.
__device__ __forceinline__ void block_amax(uint32_t bits, float* amax) {
  __shared__ uint32_t warp_max[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  if (lane == 0) warp_max[warp] = bits;
  __syncthreads();
  if (warp == 0) {
    bits = lane < warps ? warp_max[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
    if (lane == 0 && bits != 0u) atomicMax(reinterpret_cast<unsigned int*>(amax), bits);
  }
}

// ------------------------------------------------------------ out_layout 0
constexpr int kQuantThreads = 256;

template <class InT, FP8Format Fmt>
__global__ void __launch_bounds__(kQuantThreads)
    fp8_quantize_kernel(const __grid_constant__ FP8QuantizeParams p, int vec) {
  using Tr = quant_in_traits<InT>;
  const InT* x = static_cast<const InT*>(p.x);
  const float scale = *p.scale;
  const int per_row = (p.cols + 7) / 8;
  const int64_t steps = static_cast<int64_t>(p.rows) * per_row;
  uint32_t amax_bits = 0u;
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < steps;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(s / per_row);
    const int c = static_cast<int>(s - static_cast<int64_t>(r) * per_row) * 8;
    const InT* src = x + r * p.ldx + c;
    uint8_t* dst = p.q + static_cast<int64_t>(r) * p.cols + c;
    if (vec && c + 8 <= p.cols) {
      float f[8];
      Tr::load8(src, f);
      uint32_t lo = 0u, hi = 0u;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax_bits = max(amax_bits, abs_bits(f[i]));
      lo = to_fp8x2<Fmt>(f[0] * scale, f[1] * scale) |
           (to_fp8x2<Fmt>(f[2] * scale, f[3] * scale) << 16);
      hi = to_fp8x2<Fmt>(f[4] * scale, f[5] * scale) |
           (to_fp8x2<Fmt>(f[6] * scale, f[7] * scale) << 16);
      *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
    } else {
      for (int i = 0; i < 8 && c + i < p.cols; ++i) {
        const float f = Tr::to_float(src[i]);
        amax_bits = max(amax_bits, abs_bits(f));
        dst[i] = to_fp8<Fmt>(f * scale);
      }
    }
  }
  block_amax(amax_bits, p.amax);
}

// ------------------------------------------------------------ out_layout 1 / 2
// Block: 256 threads over a 64 x 64 input tile.
//   load:  thread t reads 8 consecutive columns 8*(t%8).. of rows t/8 and t/8 + 32
//          (one 16-byte load each for 16-bit inputs), converts them, writes q (8 bytes,
//          layout 2) and the bytes into a [64][68] shared tile;
//   store: thread t takes the 4x4 byte block (rows 4*(t%16).., cols 4*(t/16)..), transposes
//          it with PRMT and writes four 4-byte words, one per q_t row; 16 threads cover a
//          64-byte q_t row segment.
constexpr int kTransTile = 64;

template <class InT, FP8Format Fmt>
__global__ void __launch_bounds__(kQuantThreads)
    fp8_quantize_transpose_kernel(const __grid_constant__ FP8QuantizeParams p, int vec) {
  using Tr = quant_in_traits<InT>;
  constexpr int kPitch = kTransTile + 4;
  __shared__ __align__(16) uint8_t tile[kTransTile * kPitch];
  const InT* x = static_cast<const InT*>(p.x);
  const float scale = *p.scale;
  const int r0 = blockIdx.y * kTransTile, c0 = blockIdx.x * kTransTile;
  const int tid = threadIdx.x;
  uint32_t amax_bits = 0u;

  const int lc = (tid & 7) * 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int lr = (tid >> 3) + half * 32;
    const int r = r0 + lr, c = c0 + lc;
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const bool full = r < p.rows && c + 8 <= p.cols;
    if (r < p.rows) {
      const InT* src = x + r * p.ldx + c;
      if (vec && full) {
        Tr::load8(src, f);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (c + i < p.cols) f[i] = Tr::to_float(src[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) amax_bits = max(amax_bits, abs_bits(f[i]));
    const uint32_t lo = to_fp8x2<Fmt>(f[0] * scale, f[1] * scale) |
                        (to_fp8x2<Fmt>(f[2] * scale, f[3] * scale) << 16);
    const uint32_t hi = to_fp8x2<Fmt>(f[4] * scale, f[5] * scale) |
                        (to_fp8x2<Fmt>(f[6] * scale, f[7] * scale) << 16);
    if (p.q != nullptr && r < p.rows) {
      uint8_t* dst = p.q + static_cast<int64_t>(r) * p.cols + c;
      if (vec && full) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
      } else {
        for (int i = 0; i < 8 && c + i < p.cols; ++i)
          dst[i] = static_cast<uint8_t>((i < 4 ? lo : hi) >> (8 * (i & 3)));
      }
    }
    *reinterpret_cast<uint32_t*>(&tile[lr * kPitch + lc]) = lo;
    *reinterpret_cast<uint32_t*>(&tile[lr * kPitch + lc + 4]) = hi;
  }
  __syncthreads();

  // q_t[c0 + cb*4 + j][r0 + rb*4 .. +3] = tile[rb*4 .. +3][cb*4 + j]
  const int rb = tid & 15, cb = tid >> 4;
  uint32_t out[4];
  transpose_bytes4x4(*reinterpret_cast<const uint32_t*>(&tile[(rb * 4 + 0) * kPitch + cb * 4]),
                     *reinterpret_cast<const uint32_t*>(&tile[(rb * 4 + 1) * kPitch + cb * 4]),
                     *reinterpret_cast<const uint32_t*>(&tile[(rb * 4 + 2) * kPitch + cb * 4]),
                     *reinterpret_cast<const uint32_t*>(&tile[(rb * 4 + 3) * kPitch + cb * 4]), out);
  const int qc = r0 + rb * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int qr = c0 + cb * 4 + j;
    if (qr >= p.cols) break;
    uint8_t* dst = p.q_t + static_cast<int64_t>(qr) * p.rows + qc;
    if (vec && qc + 4 <= p.rows) {
      *reinterpret_cast<uint32_t*>(dst) = out[j];
    } else {
      for (int i = 0; i < 4 && qc + i < p.rows; ++i) dst[i] = static_cast<uint8_t>(out[j] >> (8 * i));
    }
  }
  block_amax(amax_bits, p.amax);
}

// ------------------------------------------------------------ host launch
// Launches the kernel for out_layout (0, 1, 2) after zeroing *amax; `sms` sizes the
// grid-stride grid. Arguments must already be validated.
template <class InT, FP8Format Fmt>
void quantize_launch(const FP8QuantizeParams& p, int out_layout, int sms, cudaStream_t stream) {
  ASTRAI_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
  const auto addr = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr); };
  if (out_layout == 0) {
    // 16-byte input rows for the vector load, 8-byte q rows for the store.
    const int vec = addr(p.x) % 16 == 0 && (p.ldx * static_cast<int64_t>(sizeof(InT))) % 16 == 0 &&
                    addr(p.q) % 8 == 0 && p.cols % 8 == 0;
    const int64_t steps = static_cast<int64_t>(p.rows) * ((p.cols + 7) / 8);
    int64_t blocks = (steps + kQuantThreads - 1) / kQuantThreads;
    const int64_t cap = static_cast<int64_t>(sms > 0 ? sms : 1) * 8;
    if (blocks > cap) blocks = cap;
    fp8_quantize_kernel<InT, Fmt>
        <<<static_cast<unsigned>(blocks), kQuantThreads, 0, stream>>>(p, vec);
  } else {
    // 16-byte input rows (8 elements; two 16-byte loads for f32), 8-byte q rows, 4-byte q_t rows.
    const int64_t elem = static_cast<int64_t>(sizeof(InT));
    const int vec = addr(p.x) % 16 == 0 && (p.ldx * elem) % 16 == 0 &&
                    (p.q == nullptr || (addr(p.q) % 8 == 0 && p.cols % 8 == 0)) &&
                    addr(p.q_t) % 4 == 0 && p.rows % 4 == 0;
    const dim3 grid((p.cols + kTransTile - 1) / kTransTile, (p.rows + kTransTile - 1) / kTransTile);
    fp8_quantize_transpose_kernel<InT, Fmt><<<grid, kQuantThreads, 0, stream>>>(p, vec);
  }
  ASTRAI_CHECK_LAUNCH();
}

}  // namespace astrai::fp8
