// The warp-specialized persistent Hopper FP8 GEMM kernel: mainloop + epilogue + scheduler.
//   warpgroup 0     setmaxnreg.dec; thread 0 streams every tile's k-blocks through TMA
//   warpgroups 1-2  setmaxnreg.inc; wgmma over their 64-row halves, then the epilogue
// Both roles walk the same persistent tile sequence (blockIdx.x, + gridDim.x, ...), so the
// ring's stage / parity state stays in step without any other communication.
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
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const Mainloop<Cfg> ml(base);
    const TileScheduler sched{p.tiles_m, p.tiles_n, p.group_m};
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) ml.init_barriers();
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if (threadIdx.x == 0) {
            tma_prefetch_map(&map_a);
            tma_prefetch_map(&map_b);
            RingState ring;
            for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x) {
                int tm, tn;
                sched.coords(t, tm, tn);
                ml.load_tile(&map_a, &map_b, tm, tn, p.k_blocks, ring);
            }
        }
    } else {
        setmaxnreg_inc<Cfg::kConsumerRegs>();
        const int cw = wg - 1;
        const float scale = p.scale != nullptr ? *p.scale : 1.f;
        float acc[Cfg::kAccRegs];
        float sum[Cfg::kPromote ? Cfg::kAccRegs : 1];
        RingState ring;
        for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x) {
            int tm, tn;
            sched.coords(t, tm, tn);
            const int row_base = tm * Cfg::kBM + cw * Cfg::kRowsPerWG;
            const int col_base = tn * Cfg::kBN;
            if constexpr (Cfg::kPromote) {
                ml.mma_tile(acc, sum, cw, p.k_blocks, ring);
                Epilogue<Cfg::kBN>::store(p, sum, row_base, col_base, scale);
            } else {
                ml.mma_tile(acc, acc, cw, p.k_blocks, ring);
                Epilogue<Cfg::kBN>::store(p, acc, row_base, col_base, scale);
            }
        }
    }
#endif
}

}  // namespace astrai::fp8::sm90
