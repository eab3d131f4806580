// Decode attention with CUDA cores (the ASTRAI_NO_MMA fallback), split over KV.
// Same grid, split rule and partial-output format as decode_mma_kernel, so the
// same decode_combine_kernel merges its splits. Warp w serves heads w, w + kWarps, ...
#pragma once

#include "common.h"
#include "decode_unit.cuh"
#include "layout_policies.cuh"
#include "scalar_row.cuh"

namespace astrai::attn {

template <int D>
struct DecodeScalarConfig {
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kBN = 64;  // split granularity (positions)
    static constexpr int kHeads = 16;
};

template <typename T, int D, class KV, class V = RuntimeVariant>
__global__ void __launch_bounds__(128) decode_scalar_kernel(const AttentionParams p) {
    using C = DecodeScalarConfig<D>;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const DecodeUnit u = decode_unit<C::kHeads>(p);
    const int split = u.split, kvh = u.kvh, b = u.b, head0 = u.head0, nh = u.nh;
    const int kv_len = KV::kv_len(p, b);
    const int n_tiles = (kv_len + C::kBN - 1) / C::kBN;
    const int first_key = V::first_key(p, kv_len - 1);
    const int t_lo = first_key / C::kBN;
    const int per_split = (n_tiles - t_lo + p.num_splits - 1) / p.num_splits;
    const int begin = max(first_key, min(kv_len, (t_lo + split * per_split) * C::kBN));
    const int end = min(kv_len, (t_lo + (split + 1) * per_split) * C::kBN);
    const uint8_t* mask = p.mask ? p.mask + int64_t(b) * p.mask_stride_b : nullptr;
    auto keep = [&](int pos) { return !mask || mask[int64_t(pos) * p.mask_stride_k] != 0; };

    for (int r = warp; r < nh; r += C::kWarps) {
        const int h = head0 + r;
        const T* q_row = static_cast<const T*>(p.q) + int64_t(b) * p.q_stride_b + int64_t(h) * p.q_stride_h;
        const auto st = scalar_row_attention<T, D, KV, V>(p, q_row, h, kv_len - 1, b, kvh, begin, end, keep);
        // one split: the sink joins the denominator here; several: in decode_combine_kernel
        const float inv = p.num_splits == 1 ? V::finish(p, [&] { return h; }, st.m, st.l) : st.l > 0.f ? 1.f / st.l : 0.f;
        if (p.num_splits == 1) {
            T* dst = static_cast<T*>(p.o) + int64_t(b) * p.o_stride_b + int64_t(h) * p.o_stride_h;
#pragma unroll
            for (int e = 0; e < D / 32; ++e) dst[lane + 32 * e] = Elem<T>::from_float(st.acc[e] * inv);
        } else {
            const int64_t bh = int64_t(split) * p.batch * p.q_heads + int64_t(b) * p.q_heads + h;
#pragma unroll
            for (int e = 0; e < D / 32; ++e) p.ws_o[bh * D + lane + 32 * e] = st.acc[e] * inv;
            if (lane == 0) p.ws_lse[bh] = st.l > 0.f ? st.m + __log2f(st.l) : -INFINITY;
        }
    }
}

}  // namespace astrai::attn
