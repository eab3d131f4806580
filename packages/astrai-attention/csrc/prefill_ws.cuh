// Warp-specialized Hopper prefill (sm_90a), split over Q, for head dims 64, 128 and 256.
//
// A block of three warpgroups owns 128 (row, head) pairs of one kv-head group, packed as in
// the 8-warp mma.sync block (HB >= 2 query heads share each K/V tile):
//   warpgroup 0 (producer)   setmaxnreg.dec; loads Q once, then streams K and V tiles through
//                            two rings of kStages stages with cp.async (any KV source: the
//                            contiguous and the paged policy share this body), each copy
//                            batch completing on the stage's "full" mbarrier.
//   warpgroups 1, 2          setmaxnreg.inc; 64 rows each. Per K/V tile t:
//     (consumers)              S_t = Q K_t^T          wgmma SS, issued
//                              O  += P_{t-1} V_{t-1}  wgmma RS, issued right behind it
//                              wait S_t; release K_t; mask + online softmax of S_t while
//                              P V runs on the tensor cores; wait P V; release V_{t-1};
//                              rescale O, pack P_t.
// With kPingPong the two consumer warpgroups also take turns issuing their GEMMs (named
// barriers), so one's softmax overlaps the other's MMAs.
// Tiles are 64-element panels of 128-byte rows with the 128-byte swizzle the wgmma
// descriptors describe (PanelTile).
#pragma once

#include "astrai/sm90.cuh"
#include "prefill_parts.cuh"
#include "wgmma_ops.cuh"
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

template <int D_>
struct PrefillWsConfig {
    static_assert(D_ == 64 || D_ == 128 || D_ == 256, "head_dim must be 64, 128 or 256");
    static constexpr int D = D_;
    static constexpr int kRows = 128;                // (row, head) pairs per block
    static constexpr int kBN = D <= 128 ? 128 : 64;  // K/V rows per tile: S and O fit the registers
    static constexpr int kStages = D == 64 ? 3 : 2;
    static constexpr int kThreads = 3 * 128;
    // The block starts with 168 registers a thread (64K / 384, rounded down to 8), and the
    // consumers' setmaxnreg.inc waits until the producer's .dec left that much in the pool:
    // 128 x producer + 256 x consumer <= 384 x 168. Neither role spills (the producer keeps
    // its page ids and copy offsets; d256's O alone takes 128 registers a thread).
    static constexpr int kProducerRegs = D == 256 ? 64 : 96;
    static constexpr int kConsumerRegs = D == 256 ? 216 : 200;
    static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "register pool overcommitted");
    static constexpr bool kPingPong = false;
    static constexpr int kTileBytes = kBN * D * 2;
    static constexpr int kQBytes = kRows * D * 2;
    // full K, full V, empty K, empty V per stage, and Q's
    static constexpr int kBarriers = 4 * kStages + 1;
    static constexpr int kSmemBytes = 1024 + 2 * kStages * kTileBytes + kQBytes + 8 * kBarriers;
    static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 limit");
};

// Shared-memory map: K ring, V ring, Q, then the barriers.
template <class C>
struct PrefillWsSmem {
    uint32_t k, v, q, bars;
    __device__ explicit PrefillWsSmem(uint32_t base) {
        k = (base + 1023u) & ~1023u;
        v = k + C::kStages * C::kTileBytes;
        q = v + C::kStages * C::kTileBytes;
        bars = q + C::kQBytes;
    }
    __device__ uint32_t k_stage(int s) const { return k + s * C::kTileBytes; }
    __device__ uint32_t v_stage(int s) const { return v + s * C::kTileBytes; }
    __device__ uint32_t full_k(int s) const { return bars + 8 * s; }
    __device__ uint32_t full_v(int s) const { return bars + 8 * (C::kStages + s); }
    __device__ uint32_t empty_k(int s) const { return bars + 8 * (2 * C::kStages + s); }
    __device__ uint32_t empty_v(int s) const { return bars + 8 * (3 * C::kStages + s); }
    __device__ uint32_t q_full() const { return bars + 8 * (4 * C::kStages); }
};

