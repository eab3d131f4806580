// Warp-specialized Hopper prefill (sm_90a), split over Q, for head dims 64, 128 and 256.
//
// A block of three warpgroups owns 128 (row, head) pairs of one kv-head group, packed as in
// the 8-warp mma.sync block (HB >= 2 query heads share each K/V tile), or with
// ASTRAI_PREFILL_WS_MHA 128 rows of one head (HB = 1):
//   warpgroup 0 (producer)   setmaxnreg.dec; loads Q once (cp.async), then streams K and V
//                            tiles through two rings of kStages stages, each tile completing
//                            on the stage's "full" mbarrier: by TMA where the K/V tensor maps
//                            encode (contiguous K/V: one thread, a box per 64-column panel;
//                            paged with 8 | page_size: a box per page, lane i of warp 0
//                            loading page i, tiles ending past kv_len by cp.async), else by
//                            cp.async from all 128 threads (any KV source: the contiguous and
//                            the paged policy share this body).
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

#include <type_traits>

#include "astrai/sm90.cuh"
#include "capabilities.h"
#include "prefill_tensor_maps.h"
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

// Tuning knobs, fixed at build time; ci/gpu-tune-prefill builds and times the variants. The
// measurements behind each default, and the variants tried and dropped: docs/kernels/attention.md,
// "Hopper prefill: what was tried".
// 1: the consumer warpgroups take turns issuing their GEMMs (d <= 128 only: PrefillWsConfig)
#ifndef ASTRAI_PREFILL_PINGPONG
#define ASTRAI_PREFILL_PINGPONG 1
#endif
// 1: Q, K/V and O by TMA where their tensor maps encode (launch_prefill_ws_tiles); 0: no maps
// (cp.async copies, chunk stores)
#ifndef ASTRAI_PREFILL_TMA
#define ASTRAI_PREFILL_TMA 1
#endif
// O by TMA stores where a block's box lies inside its request and head group
#ifndef ASTRAI_PREFILL_TMA_STORE
#define ASTRAI_PREFILL_TMA_STORE 1
#endif
// 1: multi-head attention (one query head per K/V head, HB = 1) runs this kernel too, a block
// taking 128 rows of its head (two host Q tiles; tiles_per_block); 0: the mma.sync kernel.
// Groups that leave head slots empty (3, 5, 6, 7) take such blocks too (launch_prefill_ws).
#ifndef ASTRAI_PREFILL_WS_MHA
#define ASTRAI_PREFILL_WS_MHA 1
#endif
// Where a row's softmax base moves only when a tile's max exceeds it by more than 2^8
// (online_softmax_lazy), and tiles where no row of a warp moved skip O's rescale: over paged K/V
// (measured on an H100, three interleaved rounds: +0-6 % at d64, +1-6 % at d128, +5-15 % at
// d256). Dense K/V keeps the rescale every tile: d64 was 1-3 % slower lazily and d128 even; d256
// was 0-10 % faster with 64-row tiles, but dense d256 now takes the wide tiles (kWideTileRows),
// and the two have not been measured together.
template <class KV>
constexpr bool kLazyRescale = KV::kPaged;

#ifdef ASTRAI_PREFILL_TRACE
// Diagnosis builds only: per work item, clock64() at the consumer's phases (thread 128):
// [sm | tiles << 32, item start, Q ready, K_0 ready, tile 0 done, last P V done, stored,
// block entry].
__device__ unsigned long long* g_prefill_trace;
#define PREFILL_TRACE(item, i, value) \
    if (threadIdx.x == 128 && g_prefill_trace) g_prefill_trace[size_t(item) * 8 + (i)] = (value)
#else
#define PREFILL_TRACE(item, i, value)
#endif

// Dense prefill over contiguous K/V takes wide K/V tiles where its copies are all TMA (as
// FlashAttention-3 does): 176 rows at d128 without a causal mask, 80 at d256; the producer keeps
// 40 registers (it issues TMA alone) so the consumers get 232 for the wider S and P. Measured on
// an H100 (three interleaved rounds against 128 / 64 rows): d256 +3-11 %, d128 without a mask
// +2-6 %, the rest even. 0: none (d64).
template <int D>
constexpr int kWideTileRows = D == 128 ? 176 : D == 256 ? 80 : 0;

