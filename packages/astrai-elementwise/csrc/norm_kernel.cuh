// RMSNorm, alone or after a residual add, one thread block per row.
//
// For a row x of `hidden` channels and weight w (transformers' LlamaRMSNorm, rounding as
// it rounds):
//   residual given:  s = T(x + residual), stored back into residual; else s = x
//   inv = rsqrt(sum(float(s)^2) * (1 / hidden) + eps)            (float32 throughout)
//   out = T(float(w) * float(T(float(s) * inv)))                  (normalized, cast, scaled)
//
// Accesses are kElems channels (16 bytes on the vector path, one element on the scalar
// path). With kVecs > 0 each thread keeps kVecs accesses in registers between the sum of
// squares and the output, so a row is read once and written once, and all of a thread's
// loads issue before any is used (x and residual streamed). kVecs = 0 serves rows of any
// width: the thread loops over the row twice, the second pass reading s back (from L1/L2:
// the block's own row). The block's partial sums meet in shared memory after one barrier;
// every warp then adds all of them itself (no second barrier). `out` may be `x` (in place):
// each thread writes only the channels it read. The sum and the output are stored plainly
// (the next kernel reads them), the weight read through the read-only cache (every row
// reads it).
//
// With kFp8 the normalized row leaves as e4m3 with its per-token scale (row_fp8.cuh) instead
// of in T: the quantize of the W8A8 linear that reads it, fused (the 16-bit row is rounded as
// above first, so the bytes equal rms_norm then quantize). The register path keeps the row
// for the amax's barrier; the two-pass path makes a third pass, the amax before the bytes.
#pragma once

#include <cstdint>

#include "astrai/reduce.cuh"
#include "elementwise.cuh"
#include "row_fp8.cuh"

namespace astrai::norm {

using elementwise::Cache;
using elementwise::from_float;
using elementwise::load;
using elementwise::store;
using elementwise::to_float;

// Threads of a block for rows of `accesses` accesses, `vecs` a thread: whole warps, at least one.
__host__ __device__ constexpr int norm_threads(int64_t accesses, int vecs) {
    const int64_t need = (accesses + vecs - 1) / vecs;
    return static_cast<int>(need <= 32 ? 32 : (need + 31) / 32 * 32);
}

struct NormParams {
    const void* x = nullptr;       // [rows, hidden], row stride x_stride
    void* residual = nullptr;      // nullptr: plain RMSNorm; else [rows, hidden], updated in place
    const void* weight = nullptr;  // [hidden], contiguous
    void* out = nullptr;           // [rows, hidden] (may be x)
    int64_t x_stride = 0, residual_stride = 0, out_stride = 0;  // elements
    int32_t accesses = 0;          // per row: hidden / kElems
    float inv_hidden = 0.f;        // 1 / hidden, rounded to float (what torch's mean multiplies by)
    float eps = 0.f;
    uint8_t* q = nullptr;          // kFp8: [rows, hidden] e4m3, row stride q_stride bytes (8-byte aligned rows)
    float* scale = nullptr;        // kFp8: [rows] dequantization scales
    int64_t q_stride = 0;
};

// One kernel instantiation: dtype T, kElems channels per access, kVecs accesses per thread.
template <typename T, int kElems, int kVecs>
struct NormConfig {
    static constexpr int kBytes = kElems * int(sizeof(T));
    static constexpr int kMaxThreads = 512;  // 128 registers a thread: kVecs = 8 of x and residual fit
    static constexpr int kMaxWarps = kMaxThreads / 32;
    static_assert(kBytes == 16 || kElems == 1, "an access is 16 bytes (vector path) or one element");
    static_assert(kVecs >= 0 && kVecs <= 8 && (kVecs & (kVecs - 1)) == 0, "kVecs: 0 (any width) or 1, 2, 4, 8");
    static_assert(kVecs * kBytes <= 128, "a thread's row slice must stay in registers");

    // The widest row (in accesses) one block covers; kVecs = 0 covers any.
    static constexpr int64_t max_accesses() { return int64_t{kMaxThreads} * kVecs; }
    // Threads of a block for rows of `accesses` accesses.
    static int threads(int64_t accesses) {
        return kVecs == 0 ? (accesses >= kMaxThreads ? kMaxThreads : norm_threads(accesses, 1))
                          : norm_threads(accesses, kVecs);
    }
};

// Sum of v over the block; every thread gets it. `partial` holds a float per warp.
__device__ __forceinline__ float block_sum(float v, float* partial) {
    v = warp_reduce_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < int(blockDim.x / 32) ? partial[lane] : 0.f;
    return warp_reduce_sum(v);
}

// s = T(s + r), stored back into the residual at access `at` of this block's row.
template <typename T, int kElems>
__device__ __forceinline__ void add_residual(T* residual, int at, T (&s)[kElems], const T (&r)[kElems]) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) s[e] = from_float<T>(to_float(s[e]) + to_float(r[e]));
    store<kElems * int(sizeof(T)), false>(residual + int64_t{at} * kElems, s);
}

