// Fp8CollectiveMainloop (mma.sync): stage ring, stage loads, fragment addressing and the
// pipelined k-loop of one CTA tile. Selected by MmaSyncMainloopTag (policy.cuh).
//
// Ring invariant. Each operand ring holds kStages+1 tiles. In iteration i the CTA
//   1. waits until its own copies of tile i landed (cp.async.wait_group<kStages-1>: the
//      group sequence is tile-indexed because prologue and tail commits are unconditional,
//      so the wait count never depends on i),
//   2. passes ONE __syncthreads: tile i is visible to all, and every warp has finished
//      compute(i-1),
//   3. issues tile i+kStages into slot (i+kStages) % (kStages+1) == (i-1) % (kStages+1),
//      the slot compute(i-1) just released, so no second barrier is needed,
//   4. computes tile i; crosswise operands write their register-staged tile i+kStages
//      into that same free slot after the MMAs (their global latency hides under them).
//
// Fragment addressing. A warp loads its A fragments (16 rows x 32 bytes each) and B
// fragments (two n8 x 32 bytes per ldmatrix.x4) with one base register per k-step:
// the swizzle XOR takes only row bits 1..2, which come from the lane, never from the
// 16-row fragment step, so addr(s, mt) = (lane_off ^ (s << 5)) + mt * 16 * 64 and the
// per-fragment term is an LDSM immediate. Ring slots advance by one add with an
// equality wrap (no modulo).
#pragma once

#include <cstdint>

#include "astrai/cp_async.cuh"
#include "astrai/mma.cuh"
#include "../common.h"
#include "load.cuh"
#include "policy.cuh"

namespace astrai::fp8 {

template <FP8Format F>
struct fp8_type;
template <>
struct fp8_type<FP8Format::E4M3> {
  using type = __nv_fp8_e4m3;
};
template <>
struct fp8_type<FP8Format::E5M2> {
  using type = __nv_fp8_e5m2;
};

template <class Policy>
struct Fp8MmaSyncMainloop {
  using T = typename Policy::Traits;
  using Smem = Fp8GemmSmem<T>;
  static constexpr int kThreads = T::kThreads;
  static constexpr int kSmemBytes = Smem::kBytes;
  static constexpr int kFM = T::kFragM, kFN = T::kFragN;
  static_assert(kFN % 2 == 0, "B fragments are loaded in pairs");
  using InA = typename fp8_type<T::FmtA>::type;
  using InB = typename fp8_type<T::FmtB>::type;

  using LoaderA = std::conditional_t<Policy::LayoutA::kCongruous,
                                     CongruousLoader<T::kBlockM, kThreads>,
                                     CrosswiseLoader<T::kBlockM, kThreads>>;
  using LoaderB = std::conditional_t<Policy::LayoutB::kCongruous,
                                     CongruousLoader<T::kBlockN, kThreads>,
                                     CrosswiseLoader<T::kBlockN, kThreads>>;
  static constexpr bool kCrossA = !Policy::LayoutA::kCongruous;
  static constexpr bool kCrossB = !Policy::LayoutB::kCongruous;

  struct Accum {
    float v[kFM][kFN][4];
  };

  // Host-side: can this policy take the problem at all? (Every shape is accepted: edges,
  // K tails and misaligned rows have predicated paths; only empty problems are refused.)
  static bool can_implement(const FP8Params& p) { return p.m > 0 && p.n > 0 && p.k > 0; }

