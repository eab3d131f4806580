// Decode attention on tensor cores (mma.sync m16n8k16, sm_80+), split over KV.
//
// Block (unit, split): unit = (request, kv head, group of up to 16 query heads), split =
// one of num_splits equal shares of the request's KV tiles, sized on the device from the
// request's own length (so the host needs no KV length and the launch is graph-capturable).
// The query heads of one kv head are the 16 rows of the mma A operand (a GQA group of G
// heads fills G of them). Each tile of kBN = 16 * kWarps K/V rows streams through a
// kStages-deep cp.async ring; warp w scores rows w*16 .. w*16+15 of every tile with its own
// online softmax, and the warps merge through shared memory at the end. With one split the
// block writes the output; otherwise it writes a normalized partial and its log2-sum-exp.
// The partials are merged by decode_combine_kernel (what the ops do), or, with p.ws_count
// set, in the same launch: each block counts its arrival on its unit's counter, and the
// last of the unit's num_splits blocks merges them and resets the counter to 0 for the next
// launch. The in-kernel merge measured slower on an H200 (one SM reads all of a unit's
// partials after a fence and an atomic round trip, where the combine grid spreads them
// over B x Hq blocks), so it is an option of the modules, not the default.
//
// The in-kernel append (paged, p.k_new set): a decode step's new key/value of request b is
// the token at its last position L - 1 (L = kv_lens[b]), stored at page
// kv_indices[kv_indptr[b] + (L - 1) / page], slot (L - 1) % page. Race-free by construction,
// because no block of the launch reads that cache row:
// - every block whose tiles cover position L - 1 copies that row into its K/V tile from
//   k_new / v_new instead of from the cache (the only change to the loads);
// - exactly one block per (request, kv head) writes it to the cache: head group 0 of the
//   split holding the request's last tile, after its main loop, from the tile row it has
//   in shared memory (already waited on and barrier-synchronized for the scores);
// - other requests never read the row: it is the append target of request b alone (the
//   caller's contract, as with kv_append's distinct slots).
// Nothing in the launch depends on the written bytes, so no fence or ordering is needed;
// the stream's next kernel sees them as it sees the output. A request with kv_lens[b] == 0
// has no position to write and appends nothing.
#pragma once

#include <type_traits>

#include "capabilities.h"
#include "common.h"
#include "decode_unit.cuh"
#include "layout_policies.cuh"
#include "mma_utils.cuh"
#include "decode_swap_ab.cuh"
#include "kv_fp8.cuh"
#include "variant.cuh"

