// Prefill attention on tensor cores (mma.sync m16n8k16, sm_80+), split over Q.
//
// One kernel body for every (Q schedule, KV source) pair. A block of WARPS warps owns
// 16 * WARPS (row, head) pairs of one kv-head group: HB query heads x 16 * WARPS / HB rows,
// HB = head_block (1, 2 or 4). Warp w takes head slot w / WPH and rows (w % WPH) * 16 .. +16
// of that slot, WPH = WARPS / HB, so every K/V tile staged in shared memory serves HB heads
// and 16 * WARPS rows. WARPS = 4 is the spec's layout (one host Q tile splits into HB
// blocks); WARPS = 8 (HB >= 2, D <= 128) doubles the rows each K/V tile serves (a host
// tile splits into HB / 2 blocks). Per K/V tile of kBN rows:
//   S = Q K^T (Q fragments in registers for D <= 128), scale, mask, online softmax,
//   O += P V with P re-packed from the S accumulators as the A operand.
// K/V tiles stream through a cp.async ring (3 stages for D <= 128, Q staged in its last
// slot; 2 for D = 256), swizzled for conflict-free ldmatrix; page-table reads run one tile
// ahead of the copies. Causal launches walk the Q tiles last-first: the longest rows start
// first and the short ones fill the tail.
#pragma once

#include "common.h"
#include "layout_policies.cuh"
#include "mma_utils.cuh"

