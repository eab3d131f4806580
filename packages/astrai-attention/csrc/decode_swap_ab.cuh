// The decode kernel's swapped-operand form over fp8 pages (decode_mma_kernel<..., kSwapAB>),
// for GQA groups of at most 8 query heads: the heads become the mma's n8 dimension instead of
// filling a few of its 16 rows.
//
//   scores  S^T [16 keys x 8 heads]  = K [keys x d] . Q^T      K's bytes convert into A fragments
//   output  O^T [16 d x 8 heads]    += V^T [d x keys] . P^T    P^T: S^T's C fragments, movmatrix'd
//
// Per warp and 16 keys that is D/16 mma for each product instead of D/8, O^T in D/16 x 4
// registers instead of D/8 x 4, Q^T in D/16 x 2 instead of D/16 x 4, and a quarter of the
// exponents of the 16-row form. The fp8 permutations of kv_fp8.cuh carry over unchanged: the
// scores' k (head dim) permutation, and for the output the head-dim order of the 16-row form's
// n dimension, now O^T's rows: row g of m-tile mt is head-dim element g * D/8 + 2 mt, row g + 8
// the next one. A thread's accumulator columns are heads 2t and 2t + 1 (t = lane % 4), so the
// softmax state is per column, reduced over the 8 lanes that share t.
#pragma once

#include "kv_fp8.cuh"
#include "mma_utils.cuh"

namespace astrai::attn {

constexpr int kSwapHeads = 8;  // query heads per block of the swapped form (mma n8)

// The transpose of the 8x8 16-bit matrix whose row g, columns 2t, 2t + 1 this thread holds.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// Max / sum over the 8 lanes of an accumulator column (lanes with the same lane % 4).
__device__ __forceinline__ float column_max(float v) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float column_sum(float v) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Online softmax state of a thread's two head columns (2t, 2t + 1): m in the scaled log2
// domain, l the partial sum over this lane's keys (column-reduced at the end).
struct HeadState {
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};
};

// Q^T's B fragment of k-step ks from the float16 Q tile (SwizzledTile<D>, head h in row h):
// Q[head g][e, e + 1] and Q[head g][e + 2, e + 3], e the fp8 scores' permuted element.
template <int D>
__device__ __forceinline__ void swap_q_fragment(uint32_t (&qb)[2], const uint8_t* q_tile, int ks, int lane) {
    const int e = 64 * (ks / 4) + 16 * (lane & 3) + 4 * (ks % 4);
    const uint2 x = *reinterpret_cast<const uint2*>(q_tile + SwizzledTile<D>::offset(lane >> 2, e / 8) + 2 * (e % 8));
    qb[0] = x.x;
    qb[1] = x.y;
}

// S^T of a warp's 16 keys of one fp8 K tile, raw q.k on float16: keys g and g + 8 of the warp's
// rows, heads 2t and 2t + 1 (s[0], s[1]: key g; s[2], s[3]: key g + 8).
// q_frag(ks, qb): Q^T's B fragment of k-step ks (swap_q_fragment, or kept in registers).
template <int D, class KvFmt, class QFrag>
__device__ __forceinline__ void swap_scores(float (&s)[4], const uint8_t* k_tile, int warp, int lane,
                                            QFrag&& q_frag) {
    for_fp8_k_segments<D>(k_tile, warp, lane, [&](int seg, const uint4 (&kw)[2]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const uint32_t lo = (&kw[0].x)[kk], hi = (&kw[1].x)[kk];  // keys g, g + 8
            const uint32_t a[4] = {fp8x2_to_half2<KvFmt>(lo), fp8x2_to_half2<KvFmt>(hi),
                                   fp8x2_to_half2<KvFmt, true>(lo), fp8x2_to_half2<KvFmt, true>(hi)};
            uint32_t qb[2];
            q_frag(4 * seg + kk, qb);
            mma_sync<__half>(s, a, qb);
        }
    });
}

// online_softmax_lazy (mma_utils.cuh) over a thread's two head columns of S^T: a column keeps
// its exponent base until a tile's max exceeds it by more than kSlack; returns whether the
// warp rescales (alpha: O's factor per column, 1 where the column kept its base).
__device__ __forceinline__ bool swap_softmax_lazy(HeadState& st, float (&s)[4], const float (&scale_log2)[2],
                                                  float (&alpha)[2]) {
    constexpr float kSlack = 8.f;
    float mx[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) mx[c] = column_max(fmaxf(s[c], s[c + 2])) * scale_log2[c];
    const bool rescale = __any_sync(0xffffffffu, mx[0] > st.m[0] + kSlack || mx[1] > st.m[1] + kSlack);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const float base = lazy_base(st.m[c], mx[c], rescale, alpha[c]);
        s[c] = exp2f(fmaf(s[c], scale_log2[c], -base));
        s[c + 2] = exp2f(fmaf(s[c + 2], scale_log2[c], -base));
        st.l[c] = st.l[c] * alpha[c] + s[c] + s[c + 2];
    }
    return rescale;
}

// O^T += V^T . P^T for a warp's 16 keys of one fp8 V tile: P (probabilities of S^T's layout)
// transposed into B fragments; the byte pair (j, j + 1) of for_fp8_v_pairs is m-tile j / 2's
// rows g and g + 8 (keys 2t, 2t + 1 in lo, 2t + 8, 2t + 9 in hi).
template <int D, class KvFmt>
__device__ __forceinline__ void swap_output(float (&o)[D / 16][4], const float (&s)[4], const float (&alpha)[2],
                                            bool rescale, const uint8_t* v_tile, int warp, int lane) {
    const uint32_t pb[2] = {movmatrix_trans(Elem<__half>::pack2(s[0], s[1])),
                            movmatrix_trans(Elem<__half>::pack2(s[2], s[3]))};
    if (rescale) {
#pragma unroll
        for (int mt = 0; mt < D / 16; ++mt) {
            o[mt][0] *= alpha[0];
            o[mt][1] *= alpha[1];
            o[mt][2] *= alpha[0];
            o[mt][3] *= alpha[1];
        }
    }
    for_fp8_v_pairs<D>(v_tile, warp, lane, [&](int j, uint32_t lo, uint32_t hi) {
        const uint32_t a[4] = {fp8x2_to_half2<KvFmt>(lo), fp8x2_to_half2<KvFmt, true>(lo),
                               fp8x2_to_half2<KvFmt>(hi), fp8x2_to_half2<KvFmt, true>(hi)};
        mma_sync<__half>(o[j / 2], a, pb);
    });
}

}  // namespace astrai::attn
