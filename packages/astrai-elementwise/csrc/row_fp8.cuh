// A row's per-token e4m3 output, for kernels that produce the row in one thread block (the
// RMSNorm and SiLU-and-mul rows a W8A8 linear reads next): the block's amax, the row's scale
// and the bytes, so that the row y (already rounded to its dtype T) leaves as
//
//   scale = amax(|y|) * float32(1 / 448) (1 where the amax is not > 0: a zero or NaN row),
//   q = e4m3(y / scale) (round to nearest even, saturating at 448)
//
// byte for byte what torch gives for (y.float() / (amax * (1 / 448))).to(float8_e4m3fn), and
// what astrai-fp8's quantize_rows writes for a 16-bit row y: a norm or SiLU-mul fused with the
// quantize equals the two launches it replaces. The amax is a max over the float bits with the
// sign cleared, so a NaN wins it (and its row gets scale 1, as torch.where gives) where fmaxf
// would drop it. Rounding is IEEE (__fdiv_rn, __fmul_rn) whatever the fast-math flags. Where a
// row holds a NaN or an Inf (scale 1 or Inf), its NaN bytes are 0x7f where torch keeps the sign,
// and a value past 464 saturates to 448 where torch's cast gives NaN.
#pragma once

#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "elementwise.cuh"

namespace astrai::elementwise {

constexpr float kInvE4M3Max = 1.f / 448.f;  // e4m3's largest finite value is 448

template <typename T, int kElems>
__device__ __forceinline__ uint32_t abs_max_bits(const T (&y)[kElems], uint32_t bits) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) bits = max(bits, __float_as_uint(to_float(y[e])) & 0x7fffffffu);
    return bits;
}

// The block's largest |y| bits, in every thread; every thread must call it. `partial` holds a
// word per warp (the caller's shared memory, not shared with another reduction still being read).
__device__ __forceinline__ uint32_t block_max_bits(uint32_t bits, uint32_t* partial) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = bits;
    __syncthreads();
    bits = lane < int(blockDim.x / 32) ? partial[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
    return bits;
}

// The dequantization scale of a row whose largest |y| has these bits.
__device__ __forceinline__ float scale_of_bits(uint32_t bits) {
    const float amax = __uint_as_float(bits);
    return amax > 0.f ? __fmul_rn(amax, kInvE4M3Max) : 1.f;
}

// The row's dequantization scale from the block's largest |y| bits; every thread must call it.
__device__ __forceinline__ float row_scale(uint32_t bits, uint32_t* partial) {
    return scale_of_bits(block_max_bits(bits, partial));
}

// A row's scale as store_row_fp8 asks for it, from a thread's largest |y| bits and the block's
// per-warp words: here the whole row is the block's.
struct BlockRow {
    uint32_t* unused;  // (ClusterRow's word)
    __device__ __forceinline__ float operator()(uint32_t bits, uint32_t* partial) const {
        return row_scale(bits, partial);
    }
};

// q[0, kElems) = e4m3(y / scale), kElems bytes in one store.
template <typename T, int kElems>
__device__ __forceinline__ void store_fp8(uint8_t* q, const T (&y)[kElems], float scale) {
    static_assert(kElems == 1 || kElems == 4 || kElems == 8, "one byte or a 4- or 8-byte word");
    if constexpr (kElems == 1) {
        *q = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(to_float(y[0]), scale), __NV_SATFINITE, __NV_E4M3));
    } else {
        uint32_t words[kElems / 4];
#pragma unroll
        for (int w = 0; w < kElems / 4; ++w) {
            uint32_t word = 0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 pair = make_float2(__fdiv_rn(to_float(y[4 * w + 2 * h]), scale),
                                                __fdiv_rn(to_float(y[4 * w + 2 * h + 1]), scale));
                word |= uint32_t{__nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3)} << (16 * h);
            }
            words[w] = word;
        }
        if constexpr (kElems == 8) {
            *reinterpret_cast<uint2*>(q) = make_uint2(words[0], words[1]);
        } else {
            *reinterpret_cast<uint32_t*>(q) = words[0];
        }
    }
}