// BN_ = 0: the default K/V tile rows; else a wide tile (kWideTileRows) and a TMA-only producer.
// V_: the variant type (variant.cuh): PlainAttention, or RuntimeVariant for windows, soft-caps
// and sinks.
template <int D_, int BN_ = 0, class V_ = PlainAttention>
struct PrefillWsConfig {
    static_assert(is_head_dim(D_), "head_dim must be " ASTRAI_ATTN_HEAD_DIMS_TEXT);
    static constexpr int D = D_;
    static constexpr int kRows = 128;                // (row, head) pairs per block
    // K/V rows per tile: S, P and O fit the consumers' registers
    static constexpr int kBN = BN_ != 0 ? BN_ : D <= 128 ? 128 : 64;
    // The plain instantiation keeps none of the variants' registers
    using V = V_;
    static_assert(kBN % 16 == 0 && kBN <= 256, "K/V tiles are whole 16-row k-steps of P V, one TMA box");
    // Copies by TMA alone (the launcher checks that the maps encode): no cp.async paths, so
    // the producer needs few registers
    static constexpr bool kTmaOnly = BN_ != 0;
    static constexpr int kStages = D == 64 ? 3 : 2;
    static constexpr int kThreads = 3 * 128;
    // The block starts with 168 registers a thread (64K / 384, rounded down to 8), and the
    // consumers' setmaxnreg.inc waits until the producer's .dec left that much in the pool:
    // 128 x producer + 256 x consumer <= 384 x 168. Neither role spills (the producer keeps
    // its page ids and copy offsets; d256's O alone takes 128 registers a thread).
    static constexpr int kProducerRegs = kTmaOnly ? 40 : D == 256 ? 72 : 104;
    static constexpr int kConsumerRegs = kTmaOnly ? 232 : D == 256 ? 216 : 200;
    static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "register pool overcommitted");
    static constexpr bool kPingPong = ASTRAI_PREFILL_PINGPONG != 0 && D <= 128;  // measured slower at d256
    static constexpr int kTileBytes = kBN * D * 2;
    static constexpr int kQBytes = kRows * D * 2;
    // full K, full V, empty K, empty V per stage; Q's full and empty
    static constexpr int kBarriers = 4 * kStages + 2;
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
    __device__ uint32_t q_full() const { return bars + 8 * 4 * C::kStages; }
    __device__ uint32_t q_empty() const { return bars + 8 * (4 * C::kStages + 1); }
};

// A value every lane of the warp holds alike, broadcast from lane 0 so that ptxas can prove
// it warp-uniform: addresses and wgmma descriptors derived from it then stay in uniform
// registers (a work item read from shared memory, in a persistent variant since deleted,
// otherwise pushed the descriptor arithmetic of every tile into the vector datapath: +120 %
// R2UR, 2.9k against 2.7k cycles a tile).
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// Where a block is in its K/V rings: `tiles` K/V tiles so far. Use u of a ring slot completes
// its barrier's phase u, of parity u & 1.
struct RingPos {
    int tiles = 0;
};

#if ASTRAI_ATTN_SM90
// kTma (contiguous K/V), from one thread: per tile D / 64 boxes (panels), each stage's full
// barrier expecting the tile's bytes. Rows past kv_len arrive as zeros; rows past a causal
// kv_end are real K/V that the consumers mask.
template <class C>
__device__ __forceinline__ void produce_kv_tma(const PrefillTensorMaps& maps, const QWork& qw, const PrefillSpan& sp,
                                               const PrefillWsSmem<C>& sm, RingPos& pos) {
    using namespace sm90;
    constexpr int kPanels = C::D / 64;
    auto load = [&](const CUtensorMap* map, uint32_t dst, uint32_t bar, int t) {
        mbar_arrive_expect_tx(bar, C::kTileBytes);
#pragma unroll
        for (int c = 0; c < kPanels; ++c)
            tma_load_4d(dst + c * PanelTile<C::kBN>::kPanelBytes, map, bar, c * 64, sp.kvh, (sp.t_begin + t) * C::kBN,
                        qw.b);
    };
    for (int t = 0; t < sp.n_tiles; ++t, ++pos.tiles) {
        const int s = pos.tiles % C::kStages, use = pos.tiles / C::kStages;
        if (use > 0) mbar_wait(sm.empty_k(s), (use - 1) & 1);
        load(&maps.k, sm.k_stage(s), sm.full_k(s), t);
        if (use > 0) mbar_wait(sm.empty_v(s), (use - 1) & 1);
        load(&maps.v, sm.v_stage(s), sm.full_v(s), t);
    }
}