#if ASTRAI_ATTN_SM90
// Warpgroup 0: Q, then K_t / V_t into stage t % kStages once the consumers released it.
template <typename T, class C, class KV>
__device__ __forceinline__ void prefill_ws_produce(const AttentionParams& p, const QWork& qw, const PrefillSpan& sp,
                                                   const PrefillWsSmem<C>& sm) {
    using sm90::mbar_arrive_on_cp_async;
    using sm90::mbar_wait;
    load_q_rows<T, PanelTile<C::kRows>, C::D, C::kRows, 128>(p, qw, sp, sm.q);
    mbar_arrive_on_cp_async(sm.q_full());
    KvTileLoader<T, KV, PanelTile<C::kBN>, C::D, C::kBN, 128> kv(p, qw, sp);
    if (sp.n_tiles > 0) kv.fetch(0);
    for (int t = 0; t < sp.n_tiles; ++t) {
        const int s = t % C::kStages;
        const uint32_t released = (t / C::kStages - 1) & 1;  // parity of the release of tile t - kStages
        if (t >= C::kStages) mbar_wait(sm.empty_k(s), released);
        kv.load_k(t, sm.k_stage(s));
        mbar_arrive_on_cp_async(sm.full_k(s));
        if (t >= C::kStages) mbar_wait(sm.empty_v(s), released);
        kv.load_v(t, sm.v_stage(s));
        mbar_arrive_on_cp_async(sm.full_v(s));
        if (t + 1 < sp.n_tiles) kv.fetch(t + 1);
    }
    cp_async_wait<0>();  // nothing in flight when the thread exits
}

// S = Q K^T for this warpgroup's 64 rows: D / 16 k-steps over the Q and K panels.
template <typename T, class C>
__device__ __forceinline__ void issue_qk(float (&s)[C::kBN / 8][4], uint32_t q_wg, uint32_t k_st) {
    // Rebuilt per tile: hoisted out of the tile loop, Q's D / 16 descriptors would hold
    // D / 8 registers for the whole loop.
    asm volatile("" : "+r"(q_wg));
#pragma unroll
    for (int ks = 0; ks < C::D / 16; ++ks) {
        const uint32_t koff = (ks % 4) * 32;  // 32 bytes along the 128-byte rows per k-step
        const uint64_t da = sw128_desc(q_wg + (ks / 4) * PanelTile<C::kRows>::kPanelBytes + koff, 16, 1024);
        const uint64_t db = sw128_desc(k_st + (ks / 4) * PanelTile<C::kBN>::kPanelBytes + koff, 16, 1024);
        WgmmaSS<T, C::kBN>::mma(s, da, db, ks > 0);
    }
}

// O += P V: kBN / 16 k-steps over V rows, every 64-column panel of V in each.
template <typename T, class C>
__device__ __forceinline__ void issue_pv(float (&o)[C::D / 8][4], const uint32_t (&pa)[C::kBN / 16][4],
                                         uint32_t v_st) {
#pragma unroll
    for (int kk = 0; kk < C::kBN / 16; ++kk)
        WgmmaRS<T, C::D>::mma(o, pa[kk], sw128_desc(v_st + kk * 16 * 128, PanelTile<C::kBN>::kPanelBytes, 8 * 128));
}