namespace astrai::attn {

// KvBytes: bytes per K/V value in the pages (2: the compute dtype, 1: fp8, kv_fp8.cuh).
template <int D, int KvBytes = 2>
struct DecodeMmaConfig {
    static_assert(is_head_dim(D), "head_dim must be " ASTRAI_ATTN_HEAD_DIMS_TEXT);
    static_assert(KvBytes == 1 || KvBytes == 2, "K/V values are 16-bit or fp8");
    static constexpr int kWarps = D <= 128 ? 4 : 2;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kBN = 16 * kWarps;  // K/V rows per tile
    // fp8 tiles are half the bytes: one more stage keeps as many bytes in flight
    static constexpr int kStages = (D <= 128 ? 3 : 2) + (KvBytes == 1 ? 1 : 0);
    static constexpr int kHeads = 16;  // query heads per block (mma rows)
    static constexpr bool kQInRegs = D <= 128;  // else Q fragments are re-read from smem
    static constexpr int kChunks = D * KvBytes / 16;  // 16-byte copies per K/V row
    static constexpr int kRowsPerPass = kThreads / kChunks;
    static constexpr int kTileBytes = kBN * D * KvBytes;
    static constexpr int kQBytes = kHeads * D * 2;
    static constexpr int kRingBytes = 2 * kStages * kTileBytes;
    // Q is staged in the last ring slot when it lives in registers.
    static constexpr int kQSmemOffset = kQInRegs ? (2 * kStages - 1) * kTileBytes : kRingBytes;
    static constexpr int kCombineBytes = kWarps * kHeads * (D + 2) * 4;
    static constexpr int kLoopBytes = kQInRegs ? kRingBytes : kRingBytes + kQBytes;
    // the warp merge reuses the ring (and more where it needs more)
    static constexpr int kSmemBytes = kLoopBytes > kCombineBytes ? kLoopBytes : kCombineBytes;
    static_assert(kBN % kRowsPerPass == 0, "tile rows must split evenly over the threads");
    static_assert(kQBytes <= kTileBytes, "Q must fit one ring slot");
    static_assert(kSmemBytes <= 99 * 1024, "must fit the sm_86/89 shared-memory limit");
};

// Turns the log2-sum-exps lse[s * ld] (s < S <= 64) of one output row into normalized
// split weights exp2(lse_s - max) / sum in place: one warp, lanes over the splits. A row
// that no split saw (all -inf) gets zero weights. `sink` (log2 domain, -inf: none) is one
// more term of the sum with no partial: the attention sink, added once per row here.
__device__ __forceinline__ void split_weights_warp(float* lse, int ld, int S, int lane, float sink = -INFINITY) {
    static_assert(kMaxDecodeSplits <= 64, "two splits per lane");
    const float a = lane < S ? lse[lane * ld] : -INFINITY;
    const float c = lane + 32 < S ? lse[(lane + 32) * ld] : -INFINITY;
    const float m = fmaxf(warp_reduce_max(fmaxf(a, c)), sink);
    const float base = m == -INFINITY ? 0.f : m;
    const float ea = exp2f(a - base), ec = exp2f(c - base);
    const float l = warp_reduce_sum(ea + ec) + exp2f(sink - base);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (lane < S) lse[lane * ld] = ea * inv;
    if (lane + 32 < S) lse[(lane + 32) * ld] = ec * inv;
}

// The last-arriving block of a unit merges the unit's num_splits partials (rows head0 ..
// head0 + nh - 1 of request b) into the output: the partials stream into shared memory by
// cp.async (L2, not L1: other blocks wrote them) in chunks of as many splits as fit, the
// log2-sum-exps land beside the first chunk, and each thread accumulates whole float4
// columns with the normalized weights exp2(lse_s - max) / sum.
template <typename T, int D, int kThreads>
__device__ __forceinline__ void decode_merge_splits(const AttentionParams& p, uint8_t* smem, int smem_bytes, int b,
                                                    int head0, int nh) {
    constexpr int kHeads = 16;
    constexpr int kOwn = (kHeads * D / 4 + kThreads - 1) / kThreads;  // float4 columns per thread
    const int tid = threadIdx.x;
    const int S = p.num_splits;
    const int64_t split_rows = int64_t(p.batch) * p.q_heads;
    const int64_t bh0 = int64_t(b) * p.q_heads + head0;
    float* sW = reinterpret_cast<float*>(smem);  // [kMaxDecodeSplits][kHeads] lse, then weights
    float* sP = sW + kMaxDecodeSplits * kHeads;  // [chunk][nh][D] partials
    const int cols = nh * D / 4;                 // float4 columns of one split's partial
    const int chunk = min(S, max(1, (smem_bytes - kMaxDecodeSplits * kHeads * 4) / (cols * 16)));
    auto issue = [&](int s0, int n) {
        for (int i = tid; i < n * cols; i += kThreads) {
            const int s = i / cols, c = i - s * cols;
            cp_async_16(smem_u32(sP) + 16u * i, p.ws_o + ((s0 + s) * split_rows + bh0) * D + 4 * c, true);
        }
        cp_async_commit();
    };
    issue(0, chunk);
    for (int i = tid; i < S * nh; i += kThreads) {
        const int s = i / nh, r = i - s * nh;
        sW[s * kHeads + r] = __ldcg(p.ws_lse + s * split_rows + bh0 + r);
    }
    __syncthreads();
    for (int row = tid / 32; row < nh; row += kThreads / 32)
        split_weights_warp(sW + row, kHeads, S, tid % 32, RuntimeVariant::sink(p, head0 + row));
    float4 acc[kOwn];
#pragma unroll
    for (int k = 0; k < kOwn; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* sP4 = reinterpret_cast<const float4*>(sP);
    for (int s0 = 0; s0 < S; s0 += chunk) {
        const int n = min(chunk, S - s0);
        if (s0 > 0) {
            __syncthreads();  // the previous chunk has been read
            issue(s0, n);
        }
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int k = 0; k < kOwn; ++k) {
            const int c = tid + k * kThreads;
            if (c < cols) {
                const int row = c / (D / 4);
                for (int s = 0; s < n; ++s) {
                    const float w = sW[(s0 + s) * kHeads + row];
                    const float4 v = sP4[s * cols + c];
                    acc[k].x = fmaf(w, v.x, acc[k].x);
                    acc[k].y = fmaf(w, v.y, acc[k].y);
                    acc[k].z = fmaf(w, v.z, acc[k].z);
                    acc[k].w = fmaf(w, v.w, acc[k].w);
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < kOwn; ++k) {
        const int c = tid + k * kThreads;
        if (c < cols) {
            const int row = c / (D / 4), d = 4 * (c % (D / 4));
            T* dst = static_cast<T*>(p.o) + int64_t(b) * p.o_stride_b + int64_t(head0 + row) * p.o_stride_h + d;
            uint2 packed;
            packed.x = Elem<T>::pack2(acc[k].x, acc[k].y);
            packed.y = Elem<T>::pack2(acc[k].z, acc[k].w);
            *reinterpret_cast<uint2*>(dst) = packed;
        }
    }
}

// O += P.V for a warp's 16 rows of one 16-bit V tile (ldmatrix.trans B fragments); alpha is
// online_softmax's rescale of O, applied where `rescale`.
template <typename T, int D>
__device__ __forceinline__ void b16_output(float (&o)[D / 8][4], const float (&s)[2][4], const float (&alpha)[2],
                                           bool rescale, uint32_t v_tile, int warp, int lane) {
    const uint32_t pa[4] = {Elem<T>::pack2(s[0][0], s[0][1]), Elem<T>::pack2(s[0][2], s[0][3]),
                            Elem<T>::pack2(s[1][0], s[1][1]), Elem<T>::pack2(s[1][2], s[1][3])};
    if (rescale) rescale_rows<D / 8>(o, alpha);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_tile + SwizzledTile<D>::offset(warp * 16 + (((lane >> 3) & 1) << 3) + (lane & 7),
                                                               2 * dp + (lane >> 4)));
        mma_sync<T>(o[2 * dp], pa, {vb[0], vb[1]});
        mma_sync<T>(o[2 * dp + 1], pa, {vb[2], vb[3]});
    }
}

// The scores of a warp's 16 rows of one fp8 K tile on float16 (raw q.k, Q in float16:
// kv_fp8.cuh): per 64-byte segment of a row, one 16-byte load per n-tile feeds four k-steps;
// q_frag(ks, qa) gives Q's A fragment of k-step ks in the same permutation.
template <int D, class KvFmt, class QFrag>
__device__ __forceinline__ void fp8_scores(float (&s)[2][4], const uint8_t* k_tile, int warp, int lane,
                                           QFrag&& q_frag) {
    for_fp8_k_segments<D>(k_tile, warp, lane, [&](int seg, const uint4 (&kw)[2]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            uint32_t qa[4];
            q_frag(4 * seg + kk, qa);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint32_t w = (&kw[j].x)[kk];
                mma_sync<__half>(s[j], qa, {fp8x2_to_half2<KvFmt>(w), fp8x2_to_half2<KvFmt, true>(w)});
            }
        }
    });
}

// A bfloat16 Q tile (16 rows in SwizzledTile<D> layout) rewritten in place as float16, row r
// times a power of two that puts its largest |element| in [2^14, 2^15); q_unit[r] gets the
// inverse (kv_fp8.cuh). kThreads / 16 consecutive lanes take a row.
template <int D, int kThreads>
__device__ __forceinline__ void q_rows_to_half(uint8_t* q_tile, float* q_unit, int tid) {
    constexpr int kPerRow = kThreads / 16;
    constexpr int kOwn = SwizzledTile<D>::kChunks / kPerRow;  // 8-element chunks per thread
    const int r = tid / kPerRow, part = tid % kPerRow;
    uint4 x[kOwn];
    float mx = 0.f;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
        x[i] = *reinterpret_cast<const uint4*>(q_tile + SwizzledTile<D>::offset(r, part + i * kPerRow));
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t v = (&x[i].x)[w];
            mx = fmaxf(mx, fmaxf(fabsf(__uint_as_float(v << 16)), fabsf(__uint_as_float(v & 0xffff0000u))));
        }
    }