// kTmaWholeTiles (paged K/V), from warp 0: lane i loads page box i of a tile (box_rows slots
// of one page, landing at row i * box_rows: whole 8-row swizzle atoms), for the boxes that
// hold a position below kv_len, and lane 0 arms the stage's full barrier with their bytes.
// A tile whose pages have consecutive ids (maps.run_maps) is one box per panel from lane 0.
// Slots past kv_len (stale, possibly NaN; or left from an earlier tile) are masked in S and
// zeroed in V by the consumers (zero_stale_v).
template <class C, class KV>
__device__ __forceinline__ void produce_kv_paged_tma(const AttentionParams& p, const PrefillTensorMaps& maps,
                                                     const QWork& qw, const PrefillSpan& sp,
                                                     const PrefillWsSmem<C>& sm, RingPos& pos) {
    using namespace sm90;
    constexpr int kPanels = C::D / 64;
    const int lane = threadIdx.x;
    const typename KV::Request req = KV::request(p, qw.b);
    const int box_bytes = maps.box_rows * 128;
    auto stage_tile = [&](int boxes, int page, int slot, const CUtensorMap* map, const CUtensorMap* run_map,
                          bool run, uint32_t dst, uint32_t bar) {
        if (run) {
            if (lane == 0) {
                mbar_arrive_expect_tx(bar, C::kTileBytes);
#pragma unroll
                for (int c = 0; c < kPanels; ++c)
                    tma_load_4d(dst + c * PanelTile<C::kBN>::kPanelBytes, run_map, bar, c * 64, sp.kvh,
                                page * p.page_size, 0);
            }
            __syncwarp();
            return;
        }
        if (lane == 0) mbar_arrive_expect_tx(bar, boxes * box_bytes * kPanels);
        __syncwarp();  // the byte count is armed before any box completes
        if (lane < boxes) {
#pragma unroll
            for (int c = 0; c < kPanels; ++c)
                tma_load_4d(dst + c * PanelTile<C::kBN>::kPanelBytes + lane * box_bytes, map, bar, c * 64, sp.kvh,
                            slot, page);
        }
    };
    for (int t = 0; t < sp.n_tiles; ++t, ++pos.tiles) {
        const int s = pos.tiles % C::kStages, use = pos.tiles / C::kStages;
        const int tile0 = (sp.t_begin + t) * C::kBN;
        const int rows = min(C::kBN, sp.kv_len - tile0);
        const int boxes = (rows + maps.box_rows - 1) / maps.box_rows;
        int page = 0, slot = 0;
        if (lane < boxes) {
            const int first = tile0 + lane * maps.box_rows, page_index = KV::page_of(req, first);
            page = __ldg(req.pages + page_index);
            slot = first - page_index * p.page_size;
        }
        // lane 0's page starts the run (a tile starts on a page boundary: slot 0)
        const int first_page = __shfl_sync(0xffffffffu, page, 0);
        const bool run = maps.run_maps && __ballot_sync(0xffffffffu, lane < boxes && page != first_page + lane) == 0;
        if (use > 0) mbar_wait(sm.empty_k(s), (use - 1) & 1);
        stage_tile(boxes, run ? first_page : page, slot, &maps.k, &maps.k_run, run, sm.k_stage(s), sm.full_k(s));
        if (use > 0) mbar_wait(sm.empty_v(s), (use - 1) & 1);
        stage_tile(boxes, run ? first_page : page, slot, &maps.v, &maps.v_run, run, sm.v_stage(s), sm.full_v(s));
    }
}