// Warpgroups 1 and 2.
template <typename T, class C, class KV>
__device__ __forceinline__ void prefill_ws_consume(const AttentionParams& p, const QWork& qw, const PrefillSpan& sp,
                                                   const PrefillWsSmem<C>& sm) {
    using namespace sm90;
    constexpr int NT = C::kBN / 8;
    const int cw = threadIdx.x / 32 - 4;  // consumer warp 0..7: block rows 16 cw .. 16 cw + 15
    const int wg = cw / 4;
    const int lane = threadIdx.x % 32;
    const int wph = 8 / p.head_block;  // warps per head slot
    const int slot = cw / wph;
    const int row0 = qw.row_base + (cw % wph) * 16 + (lane >> 2);  // rows row0, row0 + 8
    const uint8_t* mask = p.mask ? p.mask + int64_t(qw.b) * p.mask_stride_b : nullptr;
    const uint32_t q_wg = sm.q + wg * 64 * 128;
    // Ping-pong: warpgroup g issues after barrier 1 + g, then lets the other one go.
    auto my_turn = [&] {
        if constexpr (C::kPingPong) named_barrier_sync(1 + wg, 256);
    };
    auto your_turn = [&] {
        if constexpr (C::kPingPong) named_barrier_arrive(2 - wg, 256);
    };

    float o[C::D / 8][4];
#pragma unroll
    for (int j = 0; j < C::D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    RowState st;
    uint32_t pa[NT / 2][4];

    const int n = sp.n_tiles;
    if (n > 0) {
        if (wg == 1) your_turn();  // warpgroup 0 issues first
        mbar_wait(sm.q_full(), 0);
        float s[NT][4];
        auto softmax_tile = [&](int t, float (&alpha)[2]) {
            const int col0 = t * C::kBN;
            if (tile_needs_mask<C::kBN>(p, qw, sp, col0, mask)) mask_scores(s, p, qw, sp, col0, row0, mask);
            online_softmax<NT>(st, s, p.scale_log2, alpha);
        };
        // Tile 0: S_0 alone.
        mbar_wait(sm.full_k(0), 0);
        fence_proxy_async();
        my_turn();
        wgmma_fence();
        issue_qk<T, C>(s, q_wg, sm.k_stage(0));
        wgmma_commit();
        your_turn();
        wgmma_wait<0>();
        fence_accumulators(s);
        mbar_arrive(sm.empty_k(0));
        float alpha[2];
        softmax_tile(0, alpha);
        pack_probs<T>(s, pa);

        for (int t = 1; t < n; ++t) {
            const int sk = t % C::kStages, sv = (t - 1) % C::kStages;
            mbar_wait(sm.full_k(sk), (t / C::kStages) & 1);
            fence_proxy_async();
            my_turn();
            fence_accumulators(o);
            fence_fragments(pa);
            wgmma_fence();
            issue_qk<T, C>(s, q_wg, sm.k_stage(sk));
            wgmma_commit();
            mbar_wait(sm.full_v(sv), ((t - 1) / C::kStages) & 1);
            fence_proxy_async();
            issue_pv<T, C>(o, pa, sm.v_stage(sv));
            wgmma_commit();
            your_turn();
            wgmma_wait<1>();  // S_t is ready; P V still runs
            fence_accumulators(s);
            mbar_arrive(sm.empty_k(sk));
            softmax_tile(t, alpha);
            wgmma_wait<0>();
            fence_accumulators(o);
            mbar_arrive(sm.empty_v(sv));
            rescale_rows(o, alpha);
            pack_probs<T>(s, pa);
        }
        // The last P V.
        const int sv = (n - 1) % C::kStages;
        mbar_wait(sm.full_v(sv), ((n - 1) / C::kStages) & 1);
        fence_proxy_async();
        my_turn();
        fence_accumulators(o);
        fence_fragments(pa);
        wgmma_fence();
        issue_pv<T, C>(o, pa, sm.v_stage(sv));
        wgmma_commit();
        if (wg == 0) your_turn();  // warpgroup 1's last turn is never awaited
        wgmma_wait<0>();
        fence_accumulators(o);
        mbar_arrive(sm.empty_v(sv));
    }
    if (slot < sp.nslots) store_rows<T, C::D>(o, st, p, qw, sp.head0 + slot, row0);
}
#endif

template <typename T, int D, class QSched, class KV>
__global__ void __launch_bounds__(PrefillWsConfig<D>::kThreads, 1) prefill_ws_kernel(const AttentionParams p) {
#if ASTRAI_ATTN_SM90
    using C = PrefillWsConfig<D>;
    extern __shared__ __align__(128) uint8_t smem[];
    const PrefillWsSmem<C> sm(smem_u32(smem));
    const QWork qw = QSched::get(p);
    if (qw.row_base >= qw.q_len) return;  // uniform per block
    const PrefillSpan sp = prefill_span<KV>(p, qw, C::kBN);
    if (threadIdx.x == 0) {
        for (int s = 0; s < C::kStages; ++s) {
            sm90::mbar_init(sm.full_k(s), 128);  // one cp.async arrival per producer thread
            sm90::mbar_init(sm.full_v(s), 128);
            sm90::mbar_init(sm.empty_k(s), 256);  // every consumer thread releases
            sm90::mbar_init(sm.empty_v(s), 256);
        }
        sm90::mbar_init(sm.q_full(), 128);
        sm90::mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        sm90::setmaxnreg_dec<C::kProducerRegs>();
        prefill_ws_produce<T, C, KV>(p, qw, sp, sm);
    } else {
        sm90::setmaxnreg_inc<C::kConsumerRegs>();
        prefill_ws_consume<T, C, KV>(p, qw, sp, sm);
    }
#else
    __trap();  // only sm_90a code exists; the launcher never selects it elsewhere
#endif
}

}  // namespace astrai::attn
