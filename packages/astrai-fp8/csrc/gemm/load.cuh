// Operand loaders: global fp8 operand -> one K-contiguous, swizzled shared tile.
//
// A tile is `Rows` rows (M rows of A, or N rows of B) of kBlockK = 64 bytes, stored flat.
// tile_at(row, chunk) swizzles the 16-byte chunk index with row bits 1..2: a warp's
// ldmatrix phase (8 consecutive rows x 16 B) then touches the 8 distinct 16-byte bank
// groups of a 128-byte line exactly once (unswizzled, rows r and r+2 share bank groups,
// because a 64-byte row covers only half the banks).
//
// Two loaders, picked at compile time by the operand's layout tag (common.h):
//   CongruousLoader: K contiguous in global. 16-byte cp.async per chunk, zero-filled past
//     the problem edge (predicated) or unpredicated when the whole tile is inside
//     (interior). Operands whose rows are not 16-byte aligned (K % 16 != 0, odd base)
//     take a byte-wise synchronous path instead: correct, not fast.
//   CrosswiseLoader: the row index (M or N) is contiguous. Each thread reads a 4(k) x 16
//     (rows) byte block with four 16-byte LDGs into registers (fetch), and after the
//     k-tile's MMAs transposes it with PRMT and writes sixteen 4-byte words (store).
// Both zero everything outside the problem so K tails contribute exactly 0 (fp8 NaN/Inf
// bytes must never meet a zero from the other operand).
#pragma once

#include <cstdint>

#include "astrai/cp_async.cuh"
#include "../byte_transpose.cuh"

namespace astrai::fp8 {

constexpr int kTileK = 64;  // bytes per tile row (== Fp8GemmTraits::kBlockK)

// Byte offset of (row, 16-byte chunk) inside a [rows][64] swizzled tile.
__host__ __device__ constexpr int tile_at(int row, int chunk) {
  return row * kTileK + ((chunk ^ ((row >> 1) & 3)) << 4);
}

// ---------------------------------------------------------------- congruous (K-major)
template <int Rows, int Threads>
struct CongruousLoader {
  static constexpr int kChunks = Rows * (kTileK / 16);
  static_assert(kChunks % Threads == 0, "chunks must split evenly over the threads");
  static constexpr int kPerThread = kChunks / Threads;

  const uint8_t* src[kPerThread];  // global address of this thread's chunk at k-tile 0
  int dst[kPerThread];             // swizzled byte offset inside the tile
  int kcol[kPerThread];            // k offset of the chunk inside a k-tile
  bool row_ok[kPerThread];
  int k;                           // problem K
  bool vec;                        // 16-byte aligned rows: cp.async path

  __device__ CongruousLoader(const uint8_t* base, int64_t ld, int rows_total, int k_total,
                             int row0, int tid, bool aligned)
      : k(k_total), vec(aligned) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int id = tid + i * Threads;
      const int r = id / (kTileK / 16), c = id % (kTileK / 16);
      row_ok[i] = row0 + r < rows_total;
      const int grow = row_ok[i] ? row0 + r : 0;
      src[i] = base + grow * ld + c * 16;
      dst[i] = tile_at(r, c);
      kcol[i] = c * 16;
    }
  }

  // Issues the copies of k-tile `kt` into the tile at shared address `tile`.
  // `interior`: every row and the whole k-tile are inside the problem.
  __device__ __forceinline__ void issue(int kt, uint32_t tile, bool interior) const {
    const int k0 = kt * kTileK;
    if (vec && interior) {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) cp_async_16(tile + dst[i], src[i] + k0, true);
    } else if (vec) {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int left = k - (k0 + kcol[i]);
        const int bytes = row_ok[i] ? (left >= 16 ? 16 : (left > 0 ? left : 0)) : 0;
        const uint8_t* g = bytes > 0 ? src[i] + k0 : src[i];
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tile + dst[i]),
                     "l"(g), "r"(bytes));
      }
    } else {
      // Misaligned rows: byte loads, zero-filled, stored synchronously (the target slot
      // is free: see the ring invariant in mainloop.cuh).
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const bool ok = row_ok[i] && k0 + kcol[i] + j < k;
          const uint32_t byte = ok ? static_cast<uint32_t>(__ldg(src[i] + k0 + j)) : 0u;
          w[j >> 2] |= byte << ((j & 3) * 8);
        }
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(tile + dst[i]), "r"(w[0]),
                     "r"(w[1]), "r"(w[2]), "r"(w[3]));
      }
    }
  }
};

// ---------------------------------------------------------------- crosswise (row-major in M/N)
// Rows must not exceed Threads: each participating thread owns one 4x16 block per k-tile.
// The caller picks which threads participate through `unit` (A takes the low threads, B the
// high ones), so two crosswise operands of a small tile load in parallel.
template <int Rows, int Threads>
struct CrosswiseLoader {
  static constexpr int kBlocks = (kTileK / 4) * (Rows / 16);  // == Rows
  static_assert(kBlocks <= Threads, "one 4x16 block per thread at most");
  static constexpr int kRow16 = Rows / 16;

  const uint8_t* src;  // global address of (k = k4*4, row = row0 + r16*16) at k-tile 0
  int64_t ld;
  int k, k4, rows_left;  // rows of this block inside the problem (<= 0: none)
  int dst_word;          // tile row of the block's first row
  bool active, vec;
  uint4 v[4];

  // `unit`: this thread's block index (outside [0, Rows): the thread does not load).
  __device__ CrosswiseLoader(const uint8_t* base, int64_t ld_, int rows_total, int k_total,
                             int row0, int unit, bool aligned)
      : ld(ld_), k(k_total) {
    active = unit >= 0 && unit < kBlocks;
    const int uu = active ? unit : 0;
    k4 = uu / kRow16;
    const int r16 = uu % kRow16;
    rows_left = rows_total - (row0 + r16 * 16);
    vec = aligned && rows_left >= 16;
    src = base + static_cast<int64_t>(k4) * 4 * ld_ + (rows_left > 0 ? row0 + r16 * 16 : 0);
    dst_word = r16 * 16;
  }

  // Global -> registers for k-tile kt.
  __device__ __forceinline__ void fetch(int kt) {
    if (!active) return;
    const int kb = kt * kTileK + k4 * 4;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const bool kok = kb + r < k;
      const uint8_t* g = src + (static_cast<int64_t>(kt) * kTileK + r) * ld;
      if (vec) {
        v[r] = kok ? __ldg(reinterpret_cast<const uint4*>(g)) : make_uint4(0u, 0u, 0u, 0u);
      } else {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const bool ok = kok && j < rows_left;
          w[j >> 2] |= (ok ? static_cast<uint32_t>(__ldg(g + j)) : 0u) << ((j & 3) * 8);
        }
        v[r] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  // Registers -> the tile at shared address `tile`, transposed to K-contiguous rows.
  __device__ __forceinline__ void store(uint32_t tile) const {
    if (!active) return;
    const uint32_t in[4][4] = {{v[0].x, v[0].y, v[0].z, v[0].w},
                               {v[1].x, v[1].y, v[1].z, v[1].w},
                               {v[2].x, v[2].y, v[2].z, v[2].w},
                               {v[3].x, v[3].y, v[3].z, v[3].w}};
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // rows 4q..4q+3 of the block
      uint32_t out[4];
      transpose_bytes4x4(in[0][q], in[1][q], in[2][q], in[3][q], out);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = dst_word + q * 4 + c;
        const uint32_t addr = tile + tile_at(row, k4 >> 2) + (k4 & 3) * 4;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(out[c]));
      }
    }
  }
};

}  // namespace astrai::fp8