// The K/V tiles of one work item into their ring stages, each once the consumers released
// the stage's previous use: by TMA per maps.mode, else cp.async from all 128 threads (never
// in a C::kTmaOnly launch, whose maps are kTma).
template <typename T, class C, class KV>
__device__ __forceinline__ void produce_kv(const AttentionParams& p, const PrefillTensorMaps& maps, const QWork& qw,
                                           const PrefillSpan& sp, const PrefillWsSmem<C>& sm, RingPos& pos) {
    using sm90::mbar_arrive_on_cp_async;
    using sm90::mbar_wait;
    if (C::kTmaOnly || maps.mode == PrefillTensorMaps::kTma) {
        if (threadIdx.x == 0) produce_kv_tma<C>(maps, qw, sp, sm, pos);
        return;
    }
    if constexpr (KV::kPaged) {
        if (maps.mode == PrefillTensorMaps::kTmaWholeTiles) {
            if (threadIdx.x < 32) produce_kv_paged_tma<C, KV>(p, maps, qw, sp, sm, pos);
            return;
        }
    }
    KvTileLoader<T, KV, PanelTile<C::kBN>, C::D, C::kBN, 128> kv(p, qw, sp);
    if (sp.n_tiles > 0) kv.fetch(0);
    for (int t = 0; t < sp.n_tiles; ++t, ++pos.tiles) {
        const int s = pos.tiles % C::kStages, use = pos.tiles / C::kStages;
        if (use > 0) mbar_wait(sm.empty_k(s), (use - 1) & 1);
        kv.load_k(t, sm.k_stage(s));
        mbar_arrive_on_cp_async(sm.full_k(s));
        if (use > 0) mbar_wait(sm.empty_v(s), (use - 1) & 1);
        kv.load_v(t, sm.v_stage(s));
        mbar_arrive_on_cp_async(sm.full_v(s));
        if (t + 1 < sp.n_tiles) kv.fetch(t + 1);
    }
}

// Where a block's rows start in the Q / O tensor maps: (row, outer) coordinates.
template <class QSched>
__device__ __forceinline__ int2 map_rows(const AttentionParams& p, const QWork& qw) {
    return QSched::kPacked ? make_int2(qw.row_base + __ldg(p.qo_indptr + qw.b), 0) : make_int2(qw.row_base, qw.b);
}

// The block's Q tile into its slot, completing its full barrier: by TMA from thread 0 (D / 64
// boxes of head_block heads x rows_blk rows, the barrier expecting the tile's bytes), else
// by cp.async from all 128 producer threads (never in a C::kTmaOnly launch).
template <typename T, class C, class QSched>
__device__ __forceinline__ void produce_q(const AttentionParams& p, const PrefillTensorMaps& maps, const QWork& qw,
                                          const PrefillSpan& sp, const PrefillWsSmem<C>& sm) {
    using namespace sm90;
    if (!C::kTmaOnly && !maps.q_tma) {
        load_q_rows<T, PanelTile<C::kRows>, C::D, C::kRows, 128>(p, qw, sp, sm.q);
        mbar_arrive_on_cp_async(sm.q_full());
        return;
    }
    if (threadIdx.x != 0) return;
    const int2 at = map_rows<QSched>(p, qw);
    mbar_arrive_expect_tx(sm.q_full(), C::kQBytes);
#pragma unroll
    for (int c = 0; c < C::D / 64; ++c)
        tma_load_4d(sm.q + c * PanelTile<C::kRows>::kPanelBytes, &maps.q, sm.q_full(), c * 64, at.x, sp.head0, at.y);
}

