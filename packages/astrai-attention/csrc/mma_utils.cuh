// Shared-memory tile addressing, fragment packing and the online softmax used by the
// tensor-core kernels. mma.sync / ldmatrix themselves live in astrai/mma.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "astrai/cp_async.cuh"
#include "astrai/mma.cuh"
#include "astrai/reduce.cuh"

namespace astrai::attn {

// Element type traits: float <-> T conversions and packing two floats into one b32.
template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
    __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }
    __device__ static uint32_t pack2(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};
template <>
struct Elem<__half> {
    __device__ static float to_float(__half x) { return __half2float(x); }
    __device__ static __half from_float(float x) { return __float2half(x); }
    __device__ static uint32_t pack2(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};

// A [rows][D] tile of 16-bit elements in shared memory, stored as 16-byte chunks with the
// chunk index XOR-swizzled by (row & 7): the 8 rows one ldmatrix matrix reads fall in
// 8 distinct bank groups. D >= 64 keeps at least 8 chunks per row.
template <int D>
struct SwizzledTile {
    static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
    static constexpr int kChunks = D / 8;
    // Byte offset of chunk c of row r.
    __device__ __forceinline__ static uint32_t offset(int r, int c) {
        return uint32_t(r * kChunks + (c ^ (r & 7))) * 16u;
    }
};

// Online softmax state for the two accumulator rows a thread owns (g and g + 8). Scores
// arrive unscaled (masked ones as -inf); m is kept in the scaled log2 domain, so one FFMA
// per score folds the softmax scale into the exponent: p = exp2(s * scale_log2 - m).
struct RowState {
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};  // per-thread partial sums; quad-reduced at the end
};

// Rescales the running state with a new score tile s[NT][4] (NT n-tiles of 8 columns),
// turns s into probabilities in place and returns the factors applied to the old O.
template <int NT>
__device__ __forceinline__ void online_softmax(RowState& st, float (&s)[NT][4], float scale_log2,
                                               float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        mx = fmaxf(st.m[r], warp_reduce_max<4>(mx) * scale_log2);
        // A row that has seen only masked scores keeps m = -inf; use 0 as the base so
        // exp2(-inf - base) = 0 rather than NaN.
        const float base = mx == -INFINITY ? 0.f : mx;
        alpha[r] = exp2f(st.m[r] - base);
        st.m[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            s[j][2 * r] = exp2f(fmaf(s[j][2 * r], scale_log2, -base));
            s[j][2 * r + 1] = exp2f(fmaf(s[j][2 * r + 1], scale_log2, -base));
            sum += s[j][2 * r] + s[j][2 * r + 1];
        }
        st.l[r] = st.l[r] * alpha[r] + sum;
    }
}

// A lazily rescaled row's exponent base (online_softmax_lazy): with `rescale`, its max m moves
// to cover the tile's max mx and alpha is the factor for its old accumulator; else m stays and
// alpha is 1. A row that has seen only masked scores keeps base 0.
__device__ __forceinline__ float lazy_base(float& m, float mx, bool rescale, float& alpha) {
    alpha = 1.f;
    if (rescale) {
        const float moved = fmaxf(m, mx);
        alpha = exp2f(m - (moved == -INFINITY ? 0.f : moved));
        m = moved;
    }
    return m == -INFINITY ? 0.f : m;
}

// online_softmax whose rows keep their exponent base until a tile's max exceeds it by more
// than kSlack (log2 units; FlashAttention-4's trick): P <= 2^kSlack, and O and l stay exact
// relative to the old base, so most tiles of a long row leave O alone. Returns whether the
// warp rescales (any of its rows moved; warp-uniform): alpha is then the factor for O, 1 for
// the rows that kept their base; without a rescale alpha is all ones and O is left as is.
// scale_log2[r]: row r's own scale (the decode over fp8 pages folds its score factors into it).
template <int NT>
__device__ __forceinline__ bool online_softmax_lazy(RowState& st, float (&s)[NT][4], const float (&scale_log2)[2],
                                                    float (&alpha)[2]) {
    constexpr float kSlack = 8.f;
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = -INFINITY;
#pragma unroll
        for (int j = 0; j < NT; ++j) mx[r] = fmaxf(mx[r], fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        mx[r] = warp_reduce_max<4>(mx[r]) * scale_log2[r];
    }
    // -inf + kSlack is -inf: a row's first finite max always moves its base
    const bool rescale = __any_sync(0xffffffffu, mx[0] > st.m[0] + kSlack || mx[1] > st.m[1] + kSlack);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float base = lazy_base(st.m[r], mx[r], rescale, alpha[r]);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            s[j][2 * r] = exp2f(fmaf(s[j][2 * r], scale_log2[r], -base));
            s[j][2 * r + 1] = exp2f(fmaf(s[j][2 * r + 1], scale_log2[r], -base));
            sum += s[j][2 * r] + s[j][2 * r + 1];
        }
        st.l[r] = st.l[r] * alpha[r] + sum;
    }
    return rescale;
}

template <int NT>
__device__ __forceinline__ bool online_softmax_lazy(RowState& st, float (&s)[NT][4], float scale_log2,
                                                    float (&alpha)[2]) {
    const float rows[2] = {scale_log2, scale_log2};
    return online_softmax_lazy<NT>(st, s, rows, alpha);
}

// An accumulator's rows g and g + 8 (mma C layout, ND n-tiles) times alpha[0] and alpha[1]:
// the online softmax's rescale of O.
template <int ND>
__device__ __forceinline__ void rescale_rows(float (&o)[ND][4], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < ND; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
    }
}

// Quad-reduces the partial row sums; returns 1/l (0 for a row that saw no key).
__device__ __forceinline__ void finalize_rows(RowState& st, float (&inv_l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.l[r] = warp_reduce_sum<4>(st.l[r]);
        inv_l[r] = st.l[r] > 0.f ? 1.f / st.l[r] : 0.f;
    }
}

}  // namespace astrai::attn
