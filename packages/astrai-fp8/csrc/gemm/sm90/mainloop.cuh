// Hopper FP8 mainloop: a kStages-deep shared-memory ring filled by TMA and drained by wgmma.
//
//   full[s]   count 1: the producer's arrive.expect_tx; completes when TMA has landed both
//             tiles of stage s (bytes counted, out-of-bounds parts zero-filled)
//   empty[s]  count kConsumerWarps * kClusterM: each consumer warp of every CTA that reads
//             this CTA's loads arrives once the wgmmas that read stage s have completed
// The producer waits empty[s] with the flipped parity (a fresh barrier's previous phase
// counts as complete), the consumers wait full[s] with the ring's current parity.
//
// Cluster of 2 (kClusterM = 2): the two CTAs work on vertically adjacent tiles with the same
// B columns. Each loads its own A tile and one half of the B tile, multicast into both CTAs'
// stage s (completing on both full[s]); so a stage may be refilled only when the consumers
// of both CTAs have released it, and each consumer warp arrives on both CTAs' empty[s].
//
// Accumulation: kPromote = false keeps one wgmma chain over all of K (the tensor core's
// own accumulator); kPromote = true restarts the chain every kBK = 128 of K and adds the
// partial sum into separate fp32 registers, which bounds the error at long K.
#pragma once

#include <cstdint>

#include "ptx.cuh"
#include "wgmma_fp8.cuh"

namespace astrai::fp8::sm90 {

struct RingState {
    int stage = 0;
    uint32_t phase = 0;
    template <int Stages>
    __device__ __forceinline__ void advance() {
        if (++stage == Stages) {
            stage = 0;
            phase ^= 1u;
        }
    }
};

template <class Cfg>
struct Mainloop {
    using Mma = Wgmma<Cfg::kBN, Cfg::kKindA, Cfg::kKindB>;
    static constexpr int R = Cfg::kAccRegs;
    static constexpr int kBHalfRows = Cfg::kBN / Cfg::kClusterM;  // B rows this CTA loads

    uint32_t a_ring, b_ring, full_bar, empty_bar;  // shared-memory addresses
    uint32_t rank;                                 // CTA rank in the cluster (0 without one)

    __device__ __forceinline__ Mainloop(uint32_t base, uint32_t cta_rank)
        : a_ring(base),
          b_ring(base + Cfg::kStages * Cfg::kABytes),
          full_bar(base + Cfg::kRingBytes),
          empty_bar(base + Cfg::kRingBytes + 8 * Cfg::kStages),
          rank(cta_rank) {}

    __device__ __forceinline__ uint32_t full(int s) const { return full_bar + 8 * s; }
    __device__ __forceinline__ uint32_t empty(int s) const { return empty_bar + 8 * s; }