#pragma unroll
    for (int o = kPerRow / 2; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    // mx in [2^(E-127), 2^(E-126)): times 2^(141-E) lands in [2^14, 2^15); a zero row keeps 1
    const int e = int(__float_as_uint(mx) >> 23);
    const int up = mx > 0.f ? min(141 - e, 126) : 0;
    const float factor = __uint_as_float(uint32_t(up + 127) << 23);
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t v = (&x[i].x)[w];
            const __half2 h = __floats2half2_rn(__uint_as_float(v << 16) * factor,
                                                __uint_as_float(v & 0xffff0000u) * factor);
            (&x[i].x)[w] = *reinterpret_cast<const uint32_t*>(&h);
        }
        *reinterpret_cast<uint4*>(q_tile + SwizzledTile<D>::offset(r, part + i * kPerRow)) = x[i];
    }
    if (part == 0) q_unit[r] = __uint_as_float(uint32_t(127 - up) << 23);
}

// O += P.V for a warp's 16 rows of one fp8 V tile, on float16 (kv_fp8.cuh): P (probabilities
// from online_softmax, alpha its rescale of O where `rescale`) as float16 A fragments; n-tiles
// j and j + 1's B values are the halves of the pair (j, j + 1) of for_fp8_v_pairs.
template <int D, class KvFmt>
__device__ __forceinline__ void fp8_output(float (&o)[D / 8][4], const float (&s)[2][4], const float (&alpha)[2],
                                           bool rescale, const uint8_t* v_tile, int warp, int lane) {
    const uint32_t pa[4] = {Elem<__half>::pack2(s[0][0], s[0][1]), Elem<__half>::pack2(s[0][2], s[0][3]),
                            Elem<__half>::pack2(s[1][0], s[1][1]), Elem<__half>::pack2(s[1][2], s[1][3])};
    if (rescale) rescale_rows<D / 8>(o, alpha);
    for_fp8_v_pairs<D>(v_tile, warp, lane, [&](int j, uint32_t lo, uint32_t hi) {
        mma_sync<__half>(o[j], pa, {fp8x2_to_half2<KvFmt>(lo), fp8x2_to_half2<KvFmt>(hi)});
        mma_sync<__half>(o[j + 1], pa, {fp8x2_to_half2<KvFmt, true>(lo), fp8x2_to_half2<KvFmt, true>(hi)});
    });
}

// The decode kernel's compile-time shape, shared by its stages below (the kernel's template
// arguments, and what follows from them).
template <typename T_, int D_, class KV_, class V_, class KvFmt_, bool kSwapAB_>
struct DecodeMma {
    using T = T_;
    using KV = KV_;
    using KvFmt = KvFmt_;
    static constexpr int D = D_;
    using V = V_;  // the variant type (variant.cuh)
    static constexpr bool kSwapAB = kSwapAB_;
    static constexpr bool kFp8 = KvFmt::kBytes == 1;
    using C = DecodeMmaConfig<D, KvFmt::kBytes>;
    using Tile = SwizzledTile<D>;
    using KvT = std::conditional_t<kFp8, uint8_t, T>;
    using State = std::conditional_t<kSwapAB, HeadState, RowState>;  // the online softmax's rows
    static constexpr int kOTiles = kSwapAB ? D / 16 : D / 8;  // O's n-tiles (swapped: O^T's m-tiles)
    static constexpr int kRows = kSwapAB ? kSwapHeads : C::kHeads;  // query heads of the warp merge
};

// Launched early (PDL) behind the previous kernel of the stream, the split grid waits for it
// after reading kv_lens and the first page ids (DecodeKvLoader::start), so those two dependent
// round trips overlap that kernel's tail; q, the cache and the new token are read after. The
// previous kernel must therefore not write the page table or kv_lens (in a model's decode it is
// the QKV projection or the rope + append). Measured on an H100 (bench_decode_latency.py, three
// interleaved rounds against the wait at the kernel's start): B=1 kv 4096 with PDL 11.2 against
// 12.0 us (32 splits), 12.5-12.7 against 13.2-13.4 (16), B=16 and B=64 0.3-1 % faster.
__device__ __forceinline__ void decode_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// What a decode block works on: its unit and split (decode_unit), its request's length and
// page table, and its share [t_begin, t_end) of the request's KV tiles. The kernel body fills
// it (its first stage; as a function of its own the prologue gave other SASS).
template <class M>
struct DecodeMmaBlock {
    uint8_t* smem;
    uint32_t sK, sV, sQ;  // the K ring, the V ring, Q's slot
    int tid, warp, lane;
    int unit, split, hgrp, kvh, b, head0, nh;
    int kv_len;
    typename M::KV::Request req;
    int n_tiles, first_key, t_begin, t_end, my_tiles;
    int new_pos;  // the in-kernel append's position (the header explains the scheme); -1 matches none
};

// Q's 16 rows (the block's query heads; rows past nh zero-filled) into its slot: one cp.async group.
template <class M>
__device__ __forceinline__ void decode_copy_q(const AttentionParams& p, const DecodeMmaBlock<M>& k) {
    using C = typename M::C;
    using Tile = typename M::Tile;
    const typename M::T* q = static_cast<const typename M::T*>(p.q) + int64_t(k.b) * p.q_stride_b;
    for (int i = k.tid; i < C::kHeads * Tile::kChunks; i += C::kThreads) {
        const int r = i / Tile::kChunks, c = i % Tile::kChunks;
        const bool ok = r < k.nh;
        cp_async_16(k.sQ + Tile::offset(r, c), ok ? q + int64_t(k.head0 + r) * p.q_stride_h + c * 8 : q, ok);
    }
    cp_async_commit();
}

// Load: the block's K/V tiles through the kStages-deep cp.async ring, kPasses rows a thread.
// Page ids run ahead of the copies: hnd holds the ids of the tile copied next; a paged source
// reads them one more tile ahead (hnd_ahead), so a page-table read has two iterations to land
// before its copies are issued.
template <class M>
struct DecodeKvLoader {
    using C = typename M::C;
    using KV = typename M::KV;
    using KvT = typename M::KvT;
    using Handle = typename KV::Handle;
    static constexpr int kPasses = C::kBN / C::kRowsPerPass;
    static constexpr bool kAhead = KV::kPaged;
    // The page ids of the tile copied next, and (paged) of the one after it.
    using Ids = Handle[kPasses];
    using IdsAhead = Handle[kAhead ? kPasses : 1];
    Ids& hnd;
    IdsAhead& hnd_ahead;
    const KvT* kg;
    const KvT* vg;
    int ld_c, ld_r;

