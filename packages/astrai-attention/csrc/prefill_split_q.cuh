// Prefill attention with CUDA cores (the ASTRAI_NO_MMA fallback), split over Q.
// Same grid, Q schedules and head packing as prefill_mma_kernel: warp w takes head slot
// w / WPH and rows (w % WPH) * 16 .. +16, one row at a time.
#pragma once

#include "common.h"
#include "layout_policies.cuh"
#include "scalar_row.cuh"

namespace astrai::attn {

template <typename T, int D, class QSched, class KV, class V = RuntimeVariant>
__global__ void __launch_bounds__(128) prefill_scalar_kernel(const AttentionParams p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const QWork qw = QSched::get(p);
    if (qw.row_base >= qw.q_len) return;
    const int hb = p.head_block;
    const int wph = kPrefillWarps / hb;
    const int kvh = blockIdx.y / p.head_groups;
    const int head0 = kvh * p.group + (blockIdx.y % p.head_groups) * hb;
    const int slot = warp / wph;
    if (head0 + slot >= kvh * p.group + p.group) return;
    const int h = head0 + slot;
    const int kv_len = KV::kv_len(p, qw.b);
    const int diag = kv_len - qw.q_len;
    const uint8_t* mask = p.mask ? p.mask + int64_t(qw.b) * p.mask_stride_b : nullptr;
    for (int i = 0; i < 16; ++i) {
        const int row = qw.row_base + (warp % wph) * 16 + i;  // 4 warps: blocks_per_tile == HB
        if (row >= qw.q_len) break;
        const int end = max(0, p.causal ? min(kv_len, row + diag + 1) : kv_len);
        auto keep = [&](int pos) {
            return !mask || mask[int64_t(row) * p.mask_stride_q + int64_t(pos) * p.mask_stride_k] != 0;
        };
        const T* q_row = static_cast<const T*>(p.q) + qw.q_off + int64_t(row) * p.q_stride_l +
                         int64_t(h) * p.q_stride_h;
        const int begin = V::first_key(p, row + diag);
        const auto st = scalar_row_attention<T, D, KV, V>(p, q_row, h, row + diag, qw.b, kvh, begin, end, keep);
        const float inv = V::finish(p, [&] { return h; }, st.m, st.l);
        T* dst = static_cast<T*>(p.o) + qw.o_off + int64_t(row) * p.o_stride_l + int64_t(h) * p.o_stride_h;
#pragma unroll
        for (int e = 0; e < D / 32; ++e) dst[lane + 32 * e] = Elem<T>::from_float(st.acc[e] * inv);
    }
}

}  // namespace astrai::attn
