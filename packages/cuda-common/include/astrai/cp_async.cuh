// cp.async (sm_80+) 16-byte global -> shared copies with commit / wait groups.
#pragma once

#include <cstdint>

namespace astrai {

// Copies 16 bytes when pred, else zero-fills the 16 shared bytes (src-size 0).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool pred) {
    const int src_size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr),
                 "l"(gmem), "r"(src_size));
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most N committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace astrai