template <typename T, int kElems>
__device__ __forceinline__ float squares_of(const T (&s)[kElems]) {
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
        const float f = to_float(s[e]);
        sum += f * f;
    }
    return sum;
}

template <typename T, int kElems>
__device__ __forceinline__ void load_weight(const NormParams& p, int at, T (&w)[kElems]) {
    load<kElems * int(sizeof(T)), Cache::ReadOnly>(static_cast<const T*>(p.weight) + int64_t{at} * kElems, w);
}

// s = T(w * T(s * inv)).
template <typename T, int kElems>
__device__ __forceinline__ void scale_by(T (&s)[kElems], const T (&w)[kElems], float inv) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
        const T normed = from_float<T>(to_float(s[e]) * inv);
        s[e] = from_float<T>(to_float(w[e]) * to_float(normed));
    }
}

// out[at] = T(w * T(s * inv)).
template <typename T, int kElems>
__device__ __forceinline__ void store_scaled(T* out, int at, T (&s)[kElems], const T (&w)[kElems], float inv) {
    scale_by(s, w, inv);
    store<kElems * int(sizeof(T)), false>(out + int64_t{at} * kElems, s);
}

template <typename T, int kElems, int kVecs, bool kFp8 = false>
__global__ void __launch_bounds__(NormConfig<T, kElems, kVecs>::kMaxThreads)
rms_norm_kernel(const NormParams p) {
    using Config = NormConfig<T, kElems, kVecs>;
    __shared__ float partial[Config::kMaxWarps];
    __shared__ uint32_t partial_max[kFp8 ? Config::kMaxWarps : 1];
    const int64_t row = blockIdx.x;
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    T* residual = p.residual == nullptr ? nullptr : static_cast<T*>(p.residual) + row * p.residual_stride;
    T* out = kFp8 ? nullptr : static_cast<T*>(p.out) + row * p.out_stride;
    uint8_t* q = kFp8 ? p.q + row * p.q_stride : nullptr;
    float squares = 0.f;
    constexpr int kBytes = Config::kBytes;
    if constexpr (kVecs == 0) {  // any width: two passes over the row
        for (int at = threadIdx.x; at < p.accesses; at += blockDim.x) {
            alignas(16) T s[kElems];
            load<kBytes, Cache::Plain>(x + int64_t{at} * kElems, s);
            if (residual != nullptr) {
                alignas(16) T r[kElems];
                load<kBytes, Cache::Plain>(residual + int64_t{at} * kElems, r);
                add_residual(residual, at, s, r);
            }
            squares += squares_of(s);
        }
        const float inv = rsqrtf(block_sum(squares, partial) * p.inv_hidden + p.eps);
        const T* sums = residual != nullptr ? residual : x;
        // the normalized access at `at` (into s)
        const auto normed = [&](int at, T (&s)[kElems]) {
            alignas(16) T w[kElems];
            load<kBytes, Cache::Plain>(sums + int64_t{at} * kElems, s);
            load_weight(p, at, w);
            scale_by(s, w, inv);
        };
        if constexpr (kFp8) {
            elementwise::store_row_fp8_twice<T, kElems>(q, p.accesses, partial_max, p.scale, row, normed);
        } else {
            for (int at = threadIdx.x; at < p.accesses; at += blockDim.x) {
                alignas(16) T s[kElems];
                normed(at, s);
                store<kBytes, false>(out + int64_t{at} * kElems, s);
            }
        }
    } else {  // the row in registers, every load issued before the first use
        alignas(16) T s[kVecs][kElems];
        alignas(16) T r[kVecs][kElems];
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
            const int at = i * blockDim.x + threadIdx.x;
            if (at < p.accesses) {
                load<kBytes, Cache::Stream>(x + int64_t{at} * kElems, s[i]);
                if (residual != nullptr) load<kBytes, Cache::Stream>(residual + int64_t{at} * kElems, r[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
            const int at = i * blockDim.x + threadIdx.x;
            if (at < p.accesses) {
                if (residual != nullptr) add_residual(residual, at, s[i], r[i]);
                squares += squares_of(s[i]);
            }
        }
        // the weight's loads overlap the reduction (r is dead by now: no more registers at the peak)
        alignas(16) T w[kVecs][kElems];
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
            const int at = i * blockDim.x + threadIdx.x;
            if (at < p.accesses) load_weight(p, at, w[i]);
        }
        const float inv = rsqrtf(block_sum(squares, partial) * p.inv_hidden + p.eps);
        if constexpr (kFp8) {
            elementwise::store_row_fp8(q, s, p.accesses, partial_max, p.scale, row,
                                       [&](int i) { scale_by(s[i], w[i], inv); });
        } else {
#pragma unroll
            for (int i = 0; i < kVecs; ++i) {
                const int at = i * blockDim.x + threadIdx.x;
                if (at < p.accesses) store_scaled(out, at, s[i], w[i], inv);
            }
        }
    }
}

}  // namespace astrai::norm