    __device__ __forceinline__ DecodeKvLoader(const AttentionParams& p, const DecodeMmaBlock<M>& k, Ids& hnd_,
                                              IdsAhead& hnd_ahead_)
        : hnd(hnd_), hnd_ahead(hnd_ahead_), kg(static_cast<const KvT*>(p.k)), vg(static_cast<const KvT*>(p.v)),
          ld_c(k.tid % C::kChunks), ld_r(k.tid / C::kChunks) {}

    __device__ __forceinline__ void fetch_tile(const AttentionParams& p, const DecodeMmaBlock<M>& k, int tile,
                                               Handle* h) const {
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int pos = tile * C::kBN + ld_r + pass * C::kRowsPerPass;
            h[pass] = pos < k.kv_len ? KV::fetch(p, k.req, pos) : 0;
        }
    }
    __device__ __forceinline__ void load_kv(const AttentionParams& p, const DecodeMmaBlock<M>& k, int tile,
                                            int stage) const {
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int r = ld_r + pass * C::kRowsPerPass;
            const int pos = tile * C::kBN + r;
            const bool ok = pos < k.kv_len;
            // Branch-free: every pass's address math is independent, so the passes
            // interleave; a position past the end reads nothing (zero fill) from offset 0.
            int64_t ko, vo;
            KV::offsets(p, k.req, hnd[pass], pos, k.kvh, ko, vo);
            ko = ok ? ko : 0;
            vo = ok ? vo : 0;
            const KvT* k_src = kg + ko;
            const KvT* v_src = vg + vo;
            if constexpr (KV::kPaged && !M::kFp8) {
                if (pos == k.new_pos) {  // this step's token: from k_new / v_new, not the cache
                    using T = typename M::T;
                    k_src = static_cast<const T*>(p.k_new) + int64_t(k.b) * p.k_new_stride_b + k.kvh * p.k_new_stride_h;
                    v_src = static_cast<const T*>(p.v_new) + int64_t(k.b) * p.v_new_stride_b + k.kvh * p.v_new_stride_h;
                }
            }
            const uint32_t off = M::kFp8 ? Fp8Tile<M::D>::offset(r, ld_c) : M::Tile::offset(r, ld_c);
            cp_async_16(k.sK + stage * C::kTileBytes + off, k_src + ld_c * (16 / M::KvFmt::kBytes), ok);
            cp_async_16(k.sV + stage * C::kTileBytes + off, v_src + ld_c * (16 / M::KvFmt::kBytes), ok);
        }
    }
    // After the copies of tile j - 1: make hnd the ids of tile j (relative indices).
    __device__ __forceinline__ void advance(const AttentionParams& p, const DecodeMmaBlock<M>& k, int j) const {
        if (j >= k.my_tiles) return;
        if constexpr (kAhead) {
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) hnd[pass] = hnd_ahead[pass];
            if (j + 1 < k.my_tiles) fetch_tile(p, k, k.t_begin + j + 1, hnd_ahead);
        } else {
            fetch_tile(p, k, k.t_begin + j, hnd);
        }
    }
    // Q is group 0; the first kStages - 1 K/V tiles follow without waiting for it (Q sits
    // in the last V slot, which only tile kStages - 1 overwrites, after the loop's first
    // barrier), so Q's round trip overlaps the K/V requests instead of preceding them.
    __device__ __forceinline__ void start(const AttentionParams& p, const DecodeMmaBlock<M>& k) const {
        if (k.my_tiles > 0) fetch_tile(p, k, k.t_begin, hnd);
        if constexpr (kAhead) {
            if (k.my_tiles > 1) fetch_tile(p, k, k.t_begin + 1, hnd_ahead);
        }
        decode_pdl_wait();  // the page ids are on their way; q and the new token are not read yet
        decode_copy_q<M>(p, k);
#pragma unroll
        for (int s = 0; s < C::kStages - 1; ++s) {
            if (s < k.my_tiles) {
                load_kv(p, k, k.t_begin + s, s);
                advance(p, k, s + 1);
            }
            cp_async_commit();
        }
        cp_async_wait<C::kStages - 1>();  // group 0 (Q) has landed
        __syncthreads();
    }
    // Before tile i: its copies have landed and every warp is done with tile i - 1, whose
    // stage takes tile i + kStages - 1.
    __device__ __forceinline__ void next(const AttentionParams& p, const DecodeMmaBlock<M>& k, int i) const {
        cp_async_wait<C::kStages - 2>();
        __syncthreads();
        const int nxt = i + C::kStages - 1;
        if (nxt < k.my_tiles) {
            load_kv(p, k, k.t_begin + nxt, nxt % C::kStages);
            advance(p, k, nxt + 1);
        }
        cp_async_commit();
    }
};

// Q's A fragment of k-step ks from shared memory; over fp8 pages with the head-dim permutation
// of kv_fp8.cuh: the thread's elements e .. e + 3, e = 64 * (ks / 4) + 16 * t + 4 * (ks % 4),
// rows g, g + 8.
template <class M>
__device__ __forceinline__ void decode_q_fragment(const DecodeMmaBlock<M>& k, int ks, uint32_t (&qa)[4]) {
    using Tile = typename M::Tile;
    if constexpr (M::kFp8) {
        const int e = 64 * (ks / 4) + 16 * (k.lane & 3) + 4 * (ks % 4);
        const uint32_t in_chunk = 2 * (e % 8);
        const uint8_t* q_s = k.smem + M::C::kQSmemOffset;
        const uint2 lo = *reinterpret_cast<const uint2*>(q_s + Tile::offset(k.lane >> 2, e / 8) + in_chunk);
        const uint2 hi = *reinterpret_cast<const uint2*>(q_s + Tile::offset((k.lane >> 2) + 8, e / 8) + in_chunk);
        qa[0] = lo.x, qa[1] = hi.x, qa[2] = lo.y, qa[3] = hi.y;
    } else {
        ldmatrix_x4(qa, k.sQ + Tile::offset(k.lane & 15, 2 * ks + (k.lane >> 4)));
    }
}

// Q in registers (d <= 128): the A fragments, or Q^T's B fragments of the swapped operands.
template <class M>
struct DecodeQRegs {
    static constexpr bool kInRegs = M::C::kQInRegs;
    uint32_t qf[kInRegs && !M::kSwapAB ? M::D / 16 : 1][4];
    uint32_t qb[kInRegs && M::kSwapAB ? M::D / 16 : 1][2];
};