namespace astrai::attn {

template <int D, int WARPS>
struct PrefillMmaConfig {
    static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
    static_assert(WARPS == 4 || (WARPS == 8 && D <= 128), "4 warps, or 8 warps at D <= 128");
    static constexpr int kWarps = WARPS;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kRows = 16 * kWarps;  // (row, head) pairs per block
    static constexpr int kBN = D <= 128 ? 64 : 32;  // K/V rows per tile
    static constexpr int kStages = D <= 128 ? 3 : 2;
    static constexpr bool kQInRegs = D <= 128;  // D = 256 re-reads Q from shared memory
    static constexpr int kChunks = D / 8;       // 16-byte chunks per row
    // K/V copies: 8 neighbouring threads copy one 128-byte line of a row per instruction
    // (a warp: 4 rows x one line each) and a thread keeps its row for all D / 64 lines,
    // so a tile costs kPasses page lookups per thread (kPasses = 2..4).
    static constexpr int kThreadsPerRow = 8;
    static constexpr int kLines = kChunks / kThreadsPerRow;  // 128-byte lines per row
    static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
    static constexpr int kPasses = kBN / kRowsPerPass;
    static constexpr int kTileBytes = kBN * D * 2;
    static constexpr int kQBytes = kRows * D * 2;
    static constexpr int kStageBytes = 2 * kTileBytes;  // K tile then V tile
    static constexpr int kRingBytes = kStages * kStageBytes;
    // Q is staged in the last ring stage when it moves to registers, else after the ring.
    static constexpr int kQSmemOffset = kQInRegs ? kRingBytes - kStageBytes : kRingBytes;
    static constexpr int kSmemBytes = kQInRegs ? kRingBytes : kRingBytes + kQBytes;
    static_assert(!kQInRegs || kQBytes <= kStageBytes, "Q must fit one ring stage");
    static_assert(kBN % kRowsPerPass == 0, "tile rows must split evenly over the threads");
    static_assert(kSmemBytes <= 99 * 1024, "must fit the sm_86/89 shared-memory limit");
};

template <typename T, int D, int WARPS, class QSched, class KV>
__global__ void __launch_bounds__(PrefillMmaConfig<D, WARPS>::kThreads, 1)
    prefill_mma_kernel(const AttentionParams p) {
#if !defined(ASTRAI_NO_MMA) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
    using C = PrefillMmaConfig<D, WARPS>;
    using Tile = SwizzledTile<D>;
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sK = smem_u32(smem);  // stage s: K at sK + s * kStageBytes, V kTileBytes later
    const uint32_t sQ = sK + C::kQSmemOffset;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const QWork qw = QSched::get(p);
    if (qw.row_base >= qw.q_len) return;  // uniform per block

    const int hb = p.head_block;
    const int rows_blk = kQTileRows / p.blocks_per_tile;  // rows per head slot
    const int wph = C::kWarps / hb;
    const int kvh = blockIdx.y / p.head_groups;
    const int head0 = kvh * p.group + (blockIdx.y % p.head_groups) * hb;
    const int nslots = min(hb, kvh * p.group + p.group - head0);
    const int kv_len = KV::kv_len(p, qw.b);
    const int diag = kv_len - qw.q_len;  // bottom-right causal alignment
    const int row_last = min(qw.row_base + rows_blk, qw.q_len) - 1;
    const int kv_end = max(0, p.causal ? min(kv_len, row_last + diag + 1) : kv_len);
    const int n_tiles = (kv_end + C::kBN - 1) / C::kBN;

    // Q: block row r = slot * rows_blk + local row; warp w reads rows w*16 .. w*16+15.
    const T* q = static_cast<const T*>(p.q);
    for (int i = tid; i < C::kRows * C::kChunks; i += C::kThreads) {
        const int r = i / C::kChunks, c = i % C::kChunks;
        const int slot = r / rows_blk, row = qw.row_base + r % rows_blk;
        const bool ok = slot < nslots && row < qw.q_len;
        const T* src = ok ? q + qw.q_off + int64_t(row) * p.q_stride_l +
                                int64_t(head0 + slot) * p.q_stride_h + c * 8
                          : q;
        cp_async_16(sQ + Tile::offset(r, c), src, ok);
    }
    cp_async_commit();

    const T* kg = static_cast<const T*>(p.k);
    const T* vg = static_cast<const T*>(p.v);
    const int ld_r = tid / C::kThreadsPerRow, ld_c = tid % C::kThreadsPerRow;
    const typename KV::Request req = KV::request(p, qw.b);
    // Page-table reads run one tile ahead of the copies that need them.
    typename KV::Handle hnd[C::kPasses];
    auto fetch_tile = [&](int tile) {
#pragma unroll
        for (int pass = 0; pass < C::kPasses; ++pass) {
            const int pos = tile * C::kBN + ld_r + pass * C::kRowsPerPass;
            hnd[pass] = pos < kv_end ? KV::fetch(p, req, pos) : 0;
        }
    };
    auto load_kv = [&](int tile, int stage) {
        const uint32_t k_st = sK + stage * C::kStageBytes;
#pragma unroll
        for (int pass = 0; pass < C::kPasses; ++pass) {
            const int r = ld_r + pass * C::kRowsPerPass;
            const int pos = tile * C::kBN + r;
            const bool ok = pos < kv_end;
            int64_t ko = 0, vo = 0;
            if (ok) KV::offsets(p, req, hnd[pass], pos, kvh, ko, vo);
#pragma unroll
            for (int line = 0; line < C::kLines; ++line) {
                const int c = line * C::kThreadsPerRow + ld_c;
                const uint32_t off = Tile::offset(r, c);
                cp_async_16(k_st + off, kg + ko + c * 8, ok);
                cp_async_16(k_st + C::kTileBytes + off, vg + vo + c * 8, ok);
            }
        }
    };
    if (n_tiles > 0) fetch_tile(0);
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
        if (s < n_tiles) {
            load_kv(s, s);
            if (s + 1 < n_tiles) fetch_tile(s + 1);
        }
        cp_async_commit();
    }

