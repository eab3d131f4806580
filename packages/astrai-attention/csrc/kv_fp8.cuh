// FP8 K/V pages in the decode kernel: the storage formats, the shared-memory tile they land in
// and the conversion of their bytes straight into mma.sync B fragments (no 16-bit copy of the
// tile). No torch.
//
// A page value is stored = round_to_fp8(x / scale) (kv_quant.py); the kernel computes with
// stored * scale, exactly (the gathers' values before their cast to the compute dtype).
//
// Conversion. Into float16 the hardware converts a byte pair exactly in one instruction
// (fp8x2_to_half2). Into bfloat16 there is none: an fp8 byte's exponent and mantissa bits,
// shifted into bfloat16's exponent and mantissa fields, are the same number times
// 2^-(127 - bias_fp8) (subnormals too: a zero exponent field stays a zero field), so a byte pair
// becomes a bfloat16 pair in three integer ops and the power of two joins the K scale
// (Fp8ToBf16::unit); e4m3's NaN encodings become finite values there (the cache saturates what it
// stores; only a NaN key produces them). The scores convert K into the compute dtype; the
// output converts V into float16 and runs P.V on float16 whatever the compute dtype (P in
// [0, 1] keeps more bits there than in bfloat16).
//
// Fragments. The k dimension of an mma may be permuted at will as long as A and B agree: for
// the scores (k = head dim) a thread takes the four consecutive bytes 16t + 4kk .. + 3 of each
// 64-byte segment of a K row as the k-step's k = 2t, 2t+1, 2t+8, 2t+9 (t = lane % 4), so one
// 16-byte load feeds four k-steps, and Q's A fragments are read with the same permutation. For
// the output (k = key position) the n dimension (head dim) is permuted instead: mma column n of
// n-tile j is head-dim element n * D/8 + j, so a thread's B values of every n-tile sit in D/8
// consecutive bytes of each of its four V rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

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

// Two fp8 values of format F (bits 7:0 and 15:8 of x) as a packed float16 pair, exactly (one
// hardware conversion on sm_89+; NaN stays NaN): the float16 fragments' conversion.
template <class F>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t x) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(x & 0xffffu), F::kFormat);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// fp8 format F -> bfloat16, two values at a time (the Conversion paragraph above).
template <class F>
struct Fp8ToBf16 {
    static constexpr int kShift = 8 - F::kExpBits;                     // bfloat16: 8 exponent bits
    static constexpr uint32_t kMask = (0x7f00u >> kShift) * 0x10001u;  // exponent + mantissa, both halves
    static constexpr int kUnitExp = 127 - F::kBias;
    // What a converted value is multiplied by to be the stored fp8 number: 2^kUnitExp.
    __device__ __forceinline__ static float unit() { return __int_as_float((kUnitExp + 127) << 23); }
    // z: two fp8 bytes in bits 15:8 and 31:24 (the other bits are ignored) -> a packed bfloat16 pair.
    __device__ __forceinline__ static uint32_t pair(uint32_t z) {
        return (z & 0x80008000u) | ((z >> kShift) & kMask);
    }
};

// A [rows][D] tile of fp8 bytes: 16-byte chunks with the chunk index XOR-swizzled per row so
// that the cp.async stores and the decode kernel's K and V fragment loads (8 lanes per bank
// phase) are conflict-free at D = 128 and 256 (at D = 64 the V loads are two-way).
template <int D>
struct Fp8Tile {
    static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
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

// __byte_perm selectors over the bytes 0..7 of (a, b): byte lo into bits 15:8 and byte hi into
// bits 31:24 (the z of Fp8ToBf16::pair), or lo into bits 7:0 and hi into 15:8 (fp8x2_to_half2's).
__device__ __forceinline__ constexpr uint32_t pair_selector(int lo, int hi) {
    return uint32_t((hi << 12) | (hi << 8) | (lo << 4) | lo);
}
__device__ __forceinline__ constexpr uint32_t low_pair_selector(int lo, int hi) { return uint32_t((hi << 4) | lo); }

}  // namespace astrai::attn