// After the landed Q: over fp8 pages the scores run on float16 (kv_fp8.cuh), so a bfloat16 Q
// is converted in place, row r times 1 / q_unit[r], and each score row carries q_unit back
// with the K scale; then Q's fragments into registers where they live there.
template <class M>
__device__ __forceinline__ void decode_load_q(const DecodeMmaBlock<M>& k, float* q_unit, DecodeQRegs<M>& q) {
    using C = typename M::C;
    if constexpr (M::kFp8 && !std::is_same_v<typename M::T, __half>) {
        q_rows_to_half<M::D, C::kThreads>(k.smem + C::kQSmemOffset, q_unit, k.tid);
        __syncthreads();
    }
    if constexpr (M::kSwapAB && C::kQInRegs) {
#pragma unroll
        for (int ks = 0; ks < M::D / 16; ++ks) swap_q_fragment<M::D>(q.qb[ks], k.smem + C::kQSmemOffset, ks, k.lane);
    } else if constexpr (C::kQInRegs && !M::kSwapAB) {
#pragma unroll
        for (int ks = 0; ks < M::D / 16; ++ks) decode_q_fragment<M>(k, ks, q.qf[ks]);
        // No barrier here: Q's slot is next written after the main loop's first barrier
        // (or, with no tile, after the one before the warp merge).
    }
}

// fp8 pages: what a raw score of rows g and g + 8 (swapped: of head columns 2t and 2t + 1)
// is multiplied by to be q.k, and the softmax's scale of those (the cap, if any, has applied
// the factor already); they stay 1 and p.scale_log2 over 16-bit pages.
template <class M>
__device__ __forceinline__ void decode_fp8_score_scales(const AttentionParams& p, const DecodeMmaBlock<M>& k,
                                                        const float* q_unit, float k_scale, float (&score_factor)[2],
                                                        float (&row_scale_log2)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int head = M::kSwapAB ? 2 * (k.lane & 3) + r : (k.lane >> 2) + 8 * r;
        score_factor[r] = k_scale * (std::is_same_v<typename M::T, __half> ? 1.f : q_unit[head]);
        if (!M::V::capped(p)) row_scale_log2[r] = p.scale_log2 * score_factor[r];
    }
}

// ALiBi (an AlibiVariant decode): a key step's bias of rows g and g + 8 (query heads head0 + g,
// head0 + g + 8; 0 for rows past nh), in the raw units of their scores: row_scale_log2 where
// uncapped (over fp8 pages it carries the score factors), the soft-cap's slope where capped
// (the scores were multiplied by the factors first). Asked per tile: held across the loop, the
// two steps spilled the paged 16-bit d256 body.
template <class M>
__device__ __forceinline__ void decode_alibi_steps(const AttentionParams& p, const DecodeMmaBlock<M>& k,
                                                   const float (&row_scale_log2)[2], float (&step)[2]) {
    static_assert(!M::kSwapAB, "ALiBi runs the 16-row form");
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = (k.lane >> 2) + 8 * r;
        const float unit = M::V::capped(p) ? p.cap_in * p.cap_log2 : row_scale_log2[r];
        step[r] = row < k.nh ? alibi_step(p, k.head0 + row, unit) : 0.f;
    }
}

// Score and mask of tile i in the swapped form (decode_swap_ab.cuh): S^T of the warp's 16 keys,
// through the variant's logits, keys outside [first_key, kv_len) or masked out -inf.
template <class M>
__device__ __forceinline__ void decode_swap_scores(const AttentionParams& p, const DecodeMmaBlock<M>& k,
                                                   const DecodeQRegs<M>& q, const float (&score_factor)[2],
                                                   const uint8_t* mask, float (&s)[1][4], int i, int stage) {
    using C = typename M::C;
    const int warp = k.warp, lane = k.lane;
    swap_scores<M::D, typename M::KvFmt>(s[0], k.smem + stage * C::kTileBytes, warp, lane,
                                         [&](int ks, uint32_t (&b)[2]) {
                                             if constexpr (C::kQInRegs) {
                                                 b[0] = q.qb[ks][0];
                                                 b[1] = q.qb[ks][1];
                                             } else {
                                                 swap_q_fragment<M::D>(b, k.smem + C::kQSmemOffset, ks, lane);
                                             }
                                         });
    if (M::V::capped(p)) {  // the cap sees true scores; else the factors join the softmax scale
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][e] *= score_factor[e & 1];
    }
    M::V::logits(s, p);
    const int key0 = (k.t_begin + i) * C::kBN + warp * 16;
    if (mask || key0 < k.first_key || key0 + 16 > k.kv_len) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + (lane >> 2) + 8 * (e >> 1);
            bool keep = key < k.kv_len && key >= k.first_key;
            if (keep && mask) keep = mask[int64_t(key) * p.mask_stride_k] != 0;
            if (!keep) s[0][e] = -INFINITY;
        }
    }
}

// The scores of a warp's 16 rows of one 16-bit K tile (ldmatrix B fragments); q_frag(ks, qa)
// gives Q's A fragment of k-step ks.
template <typename T, int D, class QFrag>
__device__ __forceinline__ void b16_scores(float (&s)[2][4], uint32_t k_tile, int warp, int lane, QFrag&& q_frag,
                                           uint32_t (&qa)[4], uint32_t (&kb)[4]) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        q_frag(ks, qa);
        ldmatrix_x4(kb, k_tile + SwizzledTile<D>::offset(warp * 16 + ((lane >> 4) << 3) + (lane & 7),
                                                         2 * ks + ((lane >> 3) & 1)));
        mma_sync<T>(s[0], qa, {kb[0], kb[1]});
        mma_sync<T>(s[1], qa, {kb[2], kb[3]});
    }
}

