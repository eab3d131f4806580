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
//
// FP8 pages (KvFmt = KvE4M3 / KvE5M2, paged only): the ring stages hold the tiles' bytes, and
// after each tile lands the block widens it into one 16-bit K and V tile (widen_fp8_tile,
// exact), which the MMAs read as above; Q is staged in that tile. The layer's K scale joins
// the scores' scale (or the soft-cap's input), its V scale the output.
#pragma once

#include <type_traits>

#include "capabilities.h"
#include "kv_fp8.cuh"
#include "prefill_parts.cuh"

namespace astrai::attn {

// KV_BYTES: bytes per stored K/V value (2, or 1 for fp8 pages, which add the widened tiles).
template <int D, int WARPS, int KV_BYTES = 2>
struct PrefillMmaConfig {
    static_assert(is_head_dim(D), "head_dim must be " ASTRAI_ATTN_HEAD_DIMS_TEXT);
    static_assert(WARPS == 4 || (WARPS == 8 && D <= 128), "4 warps, or 8 warps at D <= 128");
    static constexpr int kWarps = WARPS;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kRows = 16 * kWarps;  // (row, head) pairs per block
    static constexpr int kBN = D <= 128 ? 64 : 32;  // K/V rows per tile
    static constexpr int kStages = D <= 128 ? 3 : 2;
    static constexpr bool kQInRegs = D <= 128;  // D = 256 re-reads Q from shared memory
    static constexpr bool kFp8 = KV_BYTES == 1;
    static constexpr int kTileBytes = kBN * D * 2;  // a 16-bit tile, as the MMAs read it
    static constexpr int kQBytes = kRows * D * 2;
    static constexpr int kStageBytes = 2 * kBN * D * KV_BYTES;  // K tile then V tile, as stored
    static constexpr int kRingBytes = kStages * kStageBytes;
    // fp8: the widened K and V tiles after the ring
    static constexpr int kWideOffset = kRingBytes;
    static constexpr int kWideBytes = kFp8 ? 2 * kTileBytes : 0;
    // Q is staged where nothing lands before it moves to registers (the last ring stage, or
    // the widened tiles), else after everything.
    static constexpr int kQStageBytes = kFp8 ? kWideBytes : kStageBytes;
    static constexpr int kQSmemOffset =
        kQInRegs ? (kFp8 ? kWideOffset : kRingBytes - kStageBytes) : kRingBytes + kWideBytes;
    static constexpr int kSmemBytes = kRingBytes + kWideBytes + (kQInRegs ? 0 : kQBytes);
    static_assert(!kQInRegs || kQBytes <= kQStageBytes, "Q must fit where it is staged");
    static_assert(kSmemBytes <= 99 * 1024, "must fit the sm_86/89 shared-memory limit");
};

template <typename T, int D, int WARPS, class QSched, class KV, class KvFmt = Kv16, class V = RuntimeVariant>
__global__ void __launch_bounds__(PrefillMmaConfig<D, WARPS, KvFmt::kBytes>::kThreads, 1)
    prefill_mma_kernel(const AttentionParams p) {
#if !defined(ASTRAI_NO_MMA) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
    using C = PrefillMmaConfig<D, WARPS, KvFmt::kBytes>;
    using Tile = SwizzledTile<D>;
    // the ring's layout: the MMAs' tile, or fp8 bytes
    using StageTile = std::conditional_t<C::kFp8, Fp8Tile<D>, Tile>;
    using Stored = std::conditional_t<C::kFp8, uint8_t, T>;
    static_assert(!C::kFp8 || KV::kPaged, "fp8 K/V come from pages");
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sK = smem_u32(smem);  // stage s: K at sK + s * kStageBytes, V kStageBytes / 2 later
    const uint32_t sQ = sK + C::kQSmemOffset;
    const uint32_t sWide = sK + C::kWideOffset;  // fp8: the widened K tile, then V

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const QWork qw = QSched::get(p);
    if (qw.row_base >= qw.q_len) return;  // uniform per block
    const PrefillSpan sp = prefill_span<KV, V>(p, qw, C::kBN);
    const int wph = C::kWarps / p.head_block;

    // Q: block row r = slot * rows_blk + local row; warp w reads rows w*16 .. w*16+15.
    load_q_rows<T, Tile, D, C::kRows, C::kThreads>(p, qw, sp, sQ);
    cp_async_commit();

    KvTileLoader<T, KV, StageTile, D, C::kBN, C::kThreads, Stored> kv(p, qw, sp);
    auto load_stage = [&](int tile, int stage) {
        const uint32_t k_st = sK + stage * C::kStageBytes;
        kv.load(tile, k_st, k_st + C::kStageBytes / 2);
    };
    float k_scale = 1.f, v_scale = 1.f;
    if constexpr (C::kFp8) {
        k_scale = __ldg(p.k_scale + sp.kvh * p.kv_scale_stride);
        v_scale = __ldg(p.v_scale + sp.kvh * p.kv_scale_stride);
    }
    // a soft-capped score is already in the log2 domain (scale_log2 = 1)
    const float softmax_scale = V::capped(p) ? p.scale_log2 : p.scale_log2 * k_scale;
    const float cap_in = p.cap_in * k_scale;
    prime_kv_ring<C::kStages>(kv, sp.n_tiles, load_stage);

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
    const bool warp_active = slot < sp.nslots;
    const int row0 = qw.row_base + (warp % wph) * 16 + (lane >> 2);  // rows row0, row0 + 8
    const uint8_t* mask = p.mask ? p.mask + int64_t(qw.b) * p.mask_stride_b : nullptr;
    // ALiBi: a key step's bias of the warp's query head, in the raw units of its scores (they
    // carry the fp8 K scale in softmax_scale, or in cap_in where capped)
    float alibi[2] = {0.f, 0.f};
    if (V::alibi(p) && warp_active)
        alibi[0] = alibi[1] = alibi_step(p, sp.head0 + slot, V::capped(p) ? cap_in * p.cap_log2 : softmax_scale);

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    RowState st;

    for (int t = 0; t < sp.n_tiles; ++t) {
        cp_async_wait<C::kStages - 2>();
        __syncthreads();  // tile t visible; slot (t - 1) % kStages (and Q's) free for reuse
        refill_kv_ring<C::kStages>(kv, t, sp.n_tiles, load_stage);
        uint32_t k_st = sK + (t % C::kStages) * C::kStageBytes;
        uint32_t v_st = k_st + C::kStageBytes / 2;
        if constexpr (C::kFp8) {
            // every warp left the widened tiles of tile t - 1 (and Q) at the barrier above
            widen_fp8_tile<T, KvFmt, Tile, D, C::kBN, C::kThreads>(k_st, sWide);
            widen_fp8_tile<T, KvFmt, Tile, D, C::kBN, C::kThreads>(v_st, sWide + C::kTileBytes);
            k_st = sWide;
            v_st = sWide + C::kTileBytes;
            __syncthreads();
        }
        if (!warp_active) continue;

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

        const int col0 = (sp.t_begin + t) * C::kBN;
        if (V::alibi(p)) V::bias(s, alibi, col0 + 2 * (lane & 3), {row0 + sp.diag, row0 + 8 + sp.diag});
        V::logits(s, p, cap_in);
        if (tile_needs_mask<C::kBN, V>(p, qw, sp, col0, mask)) mask_scores<V>(s, p, qw, sp, col0, row0, mask);

        float alpha[2];
        online_softmax<C::kBN / 8>(st, s, softmax_scale, alpha);
        uint32_t pa[C::kBN / 16][4];
        pack_probs<T>(s, pa);
        rescale_rows(o, alpha);
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

    if constexpr (C::kFp8) rescale_rows(o, {v_scale, v_scale});
    if (warp_active) store_rows<T, D, V>(o, st, p, qw, sp.head0 + slot, row0);
#endif
}

}  // namespace astrai::attn
