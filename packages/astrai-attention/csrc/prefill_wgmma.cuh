// Prefill attention on Hopper's warpgroup MMA (wgmma, sm_90a), split over Q: the same
// schedule, head packing, K/V ring, masks and softmax as the mma.sync kernel
// (prefill_split_q_mma.cuh), with the MMAs issued per warpgroup.
//
// A block of two warpgroups (256 threads) owns 128 (row, head) pairs of one kv-head group,
// packed exactly like the 8-warp mma.sync block (HB >= 2): warp w holds block rows
// 16w .. 16w + 15, so warpgroup g holds rows 64g .. 64g + 63. Per K/V tile of 128 rows:
//   S[64 x 128] = Q K^T    8 x wgmma.m64n128k16, Q and K read from shared memory,
//   mask, online softmax on the accumulators (the mma.sync C layout per warp),
//   O[64 x D] += P V       8 x wgmma.m64n128k16, P from registers, V N-major in shared memory.
// Tiles are stored as 64-element panels of 128-byte rows with the 128-byte swizzle the
// wgmma descriptors describe; K/V stream through a cp.async ring (made visible to the async
// proxy before the MMAs read it). D = 128 only; the launcher sends every other
// case to the mma.sync kernel.
#pragma once

#include "prefill_parts.cuh"
#include "wgmma_utils.cuh"

namespace astrai::attn {

// A [ROWS][D] tile as D / 64 panels of [ROWS][128 bytes]; chunk c of row r lives in panel
// c / 8 at chunk (c % 8) ^ (r % 8): the canonical 128-byte-swizzled wgmma layout, whose
// 8-row atoms start 1024 bytes apart when the tile base is 1024-byte aligned.
template <int ROWS>
struct PanelTile {
    static constexpr int kPanelBytes = ROWS * 128;
    __device__ __forceinline__ static uint32_t offset(int r, int c) {
        return uint32_t((c >> 3) * kPanelBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
    }
};

// 128-row K/V tiles in 2 stages (161 KB with Q): against 64-row tiles in 3 stages they
// halve the barriers and the softmax's row reductions per K/V row, and measured 8-13 %
// faster on an H200.
struct PrefillWgmmaConfig {
    static constexpr int D = 128;
    static constexpr int kThreads = 256;  // two warpgroups
    static constexpr int kRows = 128;     // (row, head) pairs per block
    static constexpr int kBN = 128;       // K/V rows per tile
    static constexpr int kStages = 2;
    static constexpr int kTileBytes = kBN * D * 2;  // two panels of kBN rows
    static constexpr int kStageBytes = 2 * kTileBytes;
    static constexpr int kQBytes = kRows * D * 2;   // 32 KB: two panels of 128 rows
    static constexpr int kSmemBytes = kStages * kStageBytes + kQBytes + 1024;  // + base alignment
};

template <typename T, class QSched, class KV>
__global__ void __launch_bounds__(PrefillWgmmaConfig::kThreads, 1) prefill_wgmma_kernel(const AttentionParams p) {
#if ASTRAI_ATTN_SM90
    using C = PrefillWgmmaConfig;
    constexpr int D = C::D;
    using KvTile = PanelTile<C::kBN>;
    using QTile = PanelTile<C::kRows>;
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t sK = (smem_u32(smem) + 1023u) & ~1023u;  // stage s: K at sK + s * kStageBytes, V after it
    const uint32_t sQ = sK + C::kStages * C::kStageBytes;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    const QWork qw = QSched::get(p);
    if (qw.row_base >= qw.q_len) return;  // uniform per block
    const PrefillSpan sp = prefill_span<KV>(p, qw, C::kBN);
    const int wph = 8 / p.head_block;  // warps per head slot

    load_q_rows<T, QTile, D, C::kRows, C::kThreads>(p, qw, sp, sQ);
    cp_async_commit();
    KvTileLoader<T, KV, KvTile, D, C::kBN, C::kThreads> kv(p, qw, sp);
    auto load_stage = [&](int tile, int stage) {
        const uint32_t k_st = sK + stage * C::kStageBytes;
        kv.load(tile, k_st, k_st + C::kTileBytes);
    };
    prime_kv_ring<C::kStages>(kv, sp.n_tiles, load_stage);

    const int slot = warp / wph;
    const int row0 = qw.row_base + (warp % wph) * 16 + (lane >> 2);  // rows row0, row0 + 8
    const uint8_t* mask = p.mask ? p.mask + int64_t(qw.b) * p.mask_stride_b : nullptr;
    // Q rows of this warpgroup: 64 rows into each panel (8 atoms of 1024 bytes).
    const uint32_t q_wg = sQ + wg * 64 * 128;
    constexpr uint32_t kV8Rows = 8 * 128;                  // next 8 rows of a panel
    constexpr uint32_t kVPanel = KvTile::kPanelBytes;      // next 64 columns

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    RowState st;

    for (int t = 0; t < sp.n_tiles; ++t) {
        cp_async_wait<C::kStages - 2>();  // tile t (and, at t = 0, Q) has landed
        fence_async_shared();
        __syncthreads();  // visible to every warpgroup; stage (t - 1) % kStages is free
        refill_kv_ring<C::kStages>(kv, t, sp.n_tiles, load_stage);
        const uint32_t k_st = sK + (t % C::kStages) * C::kStageBytes;
        const uint32_t v_st = k_st + C::kTileBytes;

        float s[C::kBN / 8][4];
#pragma unroll
        for (int j = 0; j < C::kBN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        fence_accumulators(s);  // register writes before the fence, as wgmma requires
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            // k-step ks: panel ks / 4, 32 bytes further along the 128-byte rows per step
            const uint32_t koff = (ks % 4) * 32;
            const uint64_t da = sw128_desc(q_wg + (ks / 4) * QTile::kPanelBytes + koff, 16, 1024);
            const uint64_t db = sw128_desc(k_st + (ks / 4) * KvTile::kPanelBytes + koff, 16, 1024);
            wgmma_qk<T>(s, da, db, ks > 0);
        }
        wgmma_commit();
        wgmma_wait_all();
        fence_accumulators(s);

        const int col0 = t * C::kBN;
        if (tile_needs_mask<C::kBN>(p, qw, sp, col0, mask)) mask_scores(s, p, qw, sp, col0, row0, mask);
        float alpha[2];
        online_softmax<C::kBN / 8>(st, s, p.scale_log2, alpha);
        uint32_t pa[C::kBN / 16][4];
        pack_probs<T>(s, pa);
        rescale_rows(o, alpha);
        fence_accumulators(o);
        fence_fragments(pa);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < C::kBN / 16; ++kk) {
            // k-step kk: V rows 16kk .. 16kk + 15, both 64-column panels
            const uint32_t vaddr = v_st + kk * 16 * 128;
            wgmma_pv<T>(o, pa[kk], sw128_desc(vaddr, kVPanel, kV8Rows));
        }
        wgmma_commit();
        wgmma_wait_all();  // V's stage is refilled after the next barrier
        fence_accumulators(o);
    }
    cp_async_wait<0>();

    if (slot < sp.nslots) store_rows<T, D>(o, st, p, qw, sp.head0 + slot, row0);
#else
    __trap();  // only sm_90a code exists; the launcher never selects it elsewhere
#endif
}

}  // namespace astrai::attn
