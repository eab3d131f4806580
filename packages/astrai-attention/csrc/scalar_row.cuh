// One warp computes one (query row, head) against a KV range with CUDA cores: the body of
// the scalar fallback kernels (ASTRAI_NO_MMA builds). Lane l owns dims l, l+32, ...
#pragma once

#include "common.h"
#include "layout_policies.cuh"
#include "mma_utils.cuh"
#include "variant.cuh"

namespace astrai::attn {

template <int D>
struct ScalarRowState {
    static constexpr int kPerLane = D / 32;
    float acc[kPerLane];
    float m = -INFINITY;
    float l = 0.f;
};

// Attends q_row (a pointer to D elements) of query head h at position q_pos over positions
// [begin, end) of request b, kv head kvh; keep(pos) decides masking, the variant V the bias and
// the logits. Returns the unnormalized state.
template <typename T, int D, class KV, class V, class Keep>
__device__ ScalarRowState<D> scalar_row_attention(const AttentionParams& p, const T* q_row, int h, int q_pos, int b,
                                                  int kvh, int begin, int end, Keep keep) {
    constexpr int kPer = D / 32;
    const int lane = threadIdx.x % 32;
    float qv[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) qv[e] = Elem<T>::to_float(q_row[lane + 32 * e]);
    ScalarRowState<D> st;
#pragma unroll
    for (int e = 0; e < kPer; ++e) st.acc[e] = 0.f;
    const T* kg = static_cast<const T*>(p.k);
    const T* vg = static_cast<const T*>(p.v);
    const typename KV::Request req = KV::request(p, b);
    const float alibi = V::alibi(p) ? alibi_step(p, h, V::raw_unit(p)) : 0.f;
    for (int pos = begin; pos < end; ++pos) {
        if (!keep(pos)) continue;  // uniform over the warp
        int64_t ko, vo;
        KV::offsets(p, req, KV::fetch(p, req, pos), pos, kvh, ko, vo);
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kPer; ++e) dot += qv[e] * Elem<T>::to_float(kg[ko + lane + 32 * e]);
        const float s = V::logit_log2(p, fmaf(alibi, float(pos - q_pos), warp_reduce_sum<32>(dot)));
        const float m = fmaxf(st.m, s);
        const float alpha = exp2f(st.m - m);
        const float pr = exp2f(s - m);
        st.l = st.l * alpha + pr;
#pragma unroll
        for (int e = 0; e < kPer; ++e)
            st.acc[e] = st.acc[e] * alpha + pr * Elem<T>::to_float(vg[vo + lane + 32 * e]);
        st.m = m;
    }
    return st;
}

}  // namespace astrai::attn
