// FP8 K/V pages in the decode kernel: the storage formats, the shared-memory tile they land in
// and the conversion of their bytes straight into mma.sync B fragments (no 16-bit copy of the
// tile). No torch.
//
// A page value is stored = round_to_fp8(x / scale) (kv_quant.py); the kernel computes with
// stored * scale, exactly (the gathers' values before their cast to the compute dtype).
//
// Conversion. Into float16 the hardware converts a byte pair exactly in one instruction, from
// either half of a 32-bit word (fp8x2_to_half2<F, kHigh>), so both GEMMs run on float16 whatever
// the compute dtype: a bfloat16 Q is converted into float16 once per block, each query row times
// a power of two that puts its largest element in [2^14, 2^15) (exact down to 2^-29 of that
// largest, where float16's normal range ends), and the scores carry its
// inverse with the K scale; P in [0, 2^8] (the lazy rescale's bound) keeps more bits in float16
// than in bfloat16.
//
// Prefill (prefill_split_q_mma.cuh) instead widens each staged tile once into a 16-bit tile
// of the compute dtype (widen_fp8_tile; exact in float16 and bfloat16 alike), which every row
// block of Q then reads as it reads 16-bit pages; the scales join the scores and the output.
//
// Fragments. The k dimension of an mma may be permuted at will as long as A and B agree: for
// the scores (k = head dim) a thread takes the four consecutive bytes 16t + 4kk .. + 3 of each
// 64-byte segment of a K row as the k-step's k = 2t, 2t+1, 2t+8, 2t+9 (t = lane % 4), so one
// 16-byte load feeds four k-steps, and Q's A fragments are read with the same permutation. For
// the output (k = key position) the n dimension (head dim) is permuted instead: mma column n of
// n-tile j is head-dim element n * D/8 + j, so a thread's B values of every n-tile sit in D/8
// consecutive bytes of each of its four V rows; one byte permute interleaves two rows' bytes of
// two n-tiles, and the word's halves convert into the two n-tiles' B registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "astrai/fp8_convert.cuh"
#include "capabilities.h"
#include "mma_utils.cuh"

namespace astrai::attn {

// The decode kernel's K/V storage: the compute dtype itself, or one byte per value.
struct Kv16 {
    static constexpr int kBytes = 2;
};
struct KvE4M3 {
    static constexpr int kBytes = 1, kExpBits = 4, kBias = 7;
    static constexpr __nv_fp8_interpretation_t kFormat = __NV_E4M3;
};
struct KvE5M2 {
    static constexpr int kBytes = 1, kExpBits = 5, kBias = 15;
    static constexpr __nv_fp8_interpretation_t kFormat = __NV_E5M2;
};

// Two fp8 values of format F (bytes 0, 1 of x, or with kHigh bytes 2, 3) as a packed float16
// pair, exactly (astrai/fp8_convert.cuh).
template <class F, bool kHigh = false>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t x) {
    return astrai::fp8x2_to_half2<F::kExpBits, kHigh>(x);
}

// A [rows][D] tile of fp8 bytes: 16-byte chunks with the chunk index XOR-swizzled per row so
// that the cp.async stores and the decode kernel's K and V fragment loads (8 lanes per bank
// phase) are conflict-free at D = 128 and 256 (at D = 64 the V loads are two-way).
template <int D>
struct Fp8Tile {
    static_assert(is_head_dim(D), "head_dim must be " ASTRAI_ATTN_HEAD_DIMS_TEXT);
    static constexpr int kChunks = D / 16;
    __device__ __forceinline__ static int swizzle(int r) {
        const int pair = (r >> 1) & 3, odd = r & 1;
        if constexpr (D == 64) return 2 * (pair & 1);
        if constexpr (D == 128) return (2 * pair) ^ (4 * odd);
        return (((pair & 1) << 2) | (pair >> 1)) ^ (4 * odd);
    }
    // Byte offset of chunk c of row r.
    __device__ __forceinline__ static uint32_t offset(int r, int c) {
        return uint32_t(r * kChunks + (c ^ swizzle(r))) * 16u;
    }
};

// The __byte_perm selector over the bytes 0..7 of (a, b) that gives (a[at], b[at], a[at + 1],
// b[at + 1]): two rows' bytes of two adjacent columns, each column's pair in one half.
__device__ __forceinline__ constexpr uint32_t interleave_selector(int at) {
    return uint32_t(((5 + at) << 12) | ((at + 1) << 8) | ((4 + at) << 4) | at);
}