    __device__ __forceinline__ void init_barriers() const {
        for (int s = 0; s < Cfg::kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), Cfg::kConsumerWarps * Cfg::kClusterM);
        }
        mbar_init_fence();
    }

    // Producer (one thread): k-blocks [kb0, kb0 + k_blocks) of tile (tm, tn).
    __device__ __forceinline__ void load_tile(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                              int tm, int tn, int kb0, int k_blocks,
                                              RingState& ring) const {
        for (int kb = kb0; kb < kb0 + k_blocks; ++kb) {
            const int s = ring.stage;
            if constexpr (Cfg::kClusterM > 1) {
                while (!mbar_try_wait_cluster(empty(s), ring.phase ^ 1u)) {
                }
            } else {
                mbar_wait(empty(s), ring.phase ^ 1u);
            }
            mbar_arrive_expect_tx(full(s), Cfg::kStageBytes);
            tma_load_2d(a_ring + s * Cfg::kABytes, map_a, full(s), kb * Cfg::kBK, tm * Cfg::kBM);
            const uint32_t b_dst = b_ring + s * Cfg::kBBytes + rank * kBHalfRows * Cfg::kBK;
            const int b_row = tn * Cfg::kBN + static_cast<int>(rank) * kBHalfRows;
            if constexpr (Cfg::kClusterM > 1) {
                tma_load_2d_multicast(b_dst, map_b, full(s), kb * Cfg::kBK, b_row,
                                      static_cast<uint16_t>((1u << Cfg::kClusterM) - 1u));
            } else {
                tma_load_2d(b_dst, map_b, full(s), kb * Cfg::kBK, b_row);
            }
            ring.advance<Cfg::kStages>();
        }
    }

    __device__ __forceinline__ void release(int s) const {
        if (threadIdx.x % 32 == 0) {
            mbar_arrive(empty(s));
            if constexpr (Cfg::kClusterM > 1) mbar_arrive_remote(map_to_cta(empty(s), rank ^ 1u));
        }
    }

    __device__ __forceinline__ void issue(float (&acc)[R], int s, int wg, bool zero_first) const {
        const uint64_t da = desc_k_major_sw128(a_ring + s * Cfg::kABytes + wg * 64 * Cfg::kBK);
        const uint64_t db = desc_k_major_sw128(b_ring + s * Cfg::kBBytes);
        fence_regs(acc);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < Cfg::kKSteps; ++j) {
            // +32 bytes of K per step: +2 in the descriptor's 16-byte address units
            Mma::mma(acc, da + 2 * j, db + 2 * j, (zero_first && j == 0) ? 0u : 1u);
        }
        wgmma_commit();
        fence_regs(acc);
    }

    // One step of the pipelined promotion: k-block `kb` into `next` while the previous
    // block's chain (in `done`, stage `prev`) completes and is added into `out`.
    __device__ __forceinline__ void pipe_step(float (&next)[R], float (&done)[R], float (&out)[R],
                                              int wg, int& prev, RingState& ring) const {
        const int s = ring.stage;
        mbar_wait(full(s), ring.phase);
        issue(next, s, wg, true);
        wgmma_wait<1>();  // `done`'s wgmmas have completed; `next`'s may still run
        fence_regs(done);
        release(prev);
#pragma unroll
        for (int i = 0; i < R; ++i) out[i] += done[i];
        prev = s;
        ring.advance<Cfg::kStages>();
    }

    // Promotion with two chains in turn (kPromotePipe): same sums as mma_tile's promote
    // path, but the tensor core always has the next k-block queued while one is added.
    __device__ __forceinline__ void mma_tile_pipelined(float (&a0)[R], float (&a1)[R],
                                                       float (&out)[R], int wg, int k_blocks,
                                                       RingState& ring) const {
#pragma unroll
        for (int i = 0; i < R; ++i) out[i] = 0.f;
        int prev = ring.stage;
        mbar_wait(full(prev), ring.phase);
        issue(a0, prev, wg, true);
        ring.advance<Cfg::kStages>();
        int kb = 1;
        for (; kb + 1 < k_blocks; kb += 2) {
            pipe_step(a1, a0, out, wg, prev, ring);
            pipe_step(a0, a1, out, wg, prev, ring);
        }
        if (kb < k_blocks) {
            pipe_step(a1, a0, out, wg, prev, ring);
            wgmma_wait<0>();
            fence_regs(a1);
            release(prev);
#pragma unroll
            for (int i = 0; i < R; ++i) out[i] += a1[i];
        } else {
            wgmma_wait<0>();
            fence_regs(a0);
            release(prev);
#pragma unroll
            for (int i = 0; i < R; ++i) out[i] += a0[i];
        }
    }

    // Consumer warpgroup `wg` (0 or 1): the tile's sum over K into `out` (fp32).
    // `acc` is the wgmma chain's register block; with kPromote, `out` is a separate sum.
    __device__ __forceinline__ void mma_tile(float (&acc)[R], float (&out)[R], int wg,
                                             int k_blocks, RingState& ring) const {
        if constexpr (Cfg::kPromote) {
#pragma unroll
            for (int i = 0; i < R; ++i) out[i] = 0.f;
            for (int kb = 0; kb < k_blocks; ++kb) {
                const int s = ring.stage;
                mbar_wait(full(s), ring.phase);
                issue(acc, s, wg, true);
                wgmma_wait<0>();
                fence_regs(acc);
                release(s);
#pragma unroll
                for (int i = 0; i < R; ++i) out[i] += acc[i];
                ring.advance<Cfg::kStages>();
            }
        } else {
            int prev = 0;
            for (int kb = 0; kb < k_blocks; ++kb) {
                const int s = ring.stage;
                mbar_wait(full(s), ring.phase);
                issue(acc, s, wg, kb == 0);
                wgmma_wait<1>();  // the previous k-block's wgmmas are done: free its stage
                fence_regs(acc);
                if (kb > 0) release(prev);
                prev = s;
                ring.advance<Cfg::kStages>();
            }
            wgmma_wait<0>();
            fence_regs(acc);
            release(prev);
        }
    }
};

}  // namespace astrai::fp8::sm90