// Warpgroup 0: Q, then the K/V tiles.
template <typename T, class C, class QSched, class KV>
__device__ __forceinline__ void prefill_ws_produce(const AttentionParams& p, const PrefillTensorMaps& maps,
                                                   const QWork& qw, const PrefillSpan& sp, const PrefillWsSmem<C>& sm,
                                                   RingPos& pos) {
    produce_q<T, C, QSched>(p, maps, qw, sp, sm);
    produce_kv<T, C, KV>(p, maps, qw, sp, sm, pos);
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
// Zeroes V rows [rows, kBN) of a tile staged by whole page boxes (kTmaWholeTiles): slots past
// the request's kv_len hold stale data, possibly NaN, and 0 x NaN would poison P V. Each
// consumer warpgroup zeroes them itself before its P V (the other's identical stores race
// harmlessly) and orders them before its wgmma reads.
template <class C>
__device__ __forceinline__ void zero_stale_v(uint32_t v_st, int rows, int wg) {
    constexpr int kChunks = C::D / 8;
    const int tid = threadIdx.x % 128;
    for (int i = tid; i < (C::kBN - rows) * kChunks; i += 128) {
        const uint32_t dst = v_st + PanelTile<C::kBN>::offset(rows + i / kChunks, i % kChunks);
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(dst), "r"(0) : "memory");
    }
    sm90::fence_proxy_async();
    sm90::named_barrier_sync(4 + wg, 128);
}

// This warpgroup's 64 rows of O, normalized, through its rows of the Q slot (no longer read)
// to global memory: by TMA where the warpgroup's box (o_store_box: half the head slots, or
// with one head half the rows) lies inside its request and head group (one thread issues a
// box per panel), else in whole 16-byte chunks (8 threads per 128-byte line). The slot keeps
// the 128-byte swizzle, so neither the fragment writes nor the chunk reads conflict in shared
// memory. Why: the chunk loop's address arithmetic made the
// epilogue ~1.2 tiles of time per work item (3.2k cycles at d128), most of a short item's cost.
template <typename T, class C, class QSched>
__device__ __forceinline__ void store_rows_staged(const float (&o)[C::D / 8][4], RowState& st,
                                                  const AttentionParams& p, const PrefillTensorMaps& maps,
                                                  const QWork& qw, const PrefillSpan& sp, uint32_t q_slot, int wg) {
    using Tile = PanelTile<C::kRows>;
    constexpr int kChunks = C::D / 8;
    const int lane = threadIdx.x % 32, cw = threadIdx.x / 32 - 4, tid = threadIdx.x % 128;
    float inv_l[2];
    finalize_rows(st, inv_l);
    C::V::finish_rows(p, [&] { return min(sp.head0 + cw / (8 / p.head_block), p.q_heads - 1); }, st, inv_l);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * cw + (lane >> 2) + 8 * h;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
            const uint32_t v = Elem<T>::pack2(o[j][2 * h] * inv_l[h], o[j][2 * h + 1] * inv_l[h]);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(q_slot + Tile::offset(r, j) + 4 * (lane & 3)), "r"(v)
                         : "memory");
        }
    }
    const OStoreBox box = o_store_box(p, qw, sp, wg);
    const bool by_tma = maps.o_tma && box.inside;
    if (by_tma) sm90::fence_proxy_async();  // the fragments, before the TMA reads them
    sm90::named_barrier_sync(4 + wg, 128);
    if (by_tma) {
        if (tid == 0) {
            const int2 at = map_rows<QSched>(p, qw);
#pragma unroll
            for (int c = 0; c < C::D / 64; ++c)
                sm90::tma_store_4d(&maps.o, q_slot + c * Tile::kPanelBytes + wg * 64 * 128, c * 64, at.x + box.row_off,
                                   box.head, at.y);
            sm90::tma_store_commit_and_wait_read();
        }
        return;
    }
    // Rows r = 64 wg + tid / kChunks + k * kRowsPerPass; (slot, row) advance without dividing.
    constexpr int kRowsPerPass = 128 / kChunks;
    const int c = tid % kChunks;
    int r = 64 * wg + tid / kChunks;
    int slot = r / sp.rows_blk, row = r % sp.rows_blk;
    T* out = static_cast<T*>(p.o) + qw.o_off + c * 8;
