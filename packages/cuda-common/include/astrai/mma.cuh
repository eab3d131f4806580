// Tensor-core primitives shared by the plugins: warp-level mma.sync and ldmatrix.
//
//   mma_shape<InT>      the m16n8kK shape of one mma.sync for an input type
//   mma_sync<InT>(d, a, b)   d += a * b with float accumulators (d[4], a[4], b[2])
//   ldmatrix_x2/x4[_trans]   8x8 b16 matrix loads from shared memory
//
// Fragment layouts follow the PTX ISA for mma.m16n8k16 (.bf16/.f16): lane = 4*g + t,
// a0:(g, 2t..2t+1) a1:(g+8, 2t..) a2:(g, 8+2t..) a3:(g+8, 8+2t..);
// b0:(k=2t..2t+1, n=g) b1:(k=8+2t.., n=g); c0,c1:(g, 2t..2t+1) c2,c3:(g+8, 2t..2t+1).
// Requires sm_80+ (callers guard with ASTRAI_NO_MMA / __CUDA_ARCH__).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace astrai {

template <typename InT>
struct mma_shape;

template <>
struct mma_shape<__nv_bfloat16> {
    static constexpr int M = 16, N = 8, K = 16;
};
template <>
struct mma_shape<__half> {
    static constexpr int M = 16, N = 8, K = 16;
};

template <typename InT>
__device__ __forceinline__ void mma_sync(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_sync<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_sync<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- FP8 (m16n8k32 e4m3/e5m2) specializations: owned by the FP8 plugin, added below. ----
// m16n8k32, A row-major / B col-major, 4 fp8 per 32-bit register. Byte for byte the
// fragments sit where the m16n8k16 b16 fragments do (a0:(g, bytes 4t..4t+3), b0:(k=4t..4t+3,
// n=g), ...), so ldmatrix (.b16, no .trans) loads them from K-contiguous tiles unchanged.
// PTX needs sm_89+. SASS: native QMMA.16832 on sm_89 / sm_120; on sm_90 and sm_100 ptxas
// emulates it (F2FP...UNPACK_B to f16 + HMMA.16816), so it is correct there but slow.
// A and B may differ in format (e4m3 x e5m2): mma_sync_fp8<InA, InB>.
}  // namespace astrai
#include <cuda_fp8.h>
namespace astrai {

template <>
struct mma_shape<__nv_fp8_e4m3> {
    static constexpr int M = 16, N = 8, K = 32;
};
template <>
struct mma_shape<__nv_fp8_e5m2> {
    static constexpr int M = 16, N = 8, K = 32;
};

#define ASTRAI_MMA_FP8(TA, TB, PA, PB)                                                     \
    template <>                                                                            \
    __device__ __forceinline__ void mma_sync_fp8<TA, TB>(                                  \
        float(&d)[4], const uint32_t(&a)[4], const uint32_t(&b)[2]) {                      \
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." PA "." PB ".f32 "            \
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"             \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                      \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])); \
    }

template <typename InA, typename InB>
__device__ __forceinline__ void mma_sync_fp8(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]);
ASTRAI_MMA_FP8(__nv_fp8_e4m3, __nv_fp8_e4m3, "e4m3", "e4m3")
ASTRAI_MMA_FP8(__nv_fp8_e4m3, __nv_fp8_e5m2, "e4m3", "e5m2")
ASTRAI_MMA_FP8(__nv_fp8_e5m2, __nv_fp8_e4m3, "e5m2", "e4m3")
ASTRAI_MMA_FP8(__nv_fp8_e5m2, __nv_fp8_e5m2, "e5m2", "e5m2")
#undef ASTRAI_MMA_FP8

template <>
__device__ __forceinline__ void mma_sync<__nv_fp8_e4m3>(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2]) {
    mma_sync_fp8<__nv_fp8_e4m3, __nv_fp8_e4m3>(d, a, b);
}
template <>
__device__ __forceinline__ void mma_sync<__nv_fp8_e5m2>(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2]) {
    mma_sync_fp8<__nv_fp8_e5m2, __nv_fp8_e5m2>(d, a, b);
}
// ---- end FP8 section ----

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Lane l supplies the row address of matrix l/8 (x4: lanes 0..31, x2: lanes 0..15).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

}  // namespace astrai
