// The pieces every prefill kernel body shares, whatever issues its MMAs (mma.sync or wgmma):
// the block's share of heads and K/V, the Q and K/V copies into shared memory, the mask and
// the normalized output store. Tiles are addressed through a Tile policy (offset(row, chunk)
// of a 16-byte chunk), so each kernel keeps the shared-memory layout its MMAs read.
#pragma once

#include "common.h"
#include "layout_policies.cuh"
#include "mma_utils.cuh"
#include "variant.cuh"

namespace astrai::attn {

// The block's PrefillSpan: its head slots and rows (prefill_heads), and its K/V range (tiles
// wholly left of the first row's window skipped, where the variant V has windows).
template <class KV, class V>
__device__ __forceinline__ PrefillSpan prefill_span(const AttentionParams& p, const QWork& qw, int bn,
                                                    int head_group_index = blockIdx.y) {
    PrefillSpan s = prefill_heads(p, head_group_index);
    s.kv_len = KV::kv_len(p, qw.b);
    s.diag = s.kv_len - qw.q_len;
    const int row_last = min(qw.row_base + s.rows_blk, qw.q_len) - 1;
    s.kv_end = max(0, p.causal ? min(s.kv_len, row_last + s.diag + 1) : s.kv_len);
    s.t_begin = V::kWindow ? min(V::first_key(p, qw.row_base + s.diag), s.kv_end) / bn : 0;
    s.n_tiles = (s.kv_end + bn - 1) / bn - s.t_begin;
    return s;
}

// Block rows r = slot * rows_blk + local row of Q into shared memory; rows outside the
// request or the live head slots are zero-filled.
template <typename T, class Tile, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_q_rows(const AttentionParams& p, const QWork& qw, const PrefillSpan& sp,
                                            uint32_t sQ) {
    constexpr int kChunks = D / 8;
    const T* q = static_cast<const T*>(p.q);
    for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
        const int r = i / kChunks, c = i % kChunks;
        const int slot = r / sp.rows_blk, row = qw.row_base + r % sp.rows_blk;
        const bool ok = slot < sp.nslots && row < qw.q_len;
        const T* src = ok ? q + qw.q_off + int64_t(row) * p.q_stride_l + int64_t(sp.head0 + slot) * p.q_stride_h + c * 8
                          : q;
        cp_async_16(sQ + Tile::offset(r, c), src, ok);
    }
}

// K/V tile copies: 8 neighbouring threads copy one 128-byte line of a row per instruction
// (a warp: 4 rows x one line each) and a thread keeps its row for all its lines, so a
// tile costs kPasses page lookups per thread. Page-table reads run one tile ahead: fetch
// tile t + 1 after issuing the copies of tile t. Tiles are numbered from the span's t_begin.
// E: the pages' element type, T's by default, uint8_t for fp8 pages (a row of D bytes: at
// D = 64 four threads share it).
template <typename T, class KV, class Tile, int D, int BN, int THREADS, typename E = T>
struct KvTileLoader {
    static constexpr int kChunkElems = 16 / int(sizeof(E));
    static constexpr int kRowChunks = D / kChunkElems;
    static constexpr int kThreadsPerRow = kRowChunks < 8 ? kRowChunks : 8;
    static constexpr int kLines = kRowChunks / kThreadsPerRow;
    static constexpr int kRowsPerPass = THREADS / kThreadsPerRow;
    static constexpr int kPasses = BN / kRowsPerPass;
    static_assert(BN % kRowsPerPass == 0, "tile rows must split evenly over the threads");

    const AttentionParams& p;
    const typename KV::Request req;
    const int kvh, kv_end, kv_begin, ld_r, ld_c;
    typename KV::Handle hnd[kPasses];

    __device__ KvTileLoader(const AttentionParams& p_, const QWork& qw, const PrefillSpan& sp)
        : p(p_), req(KV::request(p_, qw.b)), kvh(sp.kvh), kv_end(sp.kv_end), kv_begin(sp.t_begin * BN),
          ld_r(threadIdx.x / kThreadsPerRow), ld_c(threadIdx.x % kThreadsPerRow) {}

    __device__ __forceinline__ void fetch(int tile) {
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int pos = kv_begin + tile * BN + ld_r + pass * kRowsPerPass;
            hnd[pass] = pos < kv_end ? KV::fetch(p, req, pos) : 0;
        }
    }

    // Copies tile `tile` into the K tile at k_dst and the V tile at v_dst (zero-filled past kv_end).
    __device__ __forceinline__ void load(int tile, uint32_t k_dst, uint32_t v_dst) const {
        copy<true, true>(tile, k_dst, v_dst);
    }
    // K or V alone (the warp-specialized kernel streams them through separate rings).
    __device__ __forceinline__ void load_k(int tile, uint32_t dst) const { copy<true, false>(tile, dst, 0); }
    __device__ __forceinline__ void load_v(int tile, uint32_t dst) const { copy<false, true>(tile, 0, dst); }

  private:
    template <bool kK, bool kV>
    __device__ __forceinline__ void copy(int tile, uint32_t k_dst, uint32_t v_dst) const {
        const E* kg = static_cast<const E*>(p.k);
        const E* vg = static_cast<const E*>(p.v);
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int r = ld_r + pass * kRowsPerPass;
            const int pos = kv_begin + tile * BN + r;
            const bool ok = pos < kv_end;
            int64_t ko = 0, vo = 0;
            if (ok) KV::offsets(p, req, hnd[pass], pos, kvh, ko, vo);
#pragma unroll
            for (int line = 0; line < kLines; ++line) {
                const int c = line * kThreadsPerRow + ld_c;
                const uint32_t off = Tile::offset(r, c);
                if constexpr (kK) cp_async_16(k_dst + off, kg + ko + c * kChunkElems, ok);
                if constexpr (kV) cp_async_16(v_dst + off, vg + vo + c * kChunkElems, ok);
            }
        }
    }
};

