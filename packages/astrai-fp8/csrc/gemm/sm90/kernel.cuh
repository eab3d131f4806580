// The warp-specialized persistent Hopper FP8 GEMM kernel: mainloop + epilogue + scheduler.
//   warpgroup 0     setmaxnreg.dec; thread 0 streams every tile's k-blocks through TMA
//   warpgroups 1-2  setmaxnreg.inc; wgmma over their 64-row halves, then the epilogue
// Both roles walk the same persistent tile sequence, so the ring's stage / parity state
// stays in step without any other communication. With a cluster of kClusterM CTAs, the
// schedule hands out column-aligned groups of kClusterM vertically adjacent tiles
// (p.tiles_m counts those groups); CTA rank r of the cluster takes row r of its group.
#pragma once

#include <cuda.h>

#include "epilogue.cuh"
#include "mainloop.cuh"
#include "params.h"
#include "scheduler.cuh"

namespace astrai::fp8::sm90 {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fp8_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b, const GemmParams p) {
#if ASTRAI_SM90_ENABLED
    constexpr int CM = Cfg::kClusterM;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t rank = CM > 1 ? cluster_ctarank() : 0u;
    const Mainloop<Cfg> ml(base, rank);
    const TileScheduler sched{p.tiles_m, p.tiles_n, p.group_m};
    const int wg = threadIdx.x / 128;
    const int first = blockIdx.x / CM, stride = gridDim.x / CM;

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
                ml.load_tile(&map_a, &map_b, tg * CM + static_cast<int>(rank), tn, p.k_blocks, ring);
            }
        }
    } else {
        setmaxnreg_inc<Cfg::kConsumerRegs>();
        const int cw = wg - 1;
        const float scale = p.scale != nullptr ? *p.scale : 1.f;
        float acc[Cfg::kAccRegs];
        float sum[Cfg::kPromote ? Cfg::kAccRegs : 1];
        float acc2[Cfg::kPromotePipe ? Cfg::kAccRegs : 1];
        RingState ring;
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
    if constexpr (CM > 1) {
        __syncwarp();
        cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // device code built without sm_90a: fail loudly, never a silent no-op
#endif
}

}  // namespace astrai::fp8::sm90