#pragma unroll 1
    for (int k = 0; k < 64 / kRowsPerPass; ++k, r += kRowsPerPass) {
        if (slot < sp.nslots && qw.row_base + row < qw.q_len) {
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(q_slot + Tile::offset(r, c)));
            *reinterpret_cast<uint4*>(out + int64_t(qw.row_base + row) * p.o_stride_l +
                                      int64_t(sp.head0 + slot) * p.o_stride_h) = v;
        }
        for (row += kRowsPerPass; row >= sp.rows_blk; row -= sp.rows_blk) ++slot;
    }
}

// The consumer's stages over one work item's K/V tiles (prefill_ws_consume): stage(t) and
// parity(t) give tile t's ring slot and the parity of its use, my_turn / your_turn the
// ping-pong between the warpgroups, softmax_tile(t, alpha) masks S_t and runs the online
// softmax (true: O needs the rescale by alpha).

// Tile 0: S_0 alone, its softmax, P_0 packed.
template <typename T, class C, class Stage, class Parity, class MyTurn, class YourTurn, class Softmax>
__device__ __forceinline__ void consume_first_tile(const PrefillWsSmem<C>& sm, uint32_t q_wg, Stage&& stage,
                                                   Parity&& parity, MyTurn&& my_turn, YourTurn&& your_turn,
                                                   Softmax&& softmax_tile, float (&s)[C::kBN / 8][4],
                                                   uint32_t (&pa)[C::kBN / 16][4], float (&alpha)[2], int item) {
    using namespace sm90;
    mbar_wait(sm.full_k(stage(0)), parity(0));
    PREFILL_TRACE(item, 3, clock64());
    fence_proxy_async();
    my_turn();
    wgmma_fence();
    issue_qk<T, C>(s, q_wg, sm.k_stage(stage(0)));
    wgmma_commit();
    your_turn();
    wgmma_wait<0>();
    fence_accumulators(s);
    mbar_arrive(sm.empty_k(stage(0)));
    softmax_tile(0, alpha);
    pack_probs<T>(s, pa);
    PREFILL_TRACE(item, 4, clock64());
}

// Tile t >= 1: S_t = Q K_t^T and O += P_{t-1} V_{t-1} issued together, the softmax of S_t
// while P V runs, then O's rescale and P_t packed.
template <typename T, class C, class Stage, class Parity, class MyTurn, class YourTurn, class Softmax>
__device__ __forceinline__ void consume_tile(const PrefillWsSmem<C>& sm, uint32_t q_wg, int t, Stage&& stage,
                                             Parity&& parity, MyTurn&& my_turn, YourTurn&& your_turn,
                                             Softmax&& softmax_tile, float (&s)[C::kBN / 8][4],
                                             float (&o)[C::D / 8][4], uint32_t (&pa)[C::kBN / 16][4],
                                             float (&alpha)[2]) {
    using namespace sm90;
    const int sk = stage(t), sv = stage(t - 1);
    // Both waits before the issue: a branch between the two GEMMs' issue makes
    // ptxas insert a warpgroup.arrive ahead of P V. V_{t-1} has had a whole tile.
    mbar_wait(sm.full_k(sk), parity(t));
    mbar_wait(sm.full_v(sv), parity(t - 1));
    fence_proxy_async();
    my_turn();
    fence_accumulators(o);
    fence_fragments(pa);
    wgmma_fence();
    issue_qk<T, C>(s, q_wg, sm.k_stage(sk));
    wgmma_commit();
    issue_pv<T, C>(o, pa, sm.v_stage(sv));
    wgmma_commit();
    your_turn();
    wgmma_wait<1>();  // S_t is ready; P V still runs
    fence_accumulators(s);
    mbar_arrive(sm.empty_k(sk));
    const bool rescale = softmax_tile(t, alpha);
    wgmma_wait<0>();
    fence_accumulators(o);
    mbar_arrive(sm.empty_v(sv));
    if (rescale) rescale_rows(o, alpha);
    pack_probs<T>(s, pa);
}