  // Calls f(row, col, v0, v1) for every accumulator pair (row, col) and (row, col + 1),
  // tile-relative. The epilogue sees only this, so any mainloop with the same surface fits.
  template <class F>
  __device__ __forceinline__ static void visit(const Accum& acc, F&& f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp / T::kWarpsN) * T::kWarpM, wn = (warp % T::kWarpsN) * T::kWarpN;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kFM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kFN; ++nt) {
        const int r = wm + mt * 16 + g, c = wn + nt * 8 + 2 * t;
        f(r, c, acc.v[mt][nt][0], acc.v[mt][nt][1]);
        f(r + 8, c, acc.v[mt][nt][2], acc.v[mt][nt][3]);
      }
  }

  __device__ __forceinline__ static void run(const FP8Params& p, int m0, int n0, bool a_vec,
                                             bool b_vec, uint8_t* smem, Accum& acc) {
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    // B's crosswise blocks go to the high threads so small tiles load A and B in parallel.
    const int unit_b = kCrossB ? tid - (kThreads - T::kBlockN) : tid;
    LoaderA la(p.a, p.lda, p.m, p.k, m0, tid, a_vec);
    LoaderB lb(p.b, p.ldb, p.n, p.k, n0, unit_b, b_vec);

    const uint32_t ring_a = smem_u32(smem);
    const uint32_t ring_b = ring_a + T::kRing * Smem::kTileA;
    const int ktiles = (p.k + T::kBlockK - 1) / T::kBlockK;
    const bool interior_mn = m0 + T::kBlockM <= p.m && n0 + T::kBlockN <= p.n;
    const int full_k = p.k / T::kBlockK;  // k-tiles without a tail

#pragma unroll
    for (int mt = 0; mt < kFM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kFN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc.v[mt][nt][e] = 0.f;

    // Prologue: tiles 0..kStages-1, one commit group each (empty groups past the end).
#pragma unroll
    for (int s = 0; s < T::kStages; ++s) {
      if (s < ktiles) {
        const bool interior = interior_mn && s < full_k;
        if constexpr (kCrossA) {
          la.fetch(s);
          la.store(ring_a + s * Smem::kTileA);
        } else {
          la.issue(s, ring_a + s * Smem::kTileA, interior);
        }
        if constexpr (kCrossB) {
          lb.fetch(s);
          lb.store(ring_b + s * Smem::kTileB);
        } else {
          lb.issue(s, ring_b + s * Smem::kTileB, interior);
        }
      }
      cp_async_commit();
    }

    // Per-lane fragment offsets inside a tile (see the header comment).
    const int wm = (warp / T::kWarpsN) * T::kWarpM, wn = (warp % T::kWarpsN) * T::kWarpN;
    const uint32_t a_lane = tile_at(wm + (lane & 15), lane >> 4);
    const uint32_t b_lane = tile_at(wn + ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);

    uint32_t read_a = ring_a, read_b = ring_b;
    uint32_t write_a = ring_a + T::kStages * Smem::kTileA;
    uint32_t write_b = ring_b + T::kStages * Smem::kTileB;
    const uint32_t end_a = ring_a + T::kRing * Smem::kTileA;
    const uint32_t end_b = ring_b + T::kRing * Smem::kTileB;

    for (int i = 0; i < ktiles; ++i) {
      cp_async_wait<T::kStages - 1>();
      __syncthreads();

      const int next = i + T::kStages;
      const bool has_next = next < ktiles;
      if (has_next) {
        const bool interior = interior_mn && next < full_k;
        if constexpr (kCrossA) la.fetch(next); else la.issue(next, write_a, interior);
        if constexpr (kCrossB) lb.fetch(next); else lb.issue(next, write_b, interior);
      }
      cp_async_commit();

      // On the archs that emulate fp8 mma.sync (sm_90, sm_100) every fragment register
      // unpacks into two f16x2 registers: the k-steps are not unrolled there, so the
      // fragments of one k-step are live at a time (the 8-warp CTA would spill otherwise).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200
#pragma unroll 1
#else
#pragma unroll
#endif
      for (int s = 0; s < T::kKSteps; ++s) {
        const uint32_t a_base = read_a + (a_lane ^ (s << 5));
        const uint32_t b_base = read_b + (b_lane ^ (s << 5));
        uint32_t af[kFM][4];
        uint32_t bf[kFN][2];
#pragma unroll
        for (int mt = 0; mt < kFM; ++mt) ldmatrix_x4(af[mt], a_base + mt * 16 * T::kBlockK);
#pragma unroll
        for (int np = 0; np < kFN / 2; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, b_base + np * 16 * T::kBlockK);
          bf[2 * np][0] = r[0];
          bf[2 * np][1] = r[1];
          bf[2 * np + 1][0] = r[2];
          bf[2 * np + 1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < kFM; ++mt)
#pragma unroll
          for (int nt = 0; nt < kFN; ++nt) mma_sync_fp8<InA, InB>(acc.v[mt][nt], af[mt], bf[nt]);
      }

      if (has_next) {
        if constexpr (kCrossA) la.store(write_a);
        if constexpr (kCrossB) lb.store(write_b);
      }
      read_a += Smem::kTileA;
      read_b += Smem::kTileB;
      write_a += Smem::kTileA;
      write_b += Smem::kTileB;
      if (read_a == end_a) read_a = ring_a;
      if (read_b == end_b) read_b = ring_b;
      if (write_a == end_a) write_a = ring_a;
      if (write_b == end_b) write_b = ring_b;
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: the epilogue may reuse the shared memory
  }
};

template <class Policy>
struct MainloopFor<MmaSyncMainloopTag, Policy> {
  using type = Fp8MmaSyncMainloop<Policy>;
};

}  // namespace astrai::fp8
