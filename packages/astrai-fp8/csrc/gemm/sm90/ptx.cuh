// Hopper (sm_90a) PTX primitives used by the FP8 wgmma mainloop, beside the ones both plugins
// share (astrai/sm90.cuh: mbarrier init / arrive / wait, wgmma fence / commit / wait,
// setmaxnreg), which are brought into this namespace:
//   mbarrier      arrive.expect_tx, cluster-scope try_wait
//   TMA           cp.async.bulk.tensor.2d global -> shared, completing on an mbarrier
//                 (and its cluster multicast form)
//   clusters      rank, size, cluster barrier, mapa + remote mbarrier arrive, remote stores
//   wgmma         accumulator register fences and the shared-memory descriptor
// Everything here is device code; callers guard it with ASTRAI_SM90_ENABLED.
#pragma once

#include <cuda.h>  // CUtensorMap (type only: nothing from libcuda is linked)

#include <cstdint>

#include "astrai/sm90.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ASTRAI_SM90_ENABLED 1
#else
#define ASTRAI_SM90_ENABLED 0
#endif

namespace astrai::fp8::sm90 {

using astrai::sm90::mbar_arrive;
using astrai::sm90::mbar_arrive_expect_tx;
using astrai::sm90::mbar_init;
using astrai::sm90::mbar_init_fence;
using astrai::sm90::mbar_try_wait;
using astrai::sm90::mbar_wait;
using astrai::sm90::setmaxnreg_dec;
using astrai::sm90::setmaxnreg_inc;
using astrai::sm90::wgmma_commit;
using astrai::sm90::wgmma_fence;
using astrai::sm90::wgmma_wait;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ------------------------------------------------------------------------
// init / init fence / arrive / arrive.expect_tx / try_wait / wait: astrai/sm90.cuh (shared
// with the attention plugin); the cluster forms are the GEMM's own.

// mbar_try_wait with cluster-scope acquire: for barriers that a peer CTA of the cluster arrives on.
__device__ __forceinline__ bool mbar_try_wait_cluster(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// ---- clusters ------------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ uint32_t cluster_size() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

// All threads of all CTAs of the cluster (warps converged).
__device__ __forceinline__ void cluster_sync() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n"
        "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The address of the same shared-memory offset in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t map_to_cta(uint32_t saddr, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(saddr), "r"(rank));
    return r;
}

__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_addr) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr)
                 : "memory");
}

// 16 bytes into a peer CTA's shared memory (cluster_addr from map_to_cta); a cluster barrier
// (release / acquire) makes them visible to the peer.
__device__ __forceinline__ void st_cluster_v4(uint32_t cluster_addr, float a, float b, float c, float d) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(cluster_addr), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
}

// Orders this thread's earlier async-proxy shared-memory accesses (TMA writes, wgmma reads)
// before its later generic ones, for a ring stage rewritten by plain stores.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- TMA -----------------------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// One box of a 2-D tensor map (c0 = innermost coordinate, in elements) into shared memory;
// the bytes are counted against the transaction count of `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int32_t c0, int32_t c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

// The same box written to the same offset in every CTA of `cta_mask`, completing on the
// barrier at the same offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int32_t c0, int32_t c1,
                                                      uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
        : "memory");
}

// ---- wgmma ---------------------------------------------------------------------------

// Pins accumulator registers so the compiler neither reads them before a wgmma_wait nor
// moves their updates across a wgmma issue.
template <int R>
__device__ __forceinline__ void fence_regs(float (&r)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor for a K-major operand written by TMA with 128-byte
// swizzle: rows of 128 bytes, 8-row swizzle atoms 1024 bytes apart (stride byte offset),
// the leading byte offset unused for this layout, tile base 1024-byte aligned.
__device__ __forceinline__ uint64_t desc_k_major_sw128(uint32_t saddr) {
    uint64_t d = 0;
    d |= static_cast<uint64_t>((saddr & 0x3FFFF) >> 4);  // start address, bits 0-13
    d |= static_cast<uint64_t>(1) << 16;                  // leading byte offset (unused)
    d |= static_cast<uint64_t>(1024 >> 4) << 32;          // stride byte offset
    d |= static_cast<uint64_t>(1) << 62;                  // layout: 128-byte swizzle
    return d;
}

}  // namespace astrai::fp8::sm90
