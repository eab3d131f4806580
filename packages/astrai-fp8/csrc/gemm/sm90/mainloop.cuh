// Hopper FP8 mainloop: a kStages-deep shared-memory ring filled by TMA and drained by wgmma.
//
//   full[s]   count 1: the producer's arrive.expect_tx; completes when TMA has landed both
//             tiles of stage s (bytes counted, out-of-bounds parts zero-filled)
//   empty[s]  count kConsumerWarps: each consumer warp arrives once the wgmmas that read
//             stage s have completed
// The producer waits empty[s] with the flipped parity (a fresh barrier's previous phase
// counts as complete), the consumers wait full[s] with the ring's current parity.
//
// Accumulation: kPromote = false keeps one wgmma chain over all of K (the tensor core's
// own accumulator); kPromote = true restarts the chain every kBK = 128 of K and adds the
// partial sum into separate fp32 registers, which bounds the error at long K. To keep the
// tensor core busy while a warpgroup adds, the promoted loop splits the N columns into two
// half-width chains (lo, hi) and software-pipelines them: while the warpgroup adds lo(kb),
// hi(kb) is still running, and lo(kb + 1) is queued before hi(kb) is added
// (kSplitPromote; the plain promoted loop drains the chain every k-block instead).
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

    uint32_t a_ring, b_ring, full_bar, empty_bar;  // shared-memory addresses

    __device__ __forceinline__ explicit Mainloop(uint32_t base)
        : a_ring(base),
          b_ring(base + Cfg::kStages * Cfg::kABytes),
          full_bar(base + Cfg::kRingBytes),
          empty_bar(base + Cfg::kRingBytes + 8 * Cfg::kStages) {}

    __device__ __forceinline__ uint32_t full(int s) const { return full_bar + 8 * s; }
    __device__ __forceinline__ uint32_t empty(int s) const { return empty_bar + 8 * s; }

    __device__ __forceinline__ void init_barriers() const {
        for (int s = 0; s < Cfg::kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), Cfg::kConsumerWarps);
        }
        mbar_init_fence();
    }

    // Producer (one thread): all k-blocks of tile (tm, tn).
    __device__ __forceinline__ void load_tile(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                              int tm, int tn, int k_blocks,
                                              RingState& ring) const {
        for (int kb = 0; kb < k_blocks; ++kb) {
            const int s = ring.stage;
            mbar_wait(empty(s), ring.phase ^ 1u);
            mbar_arrive_expect_tx(full(s), Cfg::kStageBytes);
            tma_load_2d(a_ring + s * Cfg::kABytes, map_a, full(s), kb * Cfg::kBK, tm * Cfg::kBM);
            tma_load_2d(b_ring + s * Cfg::kBBytes, map_b, full(s), kb * Cfg::kBK, tn * Cfg::kBN);
            ring.advance<Cfg::kStages>();
        }
    }

    __device__ __forceinline__ void release(int s) const {
        if (threadIdx.x % 32 == 0) mbar_arrive(empty(s));
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

    // One half-width chain (columns [half * BN/2, (half + 1) * BN/2)) of stage s.
    using HalfMma = Wgmma<Cfg::kBN / 2, Cfg::kKindA, Cfg::kKindB>;
    static constexpr int H = R / 2;

    __device__ __forceinline__ void issue_half(float (&acc)[H], int s, int wg, int half) const {
        const uint64_t da = desc_k_major_sw128(a_ring + s * Cfg::kABytes + wg * 64 * Cfg::kBK);
        const uint64_t db = desc_k_major_sw128(b_ring + s * Cfg::kBBytes +
                                               half * (Cfg::kBN / 2) * Cfg::kBK);
        fence_regs(acc);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < Cfg::kKSteps; ++j) HalfMma::mma(acc, da + 2 * j, db + 2 * j, j == 0 ? 0u : 1u);
        wgmma_commit();
        fence_regs(acc);
    }

    template <int N>
    __device__ __forceinline__ static void add_into(float* sum, float (&part)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) sum[i] += part[i];
    }

    // Promoted sums with the two half chains pipelined (see the header). Invariant at the top
    // of iteration kb: the groups lo(kb), hi(kb) are the outstanding wgmma groups, in order.
    __device__ __forceinline__ void mma_tile_promoted(float (&acc)[R], float (&sum)[R], int wg,
                                                      int k_blocks, RingState& ring) const {
        float(&lo)[H] = *reinterpret_cast<float(*)[H]>(&acc[0]);
        float(&hi)[H] = *reinterpret_cast<float(*)[H]>(&acc[H]);
#pragma unroll
        for (int i = 0; i < R; ++i) sum[i] = 0.f;
        mbar_wait(full(ring.stage), ring.phase);
        issue_half(lo, ring.stage, wg, 0);
        issue_half(hi, ring.stage, wg, 1);
        // do-while: ptxas serializes the wgmmas when it sees a path that skips the loop.
        // Both waits are wait<1>; an empty commit group stands in for the chain that the
        // last k-block does not issue, so the older group is always the one retired.
        int kb = 0;
        do {
            const int s = ring.stage;
            const bool more = kb + 1 < k_blocks;
            ring.advance<Cfg::kStages>();
            wgmma_wait<1>();  // lo(kb) done, hi(kb) may run
            fence_regs(lo);
            add_into(&sum[0], lo);
            if (more) {
                mbar_wait(full(ring.stage), ring.phase);
                issue_half(lo, ring.stage, wg, 0);
            } else {
                wgmma_commit();
            }
            wgmma_wait<1>();  // hi(kb) done, lo(kb + 1) may run
            fence_regs(hi);
            add_into(&sum[H], hi);
            release(s);
            if (more) issue_half(hi, ring.stage, wg, 1);
        } while (++kb < k_blocks);
    }

    // Consumer warpgroup `wg` (0 or 1): the tile's sum over K into `out` (fp32).
    // `acc` is the wgmma chain's register block; with kPromote, `out` is a separate sum.
    __device__ __forceinline__ void mma_tile(float (&acc)[R], float (&out)[R], int wg,
                                             int k_blocks, RingState& ring) const {
        if constexpr (Cfg::kPromote && Cfg::kSplitPromote) {
            mma_tile_promoted(acc, out, wg, k_blocks, ring);
        } else if constexpr (Cfg::kPromote) {
#pragma unroll
            for (int i = 0; i < R; ++i) out[i] = 0.f;
            for (int kb = 0; kb < k_blocks; ++kb) {
                const int s = ring.stage;
                mbar_wait(full(s), ring.phase);
                issue(acc, s, wg, true);
                wgmma_wait<0>();
                fence_regs(acc);
                release(s);
                add_into(&out[0], acc);
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
