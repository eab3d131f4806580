// Attention variants: the one place where a window, a logit soft-cap, attention sinks, an ALiBi
// bias and a custom scale enter the kernels (FlashInfer's semantics; the torch reference is
// backend/attention/torch_native.py's _explicit_attention). Every kernel is templated on a
// Variant type (below) and calls its hooks instead of spelling a variant out:
//   logits / logit_log2   raw q.k -> the soft-capped score (log2 domain), or untouched;
//   first_key             the first key a query position sees (tiles and pages left of it are
//                         skipped, the rest masked per score);
//   bias / alibi_step     ALiBi's slope[h] * (key - query position) added to a tile of raw scores,
//                         before logits;
//   finish / finish_rows  a finished row's output factor, the sink's exp folded into its
//                         denominator (finish_split: a decode split's; sink: the merge's term);
//   scale                 folded into scale_log2 (or cap_in) once, on the host.
// The values are runtime fields of AttentionParams, tested by uniform branches, so a kernel stays
// one instantiation per schedule and plain attention pays a compare per tile; the type says which
// of them an instantiation serves at all.
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
                               const float* sinks, const float* alibi_slopes = nullptr) {
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
    p.alibi_slopes = alibi_slopes;
}

// Whether p runs anything beyond plain attention with a scale (the kernels that take only a
// scale, the Hopper prefill, check this).
#ifdef __CUDACC__
__host__ __device__
#endif
inline bool has_score_variant(const AttentionParams& p) {
    return p.cap_log2 != 0.f || p.window_left >= 0 || p.sinks != nullptr || p.alibi_slopes != nullptr;
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

// A tile of raw scores (mma C layout) soft-capped in place (Variant::logits says when).
template <int NT>
__device__ __forceinline__ void soft_cap_tile(float (&s)[NT][4], const AttentionParams& p, float cap_in) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = p.cap_log2 * fast_tanh(s[j][e] * cap_in);
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

// ALiBi's bias of query head h per key step, in raw-score units: `unit` is what one raw unit is
// worth in the log2 domain the softmax works in (the softmax scale, or with a soft-cap
// cap_in * cap_log2, the transform's slope at 0; both scale * log2(e) times any factor the raw
// scores still lack, an fp8 K scale), so raw + step * (j - pos) is the raw score whose scaled
// value gained slope[h] * (j - pos): before a soft-cap, as the torch path.
__device__ __forceinline__ float alibi_step(const AttentionParams& p, int h, float unit) {
    return __ldg(p.alibi_slopes + h) * float(kLog2e) / unit;
}

// How an instantiation applies the soft-cap: never; where p has one (a uniform branch per
// tile); or always (an instantiation of its own: in the decode kernels the transform's
// registers spilled the d256 body beside the plain path's).
enum class CapMode { kNone, kRuntime, kAlways };

// A variant type, the kernels' template argument: the hooks every kernel calls for what a
// variant changes, over the values in p. kWindowSinks: the instantiation serves windows and
// sinks (read from p where set); kAlibi: ALiBi (p.alibi_slopes, where set); without, the hooks
// are plain attention's and cost nothing.
template <CapMode kCap_, bool kWindowSinks_, bool kAlibi_ = false>
struct Variant {
    static constexpr CapMode kCap = kCap_;
    static constexpr bool kWindow = kWindowSinks_;
    static constexpr bool kSinks = kWindowSinks_;
    static constexpr bool kAlibi = kAlibi_;

    // Whether the scores are soft-capped: the cap must see true scores, so factors a kernel
    // would fold into the softmax scale (fp8 K scales) are applied to the scores first.
    __device__ __forceinline__ static bool capped(const AttentionParams& p) {
        if constexpr (kCap == CapMode::kAlways) return true;
        if constexpr (kCap == CapMode::kRuntime) return has_soft_cap(p);
        return false;
    }

    // A tile of raw scores (mma C layout) soft-capped in place where capped; online_softmax then
    // multiplies by scale_log2 = 1. Masking comes after (tanh(-inf) would be a finite -1).
    // cap_in: p.cap_in, or that times a factor the raw scores still carry (an fp8 K scale).
    template <int NT>
    __device__ __forceinline__ static void logits(float (&s)[NT][4], const AttentionParams& p, float cap_in) {
        if (capped(p)) soft_cap_tile(s, p, cap_in);
    }
    template <int NT>
    __device__ __forceinline__ static void logits(float (&s)[NT][4], const AttentionParams& p) {
        logits(s, p, p.cap_in);
    }

    // Whether p's scores take an ALiBi bias (a uniform branch: the kernels skip the bias pass).
    __device__ __forceinline__ static bool alibi(const AttentionParams& p) {
        return kAlibi && p.alibi_slopes != nullptr;
    }

    // The log2-domain worth of one raw unit where the raw scores carry no other factor
    // (alibi_step's unit): the softmax scale, or the soft-cap's slope at 0.
    __device__ __forceinline__ static float raw_unit(const AttentionParams& p) {
        return capped(p) ? p.cap_in * p.cap_log2 : p.scale_log2;
    }

    // ALiBi's bias added to a tile of raw scores (mma C layout: this thread's rows r = 0, 1 at
    // query positions pos[r], columns key0 + 8 j + {0, 1}), step[r] a key step's bias of row r's
    // head (alibi_step); before logits. Masked keys get it too and are masked after.
    template <int NT>
    __device__ __forceinline__ static void bias(float (&s)[NT][4], const float (&step)[2], int key0,
                                                const int (&pos)[2]) {
        if constexpr (kAlibi) {
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[j][e] = fmaf(step[e >> 1], float(key0 + 8 * j + (e & 1) - pos[e >> 1]), s[j][e]);
        }
    }

    // One raw score into the log2 domain online softmax works in (the scalar kernels).
    __device__ __forceinline__ static float logit_log2(const AttentionParams& p, float x) {
        return capped(p) ? p.cap_log2 * fast_tanh(x * p.cap_in) : x * p.scale_log2;
    }

    // The first key a query at absolute position pos sees (0 without a window; callers test
    // kWindow first where the type has none).
    __device__ __forceinline__ static int first_key(const AttentionParams& p, int pos) {
        return window_first_key(p, pos);
    }

    // The sink of query head h in the log2 domain; -inf without one.
    __device__ __forceinline__ static float sink(const AttentionParams& p, int h) {
        if constexpr (kSinks) return sink_log2(p, h);
        return -INFINITY;
    }

    // The factor turning a finished row's accumulator (max m, sum l; log2 domain) of query head
    // head() into its output: 1 / l, or with a sink its term joins the denominator; 0 for a row
    // with neither keys nor sink. The head is asked for only where there is a sink: computed
    // eagerly, it changed the kernels' SASS.
    template <class Head>
    __device__ __forceinline__ static float finish(const AttentionParams& p, Head&& head, float m, float l) {
        return kSinks && p.sinks != nullptr ? fold_sink(m, l, sink_log2(p, head())) : l > 0.f ? 1.f / l : 0.f;
    }
    // finish() for a decode split's partial: the sink joins here with one split; with several,
    // in the merge of the splits (sink()).
    template <class Head>
    __device__ __forceinline__ static float finish_split(const AttentionParams& p, Head&& head, float m, float l) {
        return kSinks && p.sinks != nullptr && p.num_splits == 1 ? fold_sink(m, l, sink_log2(p, head()))
               : l > 0.f                                         ? 1.f / l
                                                                 : 0.f;
    }

    // finish() for a thread's two mma rows whose 1 / l is inv_l already: the sink of head
    // head() (an empty head slot: any head; asked only where there is a sink) joins each row's
    // denominator.
    template <class Head, class RowStats>
    __device__ __forceinline__ static void finish_rows(const AttentionParams& p, Head&& head, const RowStats& st,
                                                       float (&inv_l)[2]) {
        if (kSinks && p.sinks != nullptr) {
            const float sink = sink_log2(p, head());
#pragma unroll
            for (int r = 0; r < 2; ++r) inv_l[r] = fold_sink(st.m[r], st.l[r], sink);
        }
    }
};

// The instantiations: plain attention (the Hopper prefill's fast path); every variant from p
// (the other prefill kernels, the scalar ones, the Hopper prefill's variant path); the decode
// kernels' three: windows and sinks with the soft-cap compiled out or in, and ALiBi's (every
// variant from p: a decode with ALiBi runs an instantiation of its own, so the others carry none
// of it).
using PlainAttention = Variant<CapMode::kNone, false>;
using RuntimeVariant = Variant<CapMode::kRuntime, true, true>;
using UncappedVariant = Variant<CapMode::kNone, true>;
using CappedVariant = Variant<CapMode::kAlways, true>;
using AlibiVariant = RuntimeVariant;

#endif  // __CUDACC__

}  // namespace astrai::attn
