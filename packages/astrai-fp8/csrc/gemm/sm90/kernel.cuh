// The warp-specialized persistent Hopper FP8 GEMM kernel: mainloop + epilogue + scheduler.
//   warpgroup 0     setmaxnreg.dec; thread 0 streams every tile's k-blocks through TMA
//   warpgroups 1-2  setmaxnreg.inc; wgmma over their 64-row halves, then the epilogue
// Both roles walk the same persistent tile sequence, so the ring's stage / parity state
// stays in step without any other communication. With a cluster of kClusterM CTAs, the
// schedule hands out column-aligned groups of kClusterM vertically adjacent tiles
// (p.tiles_m counts those groups); CTA rank r of the cluster takes row r of its group.
// Split-K (kSplitK): the launch gives each tile a cluster of its own (grid = tiles x cluster
// size, so no CTA loops); rank r sums its range of K, then reduce_split brings the partial
// sums to rank 0, which writes the tile.
#pragma once

#include <cuda.h>

#include "epilogue.cuh"
#include "mainloop.cuh"
#include "params.h"
#include "scheduler.cuh"

namespace astrai::fp8::sm90 {

// Split-K's meeting of the partial tiles: after every CTA of the cluster has drained its ring
// (all TMA loads landed, all wgmmas done), ranks 1.. store their sums into rank 0's ring
// (slot rank - 1, float4 per consumer thread, consecutive threads at consecutive 16 bytes),
// and rank 0 adds them to its own in rank order. Called by both consumer warpgroups of every
// CTA; the producer warpgroup meets the same two cluster barriers (cluster_sync_twice).
template <class Cfg>
__device__ __forceinline__ void reduce_split(float (&sum)[Cfg::kAccRegs], uint32_t rank, uint32_t ranks,
                                             const uint8_t* ring, uint32_t ring_addr) {
    constexpr int V = Cfg::kAccRegs / 4;
    constexpr int kConsumers = 128 * Cfg::kConsumerWGs;
    const int t = static_cast<int>(threadIdx.x) - 128;
    fence_proxy_async_shared();
    cluster_sync();  // rank 0's ring is free: every stage it loaded has been read
    if (rank > 0) {
        const uint32_t slot = map_to_cta(ring_addr + (rank - 1) * Cfg::kPartialBytes, 0);
#pragma unroll
        for (int i = 0; i < V; ++i)
            st_cluster_v4(slot + 16 * (i * kConsumers + t), sum[4 * i], sum[4 * i + 1], sum[4 * i + 2],
                          sum[4 * i + 3]);
    }
    cluster_sync();  // the partial tiles have landed in rank 0
    if (rank == 0) {
        for (uint32_t r = 1; r < ranks; ++r) {
            const float4* slot = reinterpret_cast<const float4*>(ring + (r - 1) * Cfg::kPartialBytes);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float4 v = slot[i * kConsumers + t];
                sum[4 * i] += v.x;
                sum[4 * i + 1] += v.y;
                sum[4 * i + 2] += v.z;
                sum[4 * i + 3] += v.w;
            }
        }
    }
}

// The producer warpgroup's side of reduce_split's two cluster barriers.
__device__ __forceinline__ void cluster_sync_twice() {
    __syncwarp();
    cluster_sync();
    cluster_sync();
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fp8_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b, const GemmParams p) {
#if ASTRAI_SM90_ENABLED
    constexpr int CM = Cfg::kClusterM;
    constexpr bool SK = Cfg::kSplitK;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t rank = CM > 1 || SK ? cluster_ctarank() : 0u;
    const uint32_t ranks = SK ? cluster_size() : 1u;  // split-K: CTAs sharing a tile
    const Mainloop<Cfg> ml(base, CM > 1 ? rank : 0u);
    const TileScheduler sched{p.tiles_m, p.tiles_n, p.group_m};
    const int wg = threadIdx.x / 128;
    const int per_group = CM * static_cast<int>(ranks);
    const int first = blockIdx.x / per_group, stride = gridDim.x / per_group;
    // this CTA's k-blocks of each tile: all of them, or its rank's range under split-K (none
    // for a cluster past the last tile: its ranks still meet at reduce_split's barriers)
    const int kb0 = SK ? static_cast<int>(rank) * p.k_per_split : 0;
    const int k_blocks = !SK ? p.k_blocks
                         : first < p.num_tiles ? max(0, min(p.k_per_split, p.k_blocks - kb0))
                                               : 0;

    if (threadIdx.x == 0) ml.init_barriers();
    if constexpr (CM > 1) {
        cluster_sync();  // the peer's barriers exist before any multicast or remote arrive
    } else {
        __syncthreads();
    }

    if (wg == 0) {
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if (threadIdx.x == 0) {
            tma_prefetch_map(&map_a);
            tma_prefetch_map(&map_b);
            RingState ring;
            for (int t = first; t < p.num_tiles; t += stride) {
                int tg, tn;
                sched.coords(t, tg, tn);
                ml.load_tile(&map_a, &map_b, tg * CM + static_cast<int>(CM > 1 ? rank : 0u), tn, kb0, k_blocks,
                             ring);
            }
        }
        if constexpr (SK) cluster_sync_twice();
    } else {
        setmaxnreg_inc<Cfg::kConsumerRegs>();
        const int cw = wg - 1;
        const float scale = p.scale != nullptr ? *p.scale : 1.f;
        float acc[Cfg::kAccRegs];
        float sum[Cfg::kPromote ? Cfg::kAccRegs : 1];
        float acc2[Cfg::kPromotePipe ? Cfg::kAccRegs : 1];
        RingState ring;
        if constexpr (SK) {
            // one tile per cluster (the launch's grid), so the drained ring can take partials
            int tg = 0, tn = 0;
            sched.coords(first, tg, tn);
            ml.mma_tile(acc, sum, cw, k_blocks, ring);
            reduce_split<Cfg>(sum, rank, ranks, smem_raw + (base - smem_addr(smem_raw)), base);
            if (rank == 0 && first < p.num_tiles)
                Epilogue<Cfg::kBN, true>::store(p, sum, tg * Cfg::kBM + cw * Cfg::kRowsPerWG, tn * Cfg::kBN,
                                                scale);
        } else {
            for (int t = first; t < p.num_tiles; t += stride) {
                int tg, tn;
                sched.coords(t, tg, tn);
                const int tm = tg * CM + static_cast<int>(rank);
                const int row_base = tm * Cfg::kBM + cw * Cfg::kRowsPerWG;
                const int col_base = tn * Cfg::kBN;
                if constexpr (Cfg::kPromotePipe) {
                    ml.mma_tile_pipelined(acc, acc2, sum, cw, p.k_blocks, ring);
                    Epilogue<Cfg::kBN, Cfg::kSwapAB>::store(p, sum, row_base, col_base, scale);
                } else if constexpr (Cfg::kPromote) {
                    ml.mma_tile(acc, sum, cw, p.k_blocks, ring);
                    Epilogue<Cfg::kBN, Cfg::kSwapAB>::store(p, sum, row_base, col_base, scale);
                } else {
                    ml.mma_tile(acc, acc, cw, p.k_blocks, ring);
                    Epilogue<Cfg::kBN, Cfg::kSwapAB>::store(p, acc, row_base, col_base, scale);
                }
            }
        }
    }
    if constexpr (CM > 1) {
        __syncwarp();
        cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // device code built without sm_90a: fail loudly, never a silent no-op
#endif
}

}  // namespace astrai::fp8::sm90