// The last P V (tile n - 1), its stale V rows zeroed first where whole page boxes staged it.
template <typename T, class C, class Stage, class Parity, class MyTurn, class YourTurn>
__device__ __forceinline__ void consume_last_pv(const PrefillWsSmem<C>& sm, const PrefillSpan& sp, int n, int wg,
                                                bool stale_tail, Stage&& stage, Parity&& parity, MyTurn&& my_turn,
                                                YourTurn&& your_turn, float (&o)[C::D / 8][4],
                                                uint32_t (&pa)[C::kBN / 16][4], int item) {
    using namespace sm90;
    const int sv = stage(n - 1);
    mbar_wait(sm.full_v(sv), parity(n - 1));
    fence_proxy_async();
    const int last0 = (sp.t_begin + n - 1) * C::kBN;  // the last tile's first position
    if (stale_tail && last0 + C::kBN > sp.kv_len) zero_stale_v<C>(sm.v_stage(sv), sp.kv_len - last0, wg);
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
    PREFILL_TRACE(item, 5, clock64());
}

// Warpgroups 1 and 2 over one work item: Q's wait, the K/V tiles (consume_first_tile,
// consume_tile, consume_last_pv), then O's store and Q's slot released.
template <typename T, class C, class QSched, class KV>
__device__ __forceinline__ void prefill_ws_consume(const AttentionParams& p, const PrefillTensorMaps& maps,
                                                   const QWork& qw, const PrefillSpan& sp,
                                                   const PrefillWsSmem<C>& sm, RingPos& pos, bool stale_tail,
                                                   int item = 0) {
    using namespace sm90;
    constexpr int NT = C::kBN / 8;
    const int cw = threadIdx.x / 32 - 4;  // consumer warp 0..7: block rows 16 cw .. 16 cw + 15
    const int wg = cw / 4;
    const int lane = threadIdx.x % 32;
    const int wph = 8 / p.head_block;  // warps per head slot
    const int slot = cw / wph;
    const int row0 = qw.row_base + (cw % wph) * 16 + (lane >> 2);  // rows row0, row0 + 8
    const uint8_t* mask = p.mask ? p.mask + int64_t(qw.b) * p.mask_stride_b : nullptr;
    // ALiBi: a key step's bias of the warp's query head, in raw units
    float alibi[2] = {0.f, 0.f};
    if (C::V::alibi(p) && slot < sp.nslots) alibi[0] = alibi[1] = alibi_step(p, sp.head0 + slot, C::V::raw_unit(p));
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

    const int n = warp_uniform(sp.n_tiles);  // from a loaded length (paged, packed Q)
    PREFILL_TRACE(item, 1, clock64());
    mbar_wait(sm.q_full(), 0);
    PREFILL_TRACE(item, 2, clock64());
    if (n > 0) {
        if (wg == 1) your_turn();  // warpgroup 0 issues first
        float s[NT][4];
        // Whether O needs the rescale by alpha (always, unless kLazyRescale).
        auto softmax_rows = [&](float (&alpha)[2]) {
            if constexpr (kLazyRescale<KV>) return online_softmax_lazy<NT>(st, s, p.scale_log2, alpha);
            online_softmax<NT>(st, s, p.scale_log2, alpha);
            return true;
        };
        auto softmax_tile = [&](int t, float (&alpha)[2]) {
            const int col0 = (sp.t_begin + t) * C::kBN;
            if (C::V::alibi(p)) C::V::bias(s, alibi, col0 + 2 * (lane & 3), {row0 + sp.diag, row0 + 8 + sp.diag});
            C::V::logits(s, p);
            if (tile_needs_mask<C::kBN, typename C::V>(p, qw, sp, col0, mask))
                mask_scores<typename C::V>(s, p, qw, sp, col0, row0, mask);
            return softmax_rows(alpha);
        };
        // Ring position of tile t of this item: stage, and the parity of its use.
        auto stage = [&](int t) { return (pos.tiles + t) % C::kStages; };
        auto parity = [&](int t) { return uint32_t((pos.tiles + t) / C::kStages) & 1; };
        float alpha[2];
        consume_first_tile<T, C>(sm, q_wg, stage, parity, my_turn, your_turn, softmax_tile, s, pa, alpha, item);
        for (int t = 1; t < n; ++t)
            consume_tile<T, C>(sm, q_wg, t, stage, parity, my_turn, your_turn, softmax_tile, s, o, pa, alpha);
        consume_last_pv<T, C>(sm, sp, n, wg, stale_tail, stage, parity, my_turn, your_turn, o, pa, item);
        pos.tiles += n;
    }
    // O leaves through the Q slot where every row start is 16-byte aligned.
    const bool aligned = reinterpret_cast<uintptr_t>(p.o) % 16 == 0 && (qw.o_off | p.o_stride_l | p.o_stride_h) % 8 == 0;
    if (aligned) {
        store_rows_staged<T, C, QSched>(o, st, p, maps, qw, sp, sm.q, wg);
    } else if (slot < sp.nslots) {
        store_rows<T, C::D, typename C::V>(o, st, p, qw, sp.head0 + slot, row0);
    }
    // Q's slot released: nothing waits on it since the persistent producer went, but the arrival
    // stays (without it the default build's SASS changes; not measured).
    mbar_arrive(sm.q_empty());
#ifdef ASTRAI_PREFILL_TRACE
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    PREFILL_TRACE(item, 0, smid | (uint64_t(n) << 32));
    PREFILL_TRACE(item, 6, clock64());
#endif
}
#endif

