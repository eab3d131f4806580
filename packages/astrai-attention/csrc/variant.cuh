// Attention variants: the one place where a window, a logit soft-cap, attention sinks and a
// custom scale enter the kernels (FlashInfer's semantics; the torch reference is
// backend/attention/torch_native.py's _explicit_attention). Every kernel body calls these
// hooks instead of spelling a variant out:
//   score transform  soft_cap_tile / score_log2: raw q.k -> log2-domain logit;
//   key bounds       window_first_key: the first key a query position sees (tiles and pages
//                    left of it are skipped, the rest masked per score);
//   sink term        fold_sink: the sink's exp into a finished row's softmax denominator;
//   scale            folded into scale_log2 (or cap_in) once, on the host.
// All are runtime fields of AttentionParams, tested by uniform branches, so a kernel stays one
// instantiation per schedule and plain attention pays a compare per tile.
#pragma once

#include <cmath>

#include "capabilities.h"
#include "common.h"

namespace astrai::attn {

constexpr double kLog2e = 1.4426950408889634;

// The features the kernels apply, by the names of attention()'s arguments (capabilities.h, from
// the plugin's statement the manifest reads); the modules bind it as VARIANTS.
constexpr const char* kVariantFeatures[] = {ASTRAI_ATTN_VARIANT_NAMES};

// Host: the variant fields of p from validated values. scale <= 0 means 1/sqrt(head_dim),
// soft_cap <= 0 none, window_left -1 none, sinks null none. With a soft-cap the transform
// c * log2(e) * tanh(x * scale / c) already lands in the log2 domain, so scale_log2 is 1.
inline void set_variant_params(AttentionParams& p, int head_dim, double scale, double soft_cap, int window_left,
                               const float* sinks) {
    const double s = scale > 0 ? scale : 1.0 / std::sqrt(double(head_dim));
    if (soft_cap > 0) {
        p.scale_log2 = 1.f;
        p.cap_in = float(s / soft_cap);
        p.cap_log2 = float(soft_cap * kLog2e);
    } else {
        p.scale_log2 = float(s * kLog2e);
        p.cap_in = p.cap_log2 = 0.f;
    }
    p.window_left = window_left;
    p.sinks = sinks;
}

// Whether p runs anything beyond plain attention with a scale (the kernels that take only a
// scale, the Hopper prefill, check this).
#ifdef __CUDACC__
__host__ __device__
#endif
inline bool has_score_variant(const AttentionParams& p) {
    return p.cap_log2 != 0.f || p.window_left >= 0 || p.sinks != nullptr;
}

#ifdef __CUDACC__

__device__ __forceinline__ bool has_soft_cap(const AttentionParams& p) { return p.cap_log2 != 0.f; }

// tanh on the special-function unit (sm_75+; relative error about 2^-11, as FlashInfer's and
// FlashAttention-3's soft-caps): tanhf's longer sequence spilled the d256 decode kernel.
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One raw score into the log2 domain online_softmax works in (the scalar kernels).
__device__ __forceinline__ float score_log2(const AttentionParams& p, float x) {
    return has_soft_cap(p) ? p.cap_log2 * fast_tanh(x * p.cap_in) : x * p.scale_log2;
}

// A tile of raw scores (mma C layout) soft-capped in place; online_softmax then multiplies by
// scale_log2 = 1. Masking comes after (tanh(-inf) would be a finite -1).
// cap_in: p.cap_in, or that times a factor the raw scores still carry (an fp8 K scale).
template <int NT>
__device__ __forceinline__ void soft_cap_tile(float (&s)[NT][4], const AttentionParams& p, float cap_in) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = p.cap_log2 * fast_tanh(s[j][e] * cap_in);
}
template <int NT>
__device__ __forceinline__ void soft_cap_tile(float (&s)[NT][4], const AttentionParams& p) {
    soft_cap_tile(s, p, p.cap_in);
}

// The first key a query at absolute position pos sees (0 without a window).
__device__ __forceinline__ int window_first_key(const AttentionParams& p, int pos) {
    return p.window_left < 0 ? 0 : max(0, pos - p.window_left);
}

// The sink of query head h in the log2 domain; -inf without sinks.
__device__ __forceinline__ float sink_log2(const AttentionParams& p, int h) {
    return p.sinks == nullptr ? -INFINITY : __ldg(p.sinks + h) * float(kLog2e);
}

// A finished row's max m and sum l (log2 domain) with the sink's term added to l: returns the
// factor that turns the row's accumulator (relative to m) into its output, 0 for a row with
// neither keys nor sink. Without a sink it is 1 / l.
__device__ __forceinline__ float fold_sink(float m, float l, float sink) {
    const float top = fmaxf(m, sink);
    const float base = top == -INFINITY ? 0.f : top;
    const float f = exp2f(m - base);  // 0 for a row without keys
    const float total = l * f + exp2f(sink - base);
    return total > 0.f ? f / total : 0.f;
}

#endif  // __CUDACC__

}  // namespace astrai::attn