    cp_async_wait<C::kStages - 1>();  // Q has landed
    __syncthreads();
    // Q fragment of k-step ks: rows warp * 16 + (lane & 15), chunk 2 * ks + (lane >> 4).
    auto q_frag = [&](int ks) { return sQ + Tile::offset(warp * 16 + (lane & 15), 2 * ks + (lane >> 4)); };
    uint32_t qf[C::kQInRegs ? D / 16 : 1][4];
    if constexpr (C::kQInRegs) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(qf[ks], q_frag(ks));
    }

    const int slot = warp / wph;
    const bool warp_active = slot < nslots;
    const int row0 = qw.row_base + (warp % wph) * 16 + (lane >> 2);  // rows row0, row0 + 8
    const uint8_t* mask = p.mask ? p.mask + int64_t(qw.b) * p.mask_stride_b : nullptr;

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    RowState st;

    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<C::kStages - 2>();
        __syncthreads();  // tile t visible; slot (t - 1) % kStages (and Q's) free for reuse
        const int next = t + C::kStages - 1;
        if (next < n_tiles) {
            load_kv(next, next % C::kStages);
            if (next + 1 < n_tiles) fetch_tile(next + 1);
        }
        cp_async_commit();
        if (!warp_active) continue;
        const uint32_t k_st = sK + (t % C::kStages) * C::kStageBytes;
        const uint32_t v_st = k_st + C::kTileBytes;

        float s[C::kBN / 8][4];
#pragma unroll
        for (int j = 0; j < C::kBN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            uint32_t qa[4];
            if constexpr (C::kQInRegs) {
#pragma unroll
                for (int x = 0; x < 4; ++x) qa[x] = qf[ks][x];
            } else {
                ldmatrix_x4(qa, q_frag(ks));
            }
#pragma unroll
            for (int np = 0; np < C::kBN / 16; ++np) {
                uint32_t kb[4];
                ldmatrix_x4(kb, k_st + Tile::offset(16 * np + ((lane >> 4) << 3) + (lane & 7),
                                                    2 * ks + ((lane >> 3) & 1)));
                mma_sync<T>(s[2 * np], qa, {kb[0], kb[1]});
                mma_sync<T>(s[2 * np + 1], qa, {kb[2], kb[3]});
            }
        }

        const int col0 = t * C::kBN;
        const bool need_mask = col0 + C::kBN > kv_len || mask != nullptr ||
                               (p.causal && col0 + C::kBN - 1 > qw.row_base + diag);
        if (need_mask) {
#pragma unroll
            for (int j = 0; j < C::kBN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = col0 + 8 * j + 2 * (lane & 3) + (e & 1);
                    const int row = row0 + 8 * (e >> 1);
                    bool keep = col < kv_len && (!p.causal || col <= row + diag);
                    if (keep && mask)
                        keep = mask[int64_t(min(row, qw.q_len - 1)) * p.mask_stride_q +
                                    int64_t(col) * p.mask_stride_k] != 0;
                    if (!keep) s[j][e] = -INFINITY;
                }
        }

        float alpha[2];
        online_softmax<C::kBN / 8>(st, s, p.scale_log2, alpha);
        // P leaves the fp32 scores as the 16-bit A operand of P V right away, so the scores'
        // registers are free before the V fragments are read.
        uint32_t pa[C::kBN / 16][4];
#pragma unroll
        for (int kk = 0; kk < C::kBN / 16; ++kk) {
            pa[kk][0] = Elem<T>::pack2(s[2 * kk][0], s[2 * kk][1]);
            pa[kk][1] = Elem<T>::pack2(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = Elem<T>::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[kk][3] = Elem<T>::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[j][0] *= alpha[0];
            o[j][1] *= alpha[0];
            o[j][2] *= alpha[1];
            o[j][3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < C::kBN / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, v_st + Tile::offset(16 * kk + (((lane >> 3) & 1) << 3) + (lane & 7),
                                                          2 * dp + (lane >> 4)));
                mma_sync<T>(o[2 * dp], pa[kk], {vb[0], vb[1]});
                mma_sync<T>(o[2 * dp + 1], pa[kk], {vb[2], vb[3]});
            }
        }
    }
    cp_async_wait<0>();

    if (!warp_active) return;
    float inv_l[2];
    finalize_rows(st, inv_l);
    T* out = static_cast<T*>(p.o) + qw.o_off + int64_t(head0 + slot) * p.o_stride_h;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h;
        if (row >= qw.q_len) continue;
        T* dst = out + int64_t(row) * p.o_stride_l + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<uint32_t*>(dst + 8 * j) =
                Elem<T>::pack2(o[j][2 * h] * inv_l[h], o[j][2 * h + 1] * inv_l[h]);
    }
#endif
}

}  // namespace astrai::attn