// Score: S = Q K^T of the warp's 16 keys of ring stage `stage` (16-bit K at k_st, or fp8),
// through the variant's logits (ALiBi's variant: in decode_mask_scores, after the bias). qa, kb:
// the 16-bit loop's fragments, declared by the caller (the kernel body): declared here, they
// changed the kernel's SASS.
template <class M>
__device__ __forceinline__ void decode_scores(const AttentionParams& p, const DecodeMmaBlock<M>& k,
                                              const DecodeQRegs<M>& q, const float (&score_factor)[2],
                                              float (&s)[2][4], int stage, uint32_t k_st, uint32_t (&qa)[4],
                                              uint32_t (&kb)[4]) {
    using C = typename M::C;
    // Q's A fragment of k-step ks: from registers, or re-read from shared memory (d256)
    auto q_frag = [&](int ks, uint32_t (&a)[4]) {
        if constexpr (C::kQInRegs) {
#pragma unroll
            for (int x = 0; x < 4; ++x) a[x] = q.qf[ks][x];
        } else {
            decode_q_fragment<M>(k, ks, a);
        }
    };
    if constexpr (M::kFp8) {
        fp8_scores<M::D, typename M::KvFmt>(s, k.smem + stage * C::kTileBytes, k.warp, k.lane, q_frag);
        if (M::V::capped(p)) {  // the cap sees true scores; else the factors join the softmax scale
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] *= score_factor[e / 2];
        }
    } else {
        b16_scores<typename M::T, M::D>(s, k_st, k.warp, k.lane, q_frag, qa, kb);
    }
    if constexpr (!M::V::kAlibi) M::V::logits(s, p);
}

// The scores of keys outside [first_key, kv_len) or masked out, -inf. ALiBi's variant first adds
// the bias (the query sits at the context's last position) and applies the logits: here, after
// the scores' MMAs, the bias's registers did not spill the paged 16-bit d256 body.
template <class M>
__device__ __forceinline__ void decode_mask_scores(const AttentionParams& p, const DecodeMmaBlock<M>& k,
                                                   const uint8_t* mask, const float (&row_scale_log2)[2],
                                                   float (&s)[2][4], int i) {
    const int lane = k.lane;
    const int col0 = (k.t_begin + i) * M::C::kBN + k.warp * 16;
    if constexpr (M::V::kAlibi) {
        if (M::V::alibi(p)) {
            float step[2];
            decode_alibi_steps<M>(p, k, row_scale_log2, step);
            M::V::bias(s, step, col0 + 2 * (lane & 3), {k.kv_len - 1, k.kv_len - 1});
        }
        M::V::logits(s, p);
    }
    // the warp's 16 keys need masking only at the ends of the window and the context (or with a
    // mask); the 16-bit d256 body spilled with the test, so it always masks
    if (!M::kFp8 || mask || col0 < k.first_key || col0 + 16 > k.kv_len) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = col0 + 8 * j + 2 * (lane & 3) + (e & 1);
                bool keep = col < k.kv_len && col >= M::V::first_key(p, k.kv_len - 1);  // recomputed: d256's registers
                if (keep && mask) keep = mask[int64_t(col) * p.mask_stride_k] != 0;
                if (!keep) s[j][e] = -INFINITY;
            }
    }
}

// Accumulate: O += P V of the tile (16-bit V at v_st, or fp8), after O's rescale by alpha
// where `rescale`.
template <class M>
__device__ __forceinline__ void decode_pv(const DecodeMmaBlock<M>& k, const float (&s)[2][4], const float (&alpha)[2],
                                          bool rescale, float (&o)[M::kOTiles][4], int stage, uint32_t v_st) {
    using C = typename M::C;
    if constexpr (M::kFp8) {
        fp8_output<M::D, typename M::KvFmt>(o, s, alpha, rescale, k.smem + (C::kStages + stage) * C::kTileBytes,
                                            k.warp, k.lane);
    } else {
        b16_output<typename M::T, M::D>(o, s, alpha, rescale, v_st, k.warp, k.lane);
    }
}

// The in-kernel append's one writer: the new row is row r of the last tile, whose stage the
// loop's last barrier made visible and which no later copy overwrote.
template <class M>
__device__ __forceinline__ void decode_append_new_row(const AttentionParams& p, const DecodeMmaBlock<M>& k,
                                                      const DecodeKvLoader<M>& ld) {
    using C = typename M::C;
    using KV = typename M::KV;
    const bool writer = k.new_pos >= 0 && k.hgrp == 0 && k.my_tiles > 0 && k.t_end == k.n_tiles;
    if (writer && k.tid < 2 * C::kChunks) {
        const int c = k.tid % C::kChunks;
        const bool is_v = k.tid >= C::kChunks;
        const int r = k.new_pos - (k.n_tiles - 1) * C::kBN;
        const int stage = (k.my_tiles - 1) % C::kStages;
        const uint4 row = *reinterpret_cast<const uint4*>(
            k.smem + (is_v ? C::kStages : 0) * C::kTileBytes + stage * C::kTileBytes + M::Tile::offset(r, c));
        int64_t ko, vo;
        KV::offsets(p, k.req, KV::fetch(p, k.req, k.new_pos), k.new_pos, k.kvh, ko, vo);
        using T = typename M::T;
        T* dst = const_cast<T*>(is_v ? ld.vg + vo : ld.kg + ko) + c * 8;  // the caller's mutable cache
        *reinterpret_cast<uint4*>(dst) = row;
    }
}

// Epilogue, first half: each warp's unnormalized O and its rows' m and l into the reused ring,
// sO[w][row][d], sM / sL [w][row]; a row is a query head.
template <class M>
__device__ __forceinline__ void decode_stash_warp(const DecodeMmaBlock<M>& k, const float (&o)[M::kOTiles][4],
                                                  const typename M::State& st) {
    using C = typename M::C;
    constexpr int D = M::D, kRows = M::kRows;
    const int warp = k.warp, lane = k.lane;
    float* sO = reinterpret_cast<float*>(k.smem);
    float* sM = sO + C::kWarps * kRows * D;
    float* sL = sM + C::kWarps * kRows;
    if constexpr (M::kSwapAB) {
        // O^T's row g of m-tile mt is head-dim element g * D/8 + 2 mt, row g + 8 the next one
        const int h = 2 * (lane & 3), d0 = (lane >> 2) * (D / 8);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float l = column_sum(st.l[c]);
            if ((lane >> 2) == 0) {
                sM[warp * kRows + h + c] = st.m[c];
                sL[warp * kRows + h + c] = l;
            }
        }
#pragma unroll
        for (int mt = 0; mt < D / 16; ++mt) {
            *reinterpret_cast<float2*>(sO + (warp * kRows + h) * D + d0 + 2 * mt) = make_float2(o[mt][0], o[mt][2]);
            *reinterpret_cast<float2*>(sO + (warp * kRows + h + 1) * D + d0 + 2 * mt) = make_float2(o[mt][1], o[mt][3]);
        }
    }