// sm_90: a row shared by the blocks of a cluster (in order of rank). Each block's largest bits
// go to its own shared `word`; after a cluster barrier every thread reads all of them through
// distributed shared memory and arrives on a second barrier, whose wait (end_cluster_row, before
// the block exits) keeps each word alive until every peer has read it.
struct ClusterRow {
    uint32_t* word;
    __device__ __forceinline__ float operator()(uint32_t bits, uint32_t* partial) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        namespace cg = cooperative_groups;
        bits = block_max_bits(bits, partial);
        const cg::cluster_group cluster = cg::this_cluster();
        if (threadIdx.x == 0) *word = bits;
        cluster.sync();
        for (unsigned r = 0; r < cluster.num_blocks(); ++r) bits = max(bits, *cluster.map_shared_rank(word, r));
        cluster.barrier_arrive();
        return scale_of_bits(bits);
#else
        __trap();  // launched only on sm_90 devices from sm_90 code (the host checks both)
        return 0.f;
#endif
    }
};

// sm_90: this block's rank in its cluster and the cluster's blocks.
__device__ __forceinline__ void cluster_place(unsigned& rank, unsigned& blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    rank = cluster.block_rank();
    blocks = cluster.num_blocks();
#else
    __trap();
    rank = 0, blocks = 1;
#endif
}

__device__ __forceinline__ void end_cluster_row() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cooperative_groups::this_cluster().barrier_wait();
#endif
}

// A row a block holds in registers, kVecs accesses a thread (access i * blockDim.x + threadIdx.x,
// those below `accesses`), leaves as e4m3 at q (the row's first byte): finish(i) makes access i's
// values in y[i] in place, then the row's amax (`scale_of`: the block's, BlockRow, or a cluster's
// whose blocks share the row), then the bytes; thread 0 writes the scale to scales[row]. Every
// thread must call it.
template <typename T, int kElems, int kVecs, class Finish, class ScaleOf = BlockRow>
__device__ __forceinline__ void store_row_fp8(uint8_t* q, T (&y)[kVecs][kElems], int accesses, uint32_t* partial,
                                              float* scales, int64_t row, Finish&& finish,
                                              ScaleOf&& scale_of = BlockRow{nullptr}) {
    uint32_t bits = 0u;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
        if (i * int(blockDim.x) + int(threadIdx.x) < accesses) {
            finish(i);
            bits = abs_max_bits(y[i], bits);
        }
    }
    const float scale = scale_of(bits, partial);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
        const int at = i * blockDim.x + threadIdx.x;
        if (at < accesses) store_fp8(q + int64_t{at} * kElems, y[i], scale);
    }
    if (threadIdx.x == 0) scales[row] = scale;
}

// The same for a row too wide for the registers: make(at, y) computes access `at` into y, once
// for the amax and again for the bytes (the row's inputs come back from L1/L2).
template <typename T, int kElems, class Make, class ScaleOf = BlockRow>
__device__ __forceinline__ void store_row_fp8_twice(uint8_t* q, int accesses, uint32_t* partial, float* scales,
                                                    int64_t row, Make&& make, ScaleOf&& scale_of = BlockRow{nullptr}) {
    uint32_t bits = 0u;
    for (int at = threadIdx.x; at < accesses; at += blockDim.x) {
        alignas(16) T y[kElems];
        make(at, y);
        bits = abs_max_bits(y, bits);
    }
    const float scale = scale_of(bits, partial);
    for (int at = threadIdx.x; at < accesses; at += blockDim.x) {
        alignas(16) T y[kElems];
        make(at, y);
        store_fp8(q + int64_t{at} * kElems, y, scale);
    }
    if (threadIdx.x == 0) scales[row] = scale;
}

}  // namespace astrai::elementwise
