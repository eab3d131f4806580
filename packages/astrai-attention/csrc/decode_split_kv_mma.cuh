// Decode attention on tensor cores (mma.sync m16n8k16, sm_80+), split over KV.
//
// Block (unit, split): unit = (request, kv head, group of up to 16 query heads), split =
// one of num_splits equal shares of the request's KV tiles, sized on the device from the
// request's own length (so the host needs no KV length and the launch is graph-capturable).
// The query heads of one kv head are the 16 rows of the mma A operand (a GQA group of G
// heads fills G of them). Each tile of kBN = 16 * kWarps K/V rows streams through a
// kStages-deep cp.async ring; warp w scores rows w*16 .. w*16+15 of every tile with its own
// online softmax, and the warps merge through shared memory at the end. With one split the
// block writes the output; otherwise it writes a normalized partial and its log2-sum-exp
// for decode_combine_kernel.
#pragma once

#include "common.h"
#include "layout_policies.cuh"
#include "mma_utils.cuh"

namespace astrai::attn {

template <int D>
struct DecodeMmaConfig {
    static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
    static constexpr int kWarps = D <= 128 ? 4 : 2;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kBN = 16 * kWarps;  // K/V rows per tile
    static constexpr int kStages = D <= 128 ? 3 : 2;
    static constexpr int kHeads = 16;  // query heads per block (mma rows)
    static constexpr bool kQInRegs = D <= 128;  // else Q fragments are re-read from smem
    static constexpr int kChunks = D / 8;
    static constexpr int kRowsPerPass = kThreads / kChunks;
    static constexpr int kTileBytes = kBN * D * 2;
    static constexpr int kQBytes = kHeads * D * 2;
    static constexpr int kRingBytes = 2 * kStages * kTileBytes;
    // Q is staged in the last ring slot when it lives in registers.
    static constexpr int kQSmemOffset = kQInRegs ? (2 * kStages - 1) * kTileBytes : kRingBytes;
    static constexpr int kCombineBytes = kWarps * kHeads * (D + 2) * 4;
    static constexpr int kSmemBytes = kQInRegs ? kRingBytes : kRingBytes + kQBytes;
    static_assert(kBN % kRowsPerPass == 0, "tile rows must split evenly over the threads");
    static_assert(kQBytes <= kTileBytes, "Q must fit one ring slot");
    static_assert(kCombineBytes <= kRingBytes, "the warp merge reuses the ring");
    static_assert(kSmemBytes <= 99 * 1024, "must fit the sm_86/89 shared-memory limit");
};

template <typename T, int D, class KV>
__global__ void __launch_bounds__(DecodeMmaConfig<D>::kThreads)
    decode_mma_kernel(const AttentionParams p) {
#if !defined(ASTRAI_NO_MMA) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
    using C = DecodeMmaConfig<D>;
    using Tile = SwizzledTile<D>;
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sK = smem_u32(smem);
    const uint32_t sV = sK + C::kStages * C::kTileBytes;
    const uint32_t sQ = sK + C::kQSmemOffset;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int unit = blockIdx.x, split = blockIdx.y;
    const int hgrp = unit % p.head_groups;
    const int kvh = (unit / p.head_groups) % p.kv_heads;
    const int b = unit / (p.head_groups * p.kv_heads);
    const int head0 = kvh * p.group + hgrp * C::kHeads;
    const int nh = min(C::kHeads, p.group - hgrp * C::kHeads);

    const int kv_len = KV::kv_len(p, b);
    // Read beside kv_len (not after the Q copies): the first page-id read waits on both.
    const typename KV::Request req = KV::request(p, b);
    const int n_tiles = (kv_len + C::kBN - 1) / C::kBN;
    const int per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
    const int t_begin = min(n_tiles, split * per_split);
    const int t_end = min(n_tiles, t_begin + per_split);
    const int my_tiles = t_end - t_begin;

    const T* q = static_cast<const T*>(p.q) + int64_t(b) * p.q_stride_b;
    for (int i = tid; i < C::kHeads * C::kChunks; i += C::kThreads) {
        const int r = i / C::kChunks, c = i % C::kChunks;
        const bool ok = r < nh;
        cp_async_16(sQ + Tile::offset(r, c), ok ? q + int64_t(head0 + r) * p.q_stride_h + c * 8 : q, ok);
    }
    cp_async_commit();

    const T* kg = static_cast<const T*>(p.k);
    const T* vg = static_cast<const T*>(p.v);
    const int ld_c = tid % C::kChunks, ld_r = tid / C::kChunks;
    constexpr int kPasses = C::kBN / C::kRowsPerPass;
    // Page ids run ahead of the copies: hnd holds the ids of the tile copied next; a paged
    // source reads them one more tile ahead (hnd_ahead), so a page-table read has two
    // iterations to land before its copies are issued.
    constexpr bool kAhead = KV::kPaged;
    typename KV::Handle hnd[kPasses], hnd_ahead[kAhead ? kPasses : 1];
    auto fetch_tile = [&](int tile, typename KV::Handle* h) {
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int pos = tile * C::kBN + ld_r + pass * C::kRowsPerPass;
            h[pass] = pos < kv_len ? KV::fetch(p, req, pos) : 0;
        }
    };
    auto load_kv = [&](int tile, int stage) {
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int r = ld_r + pass * C::kRowsPerPass;
            const int pos = tile * C::kBN + r;
            const bool ok = pos < kv_len;
            // Branch-free: every pass's address math is independent, so the passes
            // interleave; a position past the end reads nothing (zero fill) from offset 0.
            int64_t ko, vo;
            KV::offsets(p, req, hnd[pass], pos, kvh, ko, vo);
            ko = ok ? ko : 0;
            vo = ok ? vo : 0;
            const uint32_t off = Tile::offset(r, ld_c);
            cp_async_16(sK + stage * C::kTileBytes + off, kg + ko + ld_c * 8, ok);
            cp_async_16(sV + stage * C::kTileBytes + off, vg + vo + ld_c * 8, ok);
        }
    };
    // After the copies of tile j - 1: make hnd the ids of tile j (relative indices).
    auto advance = [&](int j) {
        if (j >= my_tiles) return;
        if constexpr (kAhead) {
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) hnd[pass] = hnd_ahead[pass];
            if (j + 1 < my_tiles) fetch_tile(t_begin + j + 1, hnd_ahead);
        } else {
            fetch_tile(t_begin + j, hnd);
        }
    };

    // Q first, in its own group: it lands before any K/V tile overwrites its slot.
    if (my_tiles > 0) fetch_tile(t_begin, hnd);
    if constexpr (kAhead) {
        if (my_tiles > 1) fetch_tile(t_begin + 1, hnd_ahead);
    }
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qf[C::kQInRegs ? D / 16 : 1][4];
    if constexpr (C::kQInRegs) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
            ldmatrix_x4(qf[ks], sQ + Tile::offset(lane & 15, 2 * ks + (lane >> 4)));
        __syncthreads();
    }
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
        if (s < my_tiles) {
            load_kv(t_begin + s, s);
            advance(s + 1);
        }
        cp_async_commit();
    }

    const uint8_t* mask = p.mask ? p.mask + int64_t(b) * p.mask_stride_b : nullptr;
    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    RowState st;

    for (int i = 0; i < my_tiles; ++i) {
        cp_async_wait<C::kStages - 2>();
        __syncthreads();
        const int next = i + C::kStages - 1;
        if (next < my_tiles) {
            load_kv(t_begin + next, next % C::kStages);
            advance(next + 1);
        }
        cp_async_commit();

        const int stage = i % C::kStages;
        const uint32_t k_st = sK + stage * C::kTileBytes;
        const uint32_t v_st = sV + stage * C::kTileBytes;
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            uint32_t qa[4];
            if constexpr (C::kQInRegs) {
#pragma unroll
                for (int x = 0; x < 4; ++x) qa[x] = qf[ks][x];
            } else {
                ldmatrix_x4(qa, sQ + Tile::offset(lane & 15, 2 * ks + (lane >> 4)));
            }
            uint32_t kb[4];
            ldmatrix_x4(kb, k_st + Tile::offset(warp * 16 + ((lane >> 4) << 3) + (lane & 7),
                                                2 * ks + ((lane >> 3) & 1)));
            mma_sync<T>(s[0], qa, {kb[0], kb[1]});
            mma_sync<T>(s[1], qa, {kb[2], kb[3]});
        }
        const int col0 = (t_begin + i) * C::kBN + warp * 16;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = col0 + 8 * j + 2 * (lane & 3) + (e & 1);
                bool keep = col < kv_len;
                if (keep && mask) keep = mask[int64_t(col) * p.mask_stride_k] != 0;
                if (!keep) s[j][e] = -INFINITY;
            }
        float alpha[2];
        online_softmax<2>(st, s, p.scale_log2, alpha);
        const uint32_t pa[4] = {Elem<T>::pack2(s[0][0], s[0][1]), Elem<T>::pack2(s[0][2], s[0][3]),
                                Elem<T>::pack2(s[1][0], s[1][1]), Elem<T>::pack2(s[1][2], s[1][3])};
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            o[2 * dp][0] *= alpha[0];
            o[2 * dp][1] *= alpha[0];
            o[2 * dp][2] *= alpha[1];
            o[2 * dp][3] *= alpha[1];
            o[2 * dp + 1][0] *= alpha[0];
            o[2 * dp + 1][1] *= alpha[0];
            o[2 * dp + 1][2] *= alpha[1];
            o[2 * dp + 1][3] *= alpha[1];
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, v_st + Tile::offset(warp * 16 + (((lane >> 3) & 1) << 3) + (lane & 7),
                                                      2 * dp + (lane >> 4)));
            mma_sync<T>(o[2 * dp], pa, {vb[0], vb[1]});
            mma_sync<T>(o[2 * dp + 1], pa, {vb[2], vb[3]});
        }
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (p.num_splits > 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    cp_async_wait<0>();
    __syncthreads();  // the ring is reused for the warp merge below

    // Merge the warps: sO[w][row][d] (unnormalized), sM / sL [w][row].
    float* sO = reinterpret_cast<float*>(smem);
    float* sM = sO + C::kWarps * C::kHeads * D;
    float* sL = sM + C::kWarps * C::kHeads;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = warp_reduce_sum<4>(st.l[r]);
        const int row = (lane >> 2) + 8 * r;
        if ((lane & 3) == 0) {
            sM[warp * C::kHeads + row] = st.m[r];
            sL[warp * C::kHeads + row] = l;
        }
        float* dst = sO + (warp * C::kHeads + row) * D + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * r], o[j][2 * r + 1]);
    }
    __syncthreads();

    const int bh0 = b * p.q_heads + head0;
    for (int idx = tid; idx < nh * D; idx += C::kThreads) {
        const int row = idx / D, d = idx % D;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < C::kWarps; ++w) m = fmaxf(m, sM[w * C::kHeads + row]);
        const float base = m == -INFINITY ? 0.f : m;
        float acc = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < C::kWarps; ++w) {
            const float f = exp2f(sM[w * C::kHeads + row] - base);
            acc += f * sO[(w * C::kHeads + row) * D + d];
            l += f * sL[w * C::kHeads + row];
        }
        const float out = l > 0.f ? acc / l : 0.f;
        if (p.num_splits == 1) {
            T* dst = static_cast<T*>(p.o) + int64_t(b) * p.o_stride_b + int64_t(head0 + row) * p.o_stride_h;
            dst[d] = Elem<T>::from_float(out);
        } else {
            const int64_t bh = int64_t(split) * p.batch * p.q_heads + bh0 + row;
            p.ws_o[bh * D + d] = out;
            if (d == 0) p.ws_lse[bh] = l > 0.f ? m + __log2f(l) : -INFINITY;
        }
    }
#endif
}

// Merges the num_splits partials of one (request, query head) per block.
template <typename T, int D>
__global__ void __launch_bounds__(128) decode_combine_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // launched early (PDL): wait for the splits
#endif
    const int bh = blockIdx.x;
    const int b = bh / p.q_heads, h = bh % p.q_heads;
    const int64_t stride = int64_t(p.batch) * p.q_heads;
    float m = -INFINITY;
    for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.ws_lse[s * stride + bh]);
    const float base = m == -INFINITY ? 0.f : m;
    T* dst = static_cast<T*>(p.o) + int64_t(b) * p.o_stride_b + int64_t(h) * p.o_stride_h;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f, l = 0.f;
        for (int s = 0; s < p.num_splits; ++s) {
            const float f = exp2f(p.ws_lse[s * stride + bh] - base);
            acc += f * p.ws_o[(s * stride + bh) * D + d];
            l += f;
        }
        dst[d] = Elem<T>::from_float(l > 0.f ? acc / l : 0.f);
    }
}

}  // namespace astrai::attn
