// Compile-time configuration of the Hopper FP8 GEMM: one struct per tile shape, every
// derived size computed here and checked by static_assert (host and device).
//
//   CTA tile kBM x kBN x kBK = 128 x BN x 128 (128 fp8 = one 128-byte swizzle row of K)
//   warpgroup 0: producer (one thread issues TMA), warpgroups 1..2: consumers, each owning
//   64 rows x BN columns of the tile (one m64nBNk32 wgmma per 32 of K)
//   shared memory: kStages x (A 128x128 + B BNx128) bytes, then full / empty mbarriers
//   kClusterM = 2: two CTAs on vertically adjacent tiles; each loads half of the shared B
//   tile and multicasts it to both, halving B's L2 -> SM traffic
//   kSwapAB (small M): the kernel's A operand is the weight [N, K] and its B operand the
//   activations [M, K], so the 64-row wgmma side runs over N and the narrow wgmma N
//   (16..64) covers the few tokens; the epilogue writes the tile transposed
//   kSplitK (swap-AB only): a cluster of 2-4 CTAs (the count is the launch's) shares one
//   tile, each summing its own range of K; the partial sums meet in rank 0's shared memory
//   (distributed shared memory, written into its drained ring), which runs the epilogue.
//   For N too short to give every SM a tile of weights to stream
#pragma once

#include "fp8_format.h"
#include "planning.h"

namespace astrai::fp8::sm90 {

template <int BN, int Stages, int Promote, int ClusterM, Fp8Kind KindA, Fp8Kind KindB,
          bool SwapAB = false, bool SplitK = false>
struct GemmConfig {
    static constexpr int kBM = 128;
    static constexpr int kBN = BN;
    static constexpr int kBK = 128;
    static constexpr int kStages = Stages;
    static constexpr bool kPromote = Promote != 0;  // fp32 register sum every kBK of K
    // Promote == 2: two wgmma accumulators in turn, so the next k-block's wgmmas run while
    // the previous block's partial sum is added (no wait_group 0 inside the loop)
    static constexpr bool kPromotePipe = Promote == 2;
    static constexpr int kClusterM = ClusterM;  // CTAs along M sharing each B tile (TMA multicast)
    static constexpr Fp8Kind kKindA = KindA;  // of the kernel's A operand (the weight if kSwapAB)
    static constexpr Fp8Kind kKindB = KindB;
    static constexpr bool kSwapAB = SwapAB;
    static constexpr bool kSplitK = SplitK;
    static constexpr int kMaxSplit = kMaxSplitK;  // CTAs of a split-K cluster (the planner's bound)

    static constexpr int kWgmmaK = 32;
    static constexpr int kKSteps = kBK / kWgmmaK;
    static constexpr int kConsumerWGs = 2;
    static constexpr int kThreads = 128 * (1 + kConsumerWGs);
    static constexpr int kConsumerWarps = 4 * kConsumerWGs;
    static constexpr int kRowsPerWG = kBM / kConsumerWGs;

    static constexpr int kABytes = kBM * kBK;
    static constexpr int kBBytes = kBN * kBK;
    static constexpr int kStageBytes = kABytes + kBBytes;
    static constexpr int kRingBytes = kStages * kStageBytes;
    static constexpr int kBarrierBytes = 2 * kStages * 8;
    static constexpr int kAlignSlack = 1024;  // dynamic smem base rounded up to 1024 B
    static constexpr int kSmemBytes = kRingBytes + kBarrierBytes + kAlignSlack;

    static constexpr int kAccRegs = kBN / 2;  // fp32 accumulators per consumer thread
    // one CTA's fp32 partial tile, as its consumer threads hold it
    static constexpr int kPartialBytes = kBM * kBN * 4;
    static constexpr int kProducerRegs = 40;
    static constexpr int kConsumerRegs = 232;

    static_assert(kRowsPerWG == 64, "a consumer warpgroup owns one m64 wgmma row block");
    static_assert(kBN % 16 == 0 && kBN >= 16 && kBN <= 256, "wgmma N: 16..256, 16-granular here");
    static_assert(!kSwapAB || (kClusterM == 1 && kBN <= 64), "swap-AB: narrow tiles, no cluster");
    static_assert(!kSplitK || (kSwapAB && kPromote), "split-K: swap-AB tiles with promoted sums");
    static_assert(!kSplitK || (kMaxSplit - 1) * kPartialBytes <= kRingBytes,
                  "rank 0's ring holds the other ranks' partial tiles");
    static_assert(kAccRegs % 4 == 0, "partial tiles move as float4");
    static_assert(kBN <= 256, "TMA box rows <= 256");
    static_assert(kBK == 128, "one 128-byte swizzle row of fp8 per k-block");
    static_assert(kClusterM == 1 || kClusterM == 2, "cluster of 1 or 2 CTAs along M");
    static_assert((kBN / kClusterM) % 8 == 0, "each CTA multicasts whole 8-row swizzle atoms of B");
    static_assert(kStages >= 2 && kStages <= 12, "ring depth");
    static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "1024-byte aligned stage tiles");
    static_assert(Promote >= 0 && Promote <= 2, "accumulation: 0 fast, 1 promote, 2 pipelined");
    static_assert(kAccRegs * (kPromotePipe ? 3 : kPromote ? 2 : 1) <= 200,
                  "accumulators must fit the consumer cap");
    static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <= 65536,
                  "register file split between warpgroups");
    static_assert(kSmemBytes <= 232448, "over the sm_90 shared-memory opt-in limit");
};

}  // namespace astrai::fp8::sm90