#pragma unroll
    for (int r = 0; r < 2 && !M::kSwapAB; ++r) {
        const float l = warp_reduce_sum<4>(st.l[r]);
        const int row = (lane >> 2) + 8 * r;
        if ((lane & 3) == 0) {
            sM[warp * C::kHeads + row] = st.m[r];
            sL[warp * C::kHeads + row] = l;
        }
        // column n of n-tile j at 8 j + n (over fp8 pages head-dim element n * D/8 + j: kv_fp8.cuh)
        float* dst = sO + (warp * C::kHeads + row) * D + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * r], o[j][2 * r + 1]);
    }
}

// Epilogue, second half: the warps' rows merged, normalized and written: the output with one
// split, else the split's partial and its log2-sum-exp.
template <class M>
__device__ __forceinline__ void decode_write_rows(const AttentionParams& p, const DecodeMmaBlock<M>& k,
                                                  float v_scale) {
    using C = typename M::C;
    using T = typename M::T;
    constexpr int D = M::D, kRows = M::kRows;
    const float* sO = reinterpret_cast<const float*>(k.smem);
    const float* sM = sO + C::kWarps * kRows * D;
    const float* sL = sM + C::kWarps * kRows;
    const int bh0 = k.b * p.q_heads + k.head0;
    // fp8 pages: O's factor, and the head-dim element of the accumulator at sO column c
    float o_factor = 1.f;
    if constexpr (M::kFp8) o_factor = v_scale;  // V's float16 values are exact (kv_fp8.cuh)
    for (int idx = k.tid; idx < k.nh * D; idx += C::kThreads) {
        const int row = idx / D, c = idx % D;
        const int d = M::kFp8 && !M::kSwapAB ? (c % 8) * (D / 8) + c / 8 : c;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < C::kWarps; ++w) m = fmaxf(m, sM[w * kRows + row]);
        const float base = m == -INFINITY ? 0.f : m;
        float acc = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < C::kWarps; ++w) {
            const float f = exp2f(sM[w * kRows + row] - base);
            acc += f * sO[(w * kRows + row) * D + c];
            l += f * sL[w * kRows + row];
        }
        const float inv = M::V::finish_split(p, [&] { return k.head0 + row; }, base, l);
        const float out = acc * inv * o_factor;
        if (p.num_splits == 1) {
            T* dst = static_cast<T*>(p.o) + int64_t(k.b) * p.o_stride_b + int64_t(k.head0 + row) * p.o_stride_h;
            dst[d] = Elem<T>::from_float(out);
        } else {
            const int64_t bh = int64_t(k.split) * p.batch * p.q_heads + bh0 + row;
            p.ws_o[bh * D + d] = out;
            if (d == 0) p.ws_lse[bh] = l > 0.f ? m + __log2f(l) : -INFINITY;
        }
    }
}

// Arrival of a split (p.ws_count set): the barrier orders every thread's partial stores before
// thread 0's fence (cumulative), so the unit's last arrival sees all num_splits partials.
// True in the block that arrived last, which then merges them.
template <class M>
__device__ __forceinline__ bool decode_arrive_last(const AttentionParams& p, const DecodeMmaBlock<M>& k, int& s_last) {
    __syncthreads();
    if (k.tid == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // release the block's partials
        const bool last = atomicAdd(p.ws_count + k.unit, 1) == p.num_splits - 1;
        if (last) {
            p.ws_count[k.unit] = 0;  // every split has arrived: ready for the next launch
            asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire the other partials
        }
        s_last = last;
    }
    __syncthreads();
    return s_last;
}

