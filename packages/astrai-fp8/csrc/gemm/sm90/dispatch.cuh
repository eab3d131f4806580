// Host entry of the Hopper FP8 GEMM: device limits -> plan -> tensor maps -> launch.
//
//   GemmArgs a{...};
//   Result r = run_gemm(a, stream);   // r.error: "" on success, else why nothing ran
//                                     // r.plan.trace: every candidate and its verdict
// Instantiated configs: the rows of kTileConfigs (planning.h) x the four FP8 pairings.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "astrai/device.cuh"
#include "config.h"
#include "kernel.cuh"
#include "plan_cache.h"
#include "planning.h"
#include "tensor_map.h"

namespace astrai::fp8::sm90 {

struct GemmArgs {
    int64_t M = 0, N = 0, K = 0;
    const void* a = nullptr;  // fp8 [M, lda], K-major
    int64_t lda = 0;
    const void* b = nullptr;  // fp8 [N, ldb], K-major (the "TN" / trans_b layout)
    int64_t ldb = 0;
    void* out = nullptr;      // bf16 (or fp32) [M, ldc]
    int64_t ldc = 0;
    bool out_f32 = false;
    const void* bias = nullptr;    // bf16 [N] or nullptr
    const float* scale = nullptr;  // device scalar or nullptr
    const float* a_scale = nullptr;  // float32 [M] (one per row of a) or nullptr
    const float* b_scale = nullptr;  // float32 [N] (one per row of b) or nullptr
    Fp8Kind kind_a = Fp8Kind::E4M3, kind_b = Fp8Kind::E4M3;
    Accum accum = Accum::Promote;
    int force_config = -1;
};

struct Result {
    std::string error;         // "" when launched
    Plan plan;
    bool unavailable = false;  // the path cannot take this call (error says why): fall back
};

inline constexpr const char* kNoSm90Code = "this build holds no sm_90a code for the wgmma kernel";

inline std::string device_limits(DeviceLimits& d) {
    const cudaError_t e = query_current_device({{cudaDevAttrComputeCapabilityMajor, &d.cc_major},
                                                {cudaDevAttrComputeCapabilityMinor, &d.cc_minor},
                                                {cudaDevAttrMultiProcessorCount, &d.num_sms},
                                                {cudaDevAttrMaxSharedMemoryPerBlockOptin, &d.smem_optin}});
    return e == cudaSuccess ? "" : std::string("device query failed: ") + cudaGetErrorString(e);
}

// The kernel body exists only in sm_90a device code (astrai::built_for_sm90(), device.cuh):
// without it there is nothing to launch. A stub compiled for plain sm_90 / PTX traps
// (kernel.cuh) instead of returning garbage; build with 90a, as the plugin's arch lists do.
template <class Cfg>
std::string launch(const GemmArgs& a, const Plan& plan, cudaStream_t stream) {
    if constexpr (!built_for_sm90()) return kNoSm90Code;
    // swap-AB: the weight b [N, K] is the kernel's A operand, the activations its B
    constexpr bool S = Cfg::kSwapAB;
    const void* ka = S ? a.b : a.a;
    const void* kb = S ? a.a : a.b;
    const int64_t km = S ? a.N : a.M, kn = S ? a.M : a.N;
    CUtensorMap map_a, map_b;
    std::string err = encode_fp8_k_major(&map_a, ka, km, a.K, S ? a.ldb : a.lda, Cfg::kBM);
    if (err.empty())
        err = encode_fp8_k_major(&map_b, kb, kn, a.K, S ? a.lda : a.ldb, Cfg::kBN / Cfg::kClusterM);
    if (!err.empty()) return err;

    GemmParams p{};
    p.M = static_cast<int>(km);  // the kernel's dimensions; the epilogue transposes when S
    p.N = static_cast<int>(kn);
    p.K = static_cast<int>(a.K);
    p.tiles_m = plan.tiles_m;
    p.tiles_n = plan.tiles_n;
    p.num_tiles = plan.num_tiles;
    p.k_blocks = plan.k_blocks;
    p.group_m = plan.group_m;
    p.out = a.out;
    p.ldc = a.ldc;
    p.out_f32 = a.out_f32 ? 1 : 0;
    const uint64_t align = a.out_f32 ? 8 : 4;
    p.vec_store = (a.ldc % 2 == 0 && reinterpret_cast<uint64_t>(a.out) % align == 0) ? 1 : 0;
    p.bias = a.bias;
    p.scale = a.scale;
    p.row_scale = S ? a.b_scale : a.a_scale;
    p.col_scale = S ? a.a_scale : a.b_scale;
    p.k_per_split = plan.k_per_split;

    auto kernel = fp8_gemm_sm90_kernel<Cfg>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Cfg::kSmemBytes);
    if (e != cudaSuccess) return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3(static_cast<unsigned>(plan.grid));
    lc.blockDim = dim3(Cfg::kThreads);
    lc.dynamicSmemBytes = Cfg::kSmemBytes;
    lc.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    // split-K: one cluster of plan.split CTAs per tile, plan.grid = tiles x split (no CTA loops)
    attr[0].val.clusterDim.x = Cfg::kSplitK ? plan.split : Cfg::kClusterM;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    lc.attrs = attr;
    lc.numAttrs = Cfg::kClusterM > 1 || Cfg::kSplitK ? 1 : 0;
    if constexpr (Cfg::kClusterM > 1) {
        // clusters live inside one GPC: how many fit at once is the device's answer, not
        // num_sms / 2; the persistent grid is that many (or the number of tile groups)
        int clusters = 0;
        e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &lc);
        if (e != cudaSuccess || clusters <= 0)
            return std::string("cudaOccupancyMaxActiveClusters: ") + cudaGetErrorString(e);
        const int groups = clusters < plan.num_tiles ? clusters : plan.num_tiles;
        lc.gridDim = dim3(static_cast<unsigned>(groups * Cfg::kClusterM));
    }
    e = cudaLaunchKernelEx(&lc, kernel, map_a, map_b, p);
    if (e == cudaSuccess) e = cudaGetLastError();
    return e == cudaSuccess ? "" : std::string("launch: ") + cudaGetErrorString(e);
}

