// Hopper (sm_90a) synchronisation primitives shared by the plugins' warp-specialized kernels:
//   mbarrier      init / arrive / arrive.expect_tx / cp.async completion arrive / try_wait.parity
//   TMA           cp.async.bulk.tensor.4d global -> shared, completing on an mbarrier
//   proxy fence   generic-proxy shared-memory writes -> async proxy (wgmma, TMA) reads
//   wgmma         fence / commit_group / wait_group
//   named barriers between warpgroups, and setmaxnreg register hand-over
// Everything here is device code that only sm_90a accepts; callers compile it only there.
#pragma once

#include <cstdint>

namespace astrai::sm90 {

// ---- mbarrier ------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes freshly initialised barriers visible to the other threads and to the async proxy.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Arrives on `bar` and adds `bytes` to the transaction count its phase waits for (the TMA
// loads that complete on it).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// Arrives on `bar` once every cp.async this thread issued so far has landed; counts against
// the barrier's expected arrivals (noinc), so init it with the number of copying threads.
__device__ __forceinline__ void mbar_arrive_on_cp_async(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Waits until the phase of `bar` with this parity has completed (the k-th completion, from
// 0, has parity k & 1; a fresh barrier counts a virtual phase of parity 1 as complete).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// ---- TMA -----------------------------------------------------------------------------

// One box of a 4-D tensor map (c0 = innermost coordinate, in elements) into shared memory;
// the bytes count against the transaction count of `bar`. `map` must live in kernel
// parameter (__grid_constant__), constant or global memory.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, uint32_t bar, int32_t c0, int32_t c1,
                                            int32_t c2, int32_t c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// One box of shared memory at `src` into a 4-D tensor map's global tensor (coordinates past
// a dimension are not written), in this thread's bulk async group; the writes to `src` must
// be ordered before it (fence_proxy_async by each writer, then a barrier).
__device__ __forceinline__ void tma_store_4d(const void* map, uint32_t src, int32_t c0, int32_t c1, int32_t c2,
                                             int32_t c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

// Closes this thread's bulk async group and waits until its stores have read their shared
// memory (the source may then be rewritten; the global writes complete on their own).
__device__ __forceinline__ void tma_store_commit_and_wait_read() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// ---- proxies and wgmma ---------------------------------------------------------------

// Orders this thread's view of shared memory written through the generic proxy (stores,
// cp.async) before its following async-proxy accesses (wgmma operand reads, TMA).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

// Waits until at most `Pending` committed wgmma groups of this warpgroup are in flight.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(Pending) : "memory");
}

// ---- named barriers and registers ----------------------------------------------------

// bar.sync / bar.arrive on hardware barrier `id` (0 is __syncthreads') with `threads`
// participants, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

}  // namespace astrai::sm90