// V: the variant type (variant.cuh): UncappedVariant, or CappedVariant, whose soft-cap is compiled
// in: as a runtime branch the transform's registers spilled the d256 body at its 255; with ALiBi
// AlibiVariant (every variant from p, the 16-row form only).
// KvFmt: the pages' storage (kv_fp8.cuh): Kv16 (the compute dtype) or KvE4M3 / KvE5M2, whose
// bytes are converted into the fragments with the layer's scales p.k_scale / p.v_scale (no
// in-kernel append: the caller quantizes the step's token into the cache first).
// kSwapAB: over fp8 pages, for a GQA group of at most kSwapHeads heads, the swapped operands
// of decode_swap_ab.cuh (heads as the mma's n8 dimension); the loads and the split are the same.
// The body runs the stages above: the block's tiles; Q and the first K/V tiles in flight; per
// tile load, score, mask, softmax and accumulate; then the epilogue (the append's row, the
// warps' merge, the split's arrival).
template <typename T, int D, class KV, class V = UncappedVariant, class KvFmt = Kv16, bool kSwapAB = false>
__global__ void __launch_bounds__(DecodeMmaConfig<D, KvFmt::kBytes>::kThreads)
    decode_mma_kernel(const AttentionParams p) {
#if !defined(ASTRAI_NO_MMA) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
    using M = DecodeMma<T, D, KV, V, KvFmt, kSwapAB>;
    using C = typename M::C;
    constexpr bool kFp8 = M::kFp8;
    static_assert(kFp8 || !kSwapAB, "the swapped operands read fp8 pages");
    extern __shared__ __align__(128) uint8_t smem[];
    // The block: its unit, its tiles.
    DecodeMmaBlock<M> k;
    k.smem = smem;
    k.sK = smem_u32(smem);
    k.sV = k.sK + C::kStages * C::kTileBytes;
    k.sQ = k.sK + C::kQSmemOffset;

    k.tid = threadIdx.x, k.warp = k.tid / 32, k.lane = k.tid % 32;
    const DecodeUnit u = decode_unit<C::kHeads>(p);
    k.unit = u.unit, k.split = u.split, k.hgrp = u.hgrp, k.kvh = u.kvh, k.b = u.b, k.head0 = u.head0, k.nh = u.nh;

    k.kv_len = KV::kv_len(p, k.b);
    // Read beside kv_len (not after the Q copies): the first page-id read waits on both.
    k.req = KV::request(p, k.b);
    k.n_tiles = (k.kv_len + C::kBN - 1) / C::kBN;
    // The window's first key: the splits share the tiles from its tile on (none skipped without one).
    k.first_key = V::first_key(p, k.kv_len - 1);
    const int t_lo = k.first_key / C::kBN;
    const int per_split = (k.n_tiles - t_lo + p.num_splits - 1) / p.num_splits;
    k.t_begin = min(k.n_tiles, t_lo + k.split * per_split);
    k.t_end = min(k.n_tiles, k.t_begin + per_split);
    k.my_tiles = k.t_end - k.t_begin;
    k.new_pos = KV::kPaged && !M::kFp8 && p.k_new != nullptr ? k.kv_len - 1 : -1;

    // Load: the first page ids, the PDL wait, Q, the first K/V tiles in flight (DecodeKvLoader::start).
    typename DecodeKvLoader<M>::Ids hnd;
    typename DecodeKvLoader<M>::IdsAhead hnd_ahead;
    const DecodeKvLoader<M> ld(p, k, hnd, hnd_ahead);
    ld.start(p, k);

    // Q's fragments and the scores' scales.
    __shared__ float q_unit[C::kHeads];
    DecodeQRegs<M> q;
    decode_load_q<M>(k, q_unit, q);
    const uint8_t* mask = p.mask ? p.mask + int64_t(k.b) * p.mask_stride_b : nullptr;
    // fp8 pages: the layer's K / V scales of this kv head (per tensor: stride 0)
    const float k_scale = kFp8 ? __ldg(p.k_scale + k.kvh * p.kv_scale_stride) : 1.f;
    const float v_scale = kFp8 ? __ldg(p.v_scale + k.kvh * p.kv_scale_stride) : 1.f;
    float score_factor[2] = {1.f, 1.f}, row_scale_log2[2] = {p.scale_log2, p.scale_log2};
    if constexpr (kFp8) decode_fp8_score_scales<M>(p, k, q_unit, k_scale, score_factor, row_scale_log2);
    float o[M::kOTiles][4];
#pragma unroll
    for (int j = 0; j < M::kOTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    typename M::State st;

    for (int i = 0; i < k.my_tiles; ++i) {
        ld.next(p, k, i);
        const int stage = i % C::kStages;
        if constexpr (kSwapAB) {
            float s[1][4] = {{0.f, 0.f, 0.f, 0.f}};
            decode_swap_scores<M>(p, k, q, score_factor, mask, s, i, stage);
            float alpha[2];
            const bool rescale = swap_softmax_lazy(st, s[0], row_scale_log2, alpha);
            swap_output<D, KvFmt>(o, s[0], alpha, rescale, smem + (C::kStages + stage) * C::kTileBytes, k.warp, k.lane);
        } else {
            const uint32_t k_st = k.sK + stage * C::kTileBytes;
            const uint32_t v_st = k.sV + stage * C::kTileBytes;
            float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            uint32_t qa[4], kb[4];
            decode_scores<M>(p, k, q, score_factor, s, stage, k_st, qa, kb);
            decode_mask_scores<M>(p, k, mask, row_scale_log2, s, i);
            float alpha[2];
            // over fp8 pages O keeps its base until a row's max grows by more than the slack (mma_utils.cuh):
            // their conversions leave fewer issue slots (on 16-bit pages the lazy form spilled registers)
            bool rescale = true;
            if constexpr (kFp8) rescale = online_softmax_lazy<2>(st, s, row_scale_log2, alpha);
            else online_softmax<2>(st, s, p.scale_log2, alpha);
            decode_pv<M>(k, s, alpha, rescale, o, stage, v_st);
        }
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The next kernel (the combine, or the stream's next PDL launch) may be scheduled now;
    // it waits in griddepcontrol.wait until this grid has completed.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    if constexpr (KV::kPaged && !kFp8) decode_append_new_row<M>(p, k, ld);
    cp_async_wait<0>();
    __syncthreads();  // the ring is reused for the warp merge below

    decode_stash_warp<M>(k, o, st);
    __syncthreads();
    decode_write_rows<M>(p, k, v_scale);
    if (p.num_splits == 1 || p.ws_count == nullptr) return;

    __shared__ int s_last;
    if (!decode_arrive_last<M>(p, k, s_last)) return;
    decode_merge_splits<T, D, C::kThreads>(p, smem, C::kSmemBytes, k.b, k.head0, k.nh);
#endif
}

// Threads of a decode_combine_kernel block (its launch must use exactly this many).
constexpr int decode_combine_threads(int head_dim) { return head_dim < 128 ? head_dim : 128; }

// Merges the num_splits partials of one (request, query head) per block, with
// decode_combine_threads(D) threads. Every thread's partial loads (up to 32 splits at a
// time) are issued before the weights are known, beside the log2-sum-exp loads, so a merge
// of <= 32 splits costs one L2 round trip.
template <typename T, int D>
__global__ void __launch_bounds__(128) decode_combine_kernel(const AttentionParams p) {
    constexpr int kThreads = decode_combine_threads(D);
    constexpr int kCols = D / kThreads;  // output columns per thread
    constexpr int kChunk = 32;           // splits loaded per round
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the stream's next PDL launch
    asm volatile("griddepcontrol.wait;" ::: "memory");  // launched early (PDL): wait for the splits
#endif
    __shared__ float sw[kMaxDecodeSplits];
    const int tid = threadIdx.x;
    const int bh = blockIdx.x;
    const int b = bh / p.q_heads, h = bh % p.q_heads;
    const int S = p.num_splits;
    const int64_t stride = int64_t(p.batch) * p.q_heads;
    float v[kCols][kChunk];
    auto load = [&](int s0) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j)
#pragma unroll
            for (int c = 0; c < kCols; ++c)
                v[c][j] = s0 + j < S ? p.ws_o[((s0 + j) * stride + bh) * D + tid + c * kThreads] : 0.f;
    };
    load(0);
    for (int s = tid; s < S; s += kThreads) sw[s] = p.ws_lse[s * stride + bh];
    __syncthreads();
    if (tid < 32) split_weights_warp(sw, 1, S, tid, RuntimeVariant::sink(p, h));
    __syncthreads();
    float acc[kCols] = {};
    for (int s0 = 0; s0 < S; s0 += kChunk) {
        if (s0 > 0) load(s0);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (s0 + j < S) {
                const float w = sw[s0 + j];
#pragma unroll
                for (int c = 0; c < kCols; ++c) acc[c] = fmaf(w, v[c][j], acc[c]);
            }
        }
    }
    T* dst = static_cast<T*>(p.o) + int64_t(b) * p.o_stride_b + int64_t(h) * p.o_stride_h;
#pragma unroll
    for (int c = 0; c < kCols; ++c) dst[tid + c * kThreads] = Elem<T>::from_float(acc[c]);
}

}  // namespace astrai::attn