// The K bytes a thread's score fragments take from one fp8 tile (Fp8Tile<D>): per 64-byte
// segment `seg` of the head dim, 16 bytes at 16t of rows g and g + 8 of the warp's 16 (word kk
// of them is k-step 4 seg + kk's k = 2t, 2t+1, 2t+8, 2t+9, above); f(seg, kw), kw[j] of row g + 8j.
template <int D, class F>
__device__ __forceinline__ void for_fp8_k_segments(const uint8_t* k_tile, int warp, int lane, F&& f) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int seg = 0; seg < D / 64; ++seg) {
        uint4 kw[2];
#pragma unroll
        for (int j = 0; j < 2; ++j)
            kw[j] = *reinterpret_cast<const uint4*>(k_tile + Fp8Tile<D>::offset(warp * 16 + 8 * j + g, 4 * seg + t));
        f(seg, kw);
    }
}

// The V bytes a thread's output fragments take from one fp8 tile (Fp8Tile<D>): rows 2t, 2t + 1,
// 2t + 8, 2t + 9 of the warp's 16, its D/8 bytes g * D/8 .. of each. For every pair (j, j + 1)
// of those bytes, f(j, lo, hi): lo holds rows 2t and 2t + 1's bytes j, j + 1 interleaved
// (interleave_selector: each byte's pair of rows in one half), hi rows 2t + 8 and 2t + 9's.
template <int D, class F>
__device__ __forceinline__ void for_fp8_v_pairs(const uint8_t* v_tile, int warp, int lane, F&& f) {
    const int g = lane >> 2, t = lane & 3;
    constexpr int kWords = D / 32;                       // 32-bit words of a thread's D/8 bytes per row
    constexpr int kLoadWords = kWords < 4 ? kWords : 4;  // one 8- or 16-byte load per row
    const int rows[4] = {warp * 16 + 2 * t, warp * 16 + 2 * t + 1, warp * 16 + 2 * t + 8, warp * 16 + 2 * t + 9};
#pragma unroll
    for (int part = 0; part < kWords / kLoadWords; ++part) {
        const int byte = g * (D / 8) + 4 * kLoadWords * part;
        uint32_t w[4][kLoadWords];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint8_t* src = v_tile + Fp8Tile<D>::offset(rows[i], byte / 16) + byte % 16;
            if constexpr (kLoadWords == 4) {
                const uint4 x = *reinterpret_cast<const uint4*>(src);
                w[i][0] = x.x, w[i][1] = x.y, w[i][2] = x.z, w[i][3] = x.w;
            } else {
                const uint2 x = *reinterpret_cast<const uint2*>(src);
                w[i][0] = x.x, w[i][1] = x.y;
            }
        }
#pragma unroll
        for (int jj = 0; jj < 4 * kLoadWords; jj += 2) {
            const int word = jj / 4, at = jj % 4;
            f(4 * kLoadWords * part + jj, __byte_perm(w[0][word], w[1][word], interleave_selector(at)),
              __byte_perm(w[2][word], w[3][word], interleave_selector(at)));
        }
    }
}

// 16 bytes of shared memory at a shared-window address.
__device__ __forceinline__ void ld_shared_16(uint32_t (&w)[4], uint32_t addr) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr));
}
__device__ __forceinline__ void st_shared_16(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// A packed float16 pair of fp8 values as a packed pair of T (exact: fp8's exponents and
// mantissas fit both 16-bit formats).
template <typename T>
__device__ __forceinline__ uint32_t widened_pair(uint32_t h2) {
    if constexpr (std::is_same_v<T, __half>) {
        return h2;
    } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
        return Elem<T>::pack2(f.x, f.y);
    }
}

// The fp8 tile at src (Fp8Tile<D>, ROWS rows of format F) into the 16-bit tile at dst (Tile's
// 16-byte chunks of 8 values of T), exactly. All THREADS threads of the block take part.
template <typename T, class F, class Tile, int D, int ROWS, int THREADS>
__device__ __forceinline__ void widen_fp8_tile(uint32_t src, uint32_t dst) {
    constexpr int kChunks = D / 16;
#pragma unroll 2
    for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
        const int r = i / kChunks, c = i % kChunks;
        uint32_t w[4];
        ld_shared_16(w, src + Fp8Tile<D>::offset(r, c));
        uint32_t x[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            x[2 * j] = widened_pair<T>(fp8x2_to_half2<F>(w[j]));
            x[2 * j + 1] = widened_pair<T>(fp8x2_to_half2<F, true>(w[j]));
        }
        st_shared_16(dst + Tile::offset(r, 2 * c), x[0], x[1], x[2], x[3]);
        st_shared_16(dst + Tile::offset(r, 2 * c + 1), x[4], x[5], x[6], x[7]);
    }
}

}  // namespace astrai::attn