// The K/V ring of a prefill block: STAGES stages, tile t in stage t % STAGES, one cp.async
// commit group per tile (empty groups past the last tile keep the wait counts uniform).
// load_stage(tile, stage) issues a tile's copies.
template <int STAGES, class Loader, class LoadStage>
__device__ __forceinline__ void prime_kv_ring(Loader& kv, int n_tiles, LoadStage&& load_stage) {
    if (n_tiles > 0) kv.fetch(0);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) {
            load_stage(s, s);
            if (s + 1 < n_tiles) kv.fetch(s + 1);
        }
        cp_async_commit();
    }
}

// At tile t, after the barrier that freed stage (t - 1) % STAGES: refills it with tile
// t + STAGES - 1.
template <int STAGES, class Loader, class LoadStage>
__device__ __forceinline__ void refill_kv_ring(Loader& kv, int t, int n_tiles, LoadStage&& load_stage) {
    const int next = t + STAGES - 1;
    if (next < n_tiles) {
        load_stage(next, next % STAGES);
        if (next + 1 < n_tiles) kv.fetch(next + 1);
    }
    cp_async_commit();
}

// Whether K/V tile [col0, col0 + BN) needs per-element masking for a block whose first row
// is row_base: the end of K/V, a user mask, the causal diagonal or (a variant V with windows)
// the window's left edge of the block's last row crosses it.
template <int BN, class V>
__device__ __forceinline__ bool tile_needs_mask(const AttentionParams& p, const QWork& qw, const PrefillSpan& sp,
                                                int col0, const uint8_t* mask) {
    const bool left = V::kWindow && p.window_left >= 0 &&
                      col0 < V::first_key(p, min(qw.row_base + sp.rows_blk, qw.q_len) - 1 + sp.diag);
    return col0 + BN > sp.kv_len || mask != nullptr || (p.causal && col0 + BN - 1 > qw.row_base + sp.diag) || left;
}

// Sets masked scores of a 16-row accumulator s[NT][4] (mma C layout: this thread's rows
// row0 and row0 + 8, columns col0 + 8j + 2 (lane & 3) + {0, 1}) to -inf: past a row's end,
// masked out, or left of its window (V::first_key).
template <class V, int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], const AttentionParams& p, const QWork& qw,
                                            const PrefillSpan& sp, int col0, int row0, const uint8_t* mask) {
    const int lane = threadIdx.x % 32;
    if (mask == nullptr) {
        // Without a user mask each row keeps a range of the tile: one compare per score
        // against the row's limit (and with a window its start), relative to this thread's
        // first column.
        int limit[2], start[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int end = p.causal ? min(sp.kv_len, row0 + 8 * h + sp.diag + 1) : sp.kv_len;
            limit[h] = end - col0 - 2 * (lane & 3);
            start[h] = V::kWindow ? V::first_key(p, row0 + 8 * h + sp.diag) - col0 - 2 * (lane & 3) : 0;
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 8 * j + (e & 1);
                if (c >= limit[e >> 1] || (V::kWindow && c < start[e >> 1])) s[j][e] = -INFINITY;
            }
        return;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = col0 + 8 * j + 2 * (lane & 3) + (e & 1);
            const int row = row0 + 8 * (e >> 1);
            bool keep = col < sp.kv_len && (!p.causal || col <= row + sp.diag);
            if (V::kWindow) keep = keep && col >= V::first_key(p, row + sp.diag);
            if (keep && mask)
                keep = mask[int64_t(min(row, qw.q_len - 1)) * p.mask_stride_q + int64_t(col) * p.mask_stride_k] != 0;
            if (!keep) s[j][e] = -INFINITY;
        }
}

// P as the 16-bit A operand of P V: pa[kk] holds columns 16kk .. 16kk + 15 of the scores
// (mma.sync A layout), packed right after the softmax so the fp32 scores die early.
template <typename T, int NT>
__device__ __forceinline__ void pack_probs(const float (&s)[NT][4], uint32_t (&pa)[NT / 2][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        pa[kk][0] = Elem<T>::pack2(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = Elem<T>::pack2(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = Elem<T>::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = Elem<T>::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// Normalizes and stores this thread's two output rows (row0, row0 + 8) of query head `head`
// (V::finish_rows: with its sink).
template <typename T, int D, class V>
__device__ __forceinline__ void store_rows(const float (&o)[D / 8][4], RowState& st, const AttentionParams& p,
                                           const QWork& qw, int head, int row0) {
    const int lane = threadIdx.x % 32;
    float inv_l[2];
    finalize_rows(st, inv_l);
    V::finish_rows(p, [&] { return head; }, st, inv_l);
    T* out = static_cast<T*>(p.o) + qw.o_off + int64_t(head) * p.o_stride_h;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h;
        if (row >= qw.q_len) continue;
        T* dst = out + int64_t(row) * p.o_stride_l + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<uint32_t*>(dst + 8 * j) = Elem<T>::pack2(o[j][2 * h] * inv_l[h], o[j][2 * h + 1] * inv_l[h]);
    }
}

}  // namespace astrai::attn