// One block per work item (launch coordinate).
template <typename T, int D, class QSched, class KV, int BN = 0, class V = PlainAttention>
__global__ void __launch_bounds__(PrefillWsConfig<D, BN, V>::kThreads, 1)
    prefill_ws_kernel(const AttentionParams p, const __grid_constant__ PrefillTensorMaps maps) {
#if ASTRAI_ATTN_SM90
    using C = PrefillWsConfig<D, BN, V>;
    extern __shared__ __align__(128) uint8_t smem[];
    const PrefillWsSmem<C> sm(smem_u32(smem));
    if (threadIdx.x == 0) {
        for (int s = 0; s < C::kStages; ++s) {
            // one arrival per producer thread (cp.async), or the TMA thread's alone
            const uint32_t producers = maps.mode == PrefillTensorMaps::kCpAsync ? 128 : 1;
            sm90::mbar_init(sm.full_k(s), producers);
            sm90::mbar_init(sm.full_v(s), producers);
            sm90::mbar_init(sm.empty_k(s), 256);  // every consumer thread releases
            sm90::mbar_init(sm.empty_v(s), 256);
        }
        // Q arrivals: thread 0's (TMA) or the 128 producer threads' copies (cp.async)
        sm90::mbar_init(sm.q_full(), maps.q_tma ? 1 : 128);
        sm90::mbar_init(sm.q_empty(), 256);
        sm90::mbar_init_fence();
    }
#ifdef ASTRAI_PREFILL_TRACE
    const long long entry = clock64();
#endif
    __syncthreads();
    // The work item is read after setmaxnreg (no value lives across it: each role gets its
    // register file anew).
    RingPos pos;
    if (threadIdx.x < 128) {
        sm90::setmaxnreg_dec<C::kProducerRegs>();
        const BlockCoord c = BlockCoord::of_launch();
        const QWork qw = QSched::get(p, c);
        if (qw.row_base < qw.q_len)  // the same items are skipped by every role
            prefill_ws_produce<T, C, QSched, KV>(p, maps, qw, prefill_span<KV, V>(p, qw, C::kBN, c.y), sm, pos);
        cp_async_wait<0>();  // nothing in flight when the thread exits
    } else {
        sm90::setmaxnreg_inc<C::kConsumerRegs>();
        const BlockCoord c = BlockCoord::of_launch();
        const QWork qw = QSched::get(p, c);
        if (qw.row_base >= qw.q_len) return;
        const int item = int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
        PREFILL_TRACE(item, 7, entry);
        prefill_ws_consume<T, C, QSched, KV>(p, maps, qw, prefill_span<KV, V>(p, qw, C::kBN, c.y), sm, pos,
                                             maps.mode == PrefillTensorMaps::kTmaWholeTiles, item);
    }
#else
    __trap();  // only sm_90a code exists; the launcher never selects it elsewhere
#endif
}

}  // namespace astrai::attn