template <Fp8Kind KA, Fp8Kind KB>
std::string launch_config(const GemmArgs& a, const Plan& plan, cudaStream_t stream) {
    switch (plan.config) {
        case 0: return launch<GemmConfig<256, 4, false, 1, KA, KB>>(a, plan, stream);
        case 1: return launch<GemmConfig<192, 5, true, 1, KA, KB>>(a, plan, stream);
        case 2: return launch<GemmConfig<128, 6, true, 1, KA, KB>>(a, plan, stream);
        case 3: return launch<GemmConfig<128, 6, false, 1, KA, KB>>(a, plan, stream);
        case 4: return launch<GemmConfig<256, 4, false, 2, KA, KB>>(a, plan, stream);
        case 5: return launch<GemmConfig<192, 5, true, 2, KA, KB>>(a, plan, stream);
        case 6: return launch<GemmConfig<128, 6, false, 2, KA, KB>>(a, plan, stream);
        case 7: return launch<GemmConfig<128, 6, true, 2, KA, KB>>(a, plan, stream);
        // swap-AB: the kernel's A operand is b, so the formats swap too
        case 8: return launch<GemmConfig<16, 12, true, 1, KB, KA, true>>(a, plan, stream);
        case 9: return launch<GemmConfig<16, 12, false, 1, KB, KA, true>>(a, plan, stream);
        case 10: return launch<GemmConfig<32, 11, true, 1, KB, KA, true>>(a, plan, stream);
        case 11: return launch<GemmConfig<32, 11, false, 1, KB, KA, true>>(a, plan, stream);
        case 12: return launch<GemmConfig<64, 9, true, 1, KB, KA, true>>(a, plan, stream);
        case 13: return launch<GemmConfig<64, 9, false, 1, KB, KA, true>>(a, plan, stream);
        case 14: return launch<GemmConfig<128, 6, 2, 1, KA, KB>>(a, plan, stream);
        case 15: return launch<GemmConfig<16, 12, true, 1, KB, KA, true, true>>(a, plan, stream);
        case 16: return launch<GemmConfig<32, 11, true, 1, KB, KA, true, true>>(a, plan, stream);
        case 17: return launch<GemmConfig<64, 9, true, 1, KB, KA, true, true>>(a, plan, stream);
        default: return "unknown tile config " + std::to_string(plan.config);
    }
}

inline Result run_gemm(const GemmArgs& a, cudaStream_t stream) {
    Result r;
    DeviceLimits d;
    r.error = device_limits(d);
    if (!r.error.empty()) return r;
    ProblemShape s;
    s.M = a.M;
    s.N = a.N;
    s.K = a.K;
    s.lda = a.lda;
    s.ldb = a.ldb;
    s.a_addr = reinterpret_cast<uint64_t>(a.a);
    s.b_addr = reinterpret_cast<uint64_t>(a.b);
    r.plan = cached_plan(s, d, a.accum, a.force_config);
    if (!r.plan.ok) {
        r.error = r.plan.trace;
        r.unavailable = true;
        return r;
    }
    using K = Fp8Kind;
    if (a.kind_a == K::E4M3 && a.kind_b == K::E4M3)
        r.error = launch_config<K::E4M3, K::E4M3>(a, r.plan, stream);
    else if (a.kind_a == K::E5M2 && a.kind_b == K::E4M3)
        r.error = launch_config<K::E5M2, K::E4M3>(a, r.plan, stream);
    else if (a.kind_a == K::E4M3 && a.kind_b == K::E5M2)
        r.error = launch_config<K::E4M3, K::E5M2>(a, r.plan, stream);
    else
        r.error = launch_config<K::E5M2, K::E5M2>(a, r.plan, stream);
    r.unavailable = r.error == kNoSm90Code;
    return r;
}

}  // namespace astrai::fp8::sm90
