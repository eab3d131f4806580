// FP8 GEMM umbrella: the kernel orchestrator, host launch planning and the entry point.
//
//   fp8_gemm_kernel<Policy>   scheduler -> Policy's mainloop -> epilogue, one tile per CTA
//   canonicalize_gemm(args)   user problem (trans_a / trans_b) -> kernel problem + layout
//   plan_gemm(problem, dev)   tile configuration + grid by wave math (pure function)
//   launch_plan(plan, ...)    the one instantiation that plan names, launched
//   gemm(args, dev, stream)   = canonicalize_gemm -> plan_gemm -> launch_plan
//
// No torch here; ops.cu validates and packs arguments, tests/fp8_test.cu calls gemm().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "astrai/check.h"
#include "astrai/device.cuh"
#include "common.h"
#include "gemm/epilogue.cuh"
#include "gemm/load.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/policy.cuh"
#include "gemm/scheduler.cuh"

namespace astrai::fp8 {

// ============================================================== kernel
template <class Policy>
__global__ void __launch_bounds__(Policy::kThreads, Policy::kMinBlocks)
    fp8_gemm_kernel(const __grid_constant__ FP8Params p, int tiles_m, int tiles_n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  __trap();  // fp8 mma needs sm_89+; the build never emits this arch (see CMakeLists.txt)
#else
  using Mainloop = typename MainloopFor<typename Policy::MainloopTag, Policy>::type;
  using Epilogue = Fp8CollectiveEpilogue<Policy>;
  using T = typename Policy::Traits;
  extern __shared__ __align__(128) uint8_t smem[];

  const TileCoord tile = grouped_tile(blockIdx.x, tiles_m, tiles_n, p.group_m);
  const int m0 = tile.m * T::kBlockM, n0 = tile.n * T::kBlockN;
  typename Mainloop::Accum acc;
  Mainloop::run(p, m0, n0, p.a_vec != 0, p.b_vec != 0, smem, acc);
  Epilogue::template run<Mainloop>(p, m0, n0, p.c_vec != 0, acc, smem);
#endif
}

// ============================================================== tile configurations
enum class TileConfig : int { k64x64 = 0, k128x64 = 1, k128x128 = 2 };
enum class LayoutPair : int { kCC = 0, kCX = 1, kXX = 2 };  // A, B: Congruous / Crosswise

constexpr int kStagesAll = 3;

template <TileConfig C>
struct TileTraitsArgs;
template <>
struct TileTraitsArgs<TileConfig::k64x64> {
  static constexpr int bm = 64, bn = 64, wm = 2, wn = 2;
};
template <>
struct TileTraitsArgs<TileConfig::k128x64> {
  static constexpr int bm = 128, bn = 64, wm = 2, wn = 2;
};
template <>
struct TileTraitsArgs<TileConfig::k128x128> {
  static constexpr int bm = 128, bn = 128, wm = 2, wn = 4;
};

template <TileConfig C, FP8Format FA, FP8Format FB>
using TraitsFor = Fp8GemmTraits<FA, FB, TileTraitsArgs<C>::bm, TileTraitsArgs<C>::bn,
                                TileTraitsArgs<C>::wm, TileTraitsArgs<C>::wn, kStagesAll>;

struct TileShape {
  int bm, bn, threads, smem_bytes, reg_ctas;  // reg_ctas: resident CTAs the registers allow
};

template <TileConfig C>
constexpr TileShape tile_shape_of() {
  using Tr = TraitsFor<C, FP8Format::E4M3, FP8Format::E4M3>;
  return TileShape{Tr::kBlockM, Tr::kBlockN, Tr::kThreads, Fp8GemmSmem<Tr>::kBytes,
                   C == TileConfig::k64x64 ? 4 : (C == TileConfig::k128x64 ? 2 : 1)};
}

constexpr TileShape tile_shape(TileConfig c) {
  return c == TileConfig::k64x64    ? tile_shape_of<TileConfig::k64x64>()
         : c == TileConfig::k128x64 ? tile_shape_of<TileConfig::k128x64>()
                                    : tile_shape_of<TileConfig::k128x128>();
}

// ============================================================== host planning (pure)
struct GemmProblem {
  int m, n, k;             // kernel problem (after canonicalize_gemm's swap)
  bool a_congruous, b_congruous;
};

struct DeviceLimits {
  int sms;
  int smem_per_sm;     // bytes usable by CTAs on one SM
  int smem_per_block;  // opt-in maximum for one CTA
};

struct GemmPlan {
  TileConfig tile;
  int tiles_m, tiles_n, grid, threads, smem_bytes, group_m, ctas_per_sm;
};

// Time of a 128x64 tile relative to a 128x128 tile on the same SM (measured on sm_89:
// half the MMAs, but the same per-tile fixed costs: prologue, epilogue, barriers).
constexpr double kNarrowOverBig = 0.53;

constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
constexpr int tiles_for(const GemmProblem& p, TileConfig c) {
  return ceil_div(p.m, tile_shape(c).bm) * ceil_div(p.n, tile_shape(c).bn);
}
constexpr int ctas_per_sm(TileConfig c, const DeviceLimits& d) {
  const TileShape s = tile_shape(c);
  const int by_smem = d.smem_per_sm / (s.smem_bytes + 1024);
  return by_smem < s.reg_ctas ? by_smem : s.reg_ctas;
}
constexpr bool fits(TileConfig c, const DeviceLimits& d) {
  return tile_shape(c).smem_bytes <= d.smem_per_block && ctas_per_sm(c, d) >= 1;
}

// The tile choice alone (wave math). Rules, in order:
//   1. m <= 64: the 64x64 CTA (a taller tile would compute rows that do not exist).
//   2. m and n divisible by 64 but not both by 128: 64x64 (128-wide edge tiles would be
//      half empty and drag the last wave).
//   3. a crosswise operand: 64x64 below 1.5 waves of 128x128 tiles, else 128x128 (the
//      direct-load path needs many CTAs in flight to hide its latency).
//   4. both congruous, under one wave of 128x128 tiles: fill < 3/8 -> 64x64, < 5/8 ->
//      128x64, else 128x128 (operand reuse wins once the SMs are mostly busy).
//   5. both congruous, a wave or more: the one with the fewer SM-sequential tile-times,
//      ceil(tiles / sms) * T_tile, with T_128x64 = 0.53 T_128x128.
// A choice whose shared memory does not fit the device falls to the next smaller CTA.
constexpr TileConfig choose_tile(const GemmProblem& p, const DeviceLimits& d) {
  TileConfig c = TileConfig::k128x128;
  const int big = tiles_for(p, TileConfig::k128x128);
  const int sms = d.sms > 0 ? d.sms : 1;
  if (p.m <= 64) {
    c = TileConfig::k64x64;
  } else if ((p.m % 128 != 0 || p.n % 128 != 0) && p.m % 64 == 0 && p.n % 64 == 0) {
    c = TileConfig::k64x64;
  } else if (!p.a_congruous || !p.b_congruous) {
    c = 2 * big < 3 * sms ? TileConfig::k64x64 : TileConfig::k128x128;
  } else if (big < sms) {
    c = 8 * big < 3 * sms   ? TileConfig::k64x64
        : 8 * big < 5 * sms ? TileConfig::k128x64
                            : TileConfig::k128x128;
  } else {
    const double t_big = ceil_div(big, sms) * 1.0;
    const double t_narrow = ceil_div(tiles_for(p, TileConfig::k128x64), sms) * kNarrowOverBig;
    c = t_narrow < t_big ? TileConfig::k128x64 : TileConfig::k128x128;
  }
  // (128x64 exists for dual-congruous problems only: crosswise ones fall to 64x64.)
  const bool congruous = p.a_congruous && p.b_congruous;
  if (c == TileConfig::k128x128 && !fits(c, d)) c = congruous ? TileConfig::k128x64 : TileConfig::k64x64;
  if (c == TileConfig::k128x64 && !fits(c, d)) c = TileConfig::k64x64;
  return c;
}

constexpr GemmPlan plan_gemm(const GemmProblem& p, const DeviceLimits& d) {
  const TileConfig c = choose_tile(p, d);
  const TileShape s = tile_shape(c);
  const int tm = ceil_div(p.m, s.bm), tn = ceil_div(p.n, s.bn);
  const int group = tm < 8 ? tm : 8;
  return GemmPlan{c, tm, tn, tm * tn, s.threads, s.smem_bytes, group, ctas_per_sm(c, d)};
}

// ============================================================== canonical problem
// The user's problem: C[M,N] = scale * op(a) @ op(b) + bias, a is [M,K] ([K,M] if
// trans_a), b is [K,N] ([N,K] if trans_b), both with unit stride in their last dim.
struct GemmArgs {
  const uint8_t* a;
  const uint8_t* b;
  uint16_t* c;
  const uint16_t* bias;
  const float* scale;
  int m, n, k;
  int64_t lda, ldb, ldc;  // row strides of a, b, c as stored
  bool trans_a, trans_b;
  FP8Format fmt_a, fmt_b;
};

struct CanonicalGemm {
  FP8Params params;
  LayoutPair layouts;
  FP8Format fmt_a, fmt_b;  // of the kernel's A and B (swapped with the operands)
  GemmProblem problem;
};

inline bool aligned16(const void* ptr, int64_t ld) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0 && ld % 16 == 0;
}

// a congruous <=> stored [M][K] (no trans_a); b congruous <=> stored [N][K] (trans_b).
// The crosswise-A / congruous-B pair runs as its transpose C^T = op(b)^T op(a)^T, whose
// kernel A (= b, congruous) and B (= a, crosswise) make the congruous/crosswise pair:
// one instantiation fewer per tile configuration; the epilogue scatters transposed.
inline CanonicalGemm canonicalize_gemm(const GemmArgs& g) {
  const bool a_cong = !g.trans_a, b_cong = g.trans_b;
  CanonicalGemm out{};
  FP8Params& p = out.params;
  p.c = g.c;
  p.bias = g.bias;
  p.scale = g.scale;
  p.ldc = g.ldc;
  p.c_vec = aligned16(g.c, g.ldc * 2) ? 1 : 0;
  const bool swap = !a_cong && b_cong;
  if (!swap) {
    p.a = g.a, p.b = g.b, p.lda = g.lda, p.ldb = g.ldb;
    p.m = g.m, p.n = g.n, p.k = g.k;
    out.fmt_a = g.fmt_a, out.fmt_b = g.fmt_b;
    out.layouts = a_cong ? (b_cong ? LayoutPair::kCC : LayoutPair::kCX) : LayoutPair::kXX;
  } else {
    p.a = g.b, p.b = g.a, p.lda = g.ldb, p.ldb = g.lda;
    p.m = g.n, p.n = g.m, p.k = g.k;
    out.fmt_a = g.fmt_b, out.fmt_b = g.fmt_a;
    out.layouts = LayoutPair::kCX;
  }
  p.swap_ab = swap ? 1 : 0;
  p.a_vec = aligned16(p.a, p.lda) ? 1 : 0;
  p.b_vec = aligned16(p.b, p.ldb) ? 1 : 0;
  const bool kernel_a_cong = out.layouts == LayoutPair::kCC || out.layouts == LayoutPair::kCX;
  const bool kernel_b_cong = out.layouts == LayoutPair::kCC;
  out.problem = GemmProblem{p.m, p.n, p.k, kernel_a_cong, kernel_b_cong};
  return out;
}

// ============================================================== launch
template <TileConfig C, FP8Format FA, FP8Format FB, class LA, class LB>
void launch_one(FP8Params p, const GemmPlan& plan, cudaStream_t stream) {
  using Policy = Fp8GemmPolicy<TraitsFor<C, FA, FB>, LA, LB, MmaSyncMainloopTag>;
  using Mainloop = typename MainloopFor<typename Policy::MainloopTag, Policy>::type;
  static_assert(Mainloop::kSmemBytes == tile_shape_of<C>().smem_bytes, "planner/kernel smem");
  auto kernel = fp8_gemm_kernel<Policy>;
  ASTRAI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Mainloop::kSmemBytes));
  p.group_m = plan.group_m;
  kernel<<<plan.grid, Policy::kThreads, Mainloop::kSmemBytes, stream>>>(p, plan.tiles_m,
                                                                       plan.tiles_n);
  ASTRAI_CHECK_LAUNCH();
}

// Instantiated: every tile for the dual-congruous pair; 64x64 and 128x128 for the
// crosswise pairs (the planner never gives them 128x64): 7 kernels per format pair.
template <TileConfig C, FP8Format FA, FP8Format FB>
void launch_layouts(const CanonicalGemm& g, const GemmPlan& plan, cudaStream_t stream) {
  if (g.layouts == LayoutPair::kCC)
    return launch_one<C, FA, FB, Congruous, Congruous>(g.params, plan, stream);
  if constexpr (C != TileConfig::k128x64) {
    if (g.layouts == LayoutPair::kCX)
      return launch_one<C, FA, FB, Congruous, Crosswise>(g.params, plan, stream);
    return launch_one<C, FA, FB, Crosswise, Crosswise>(g.params, plan, stream);
  } else {
    ASTRAI_CHECK(false, "fp8_gemm: no 128x64 kernel for crosswise operands (planner bug)");
  }
}

template <FP8Format FA, FP8Format FB>
void launch_tiles(const CanonicalGemm& g, const GemmPlan& plan, cudaStream_t stream) {
  switch (plan.tile) {
    case TileConfig::k64x64: return launch_layouts<TileConfig::k64x64, FA, FB>(g, plan, stream);
    case TileConfig::k128x64: return launch_layouts<TileConfig::k128x64, FA, FB>(g, plan, stream);
    case TileConfig::k128x128: return launch_layouts<TileConfig::k128x128, FA, FB>(g, plan, stream);
  }
}

// With ASTRAI_FP8_SPLIT_INSTANCES the kernels of each format pair are compiled in their
// own translation unit (instances/gemm_<a>_<b>.cu) so a build compiles them in parallel;
// without it (the standalone test) the including TU instantiates everything itself.
#if defined(ASTRAI_FP8_SPLIT_INSTANCES)
#define ASTRAI_FP8_EXTERN_TILES(FA, FB)                                                  \
  extern template void launch_tiles<FP8Format::FA, FP8Format::FB>(const CanonicalGemm&, \
                                                                   const GemmPlan&, cudaStream_t);
ASTRAI_FP8_EXTERN_TILES(E4M3, E4M3)
ASTRAI_FP8_EXTERN_TILES(E4M3, E5M2)
ASTRAI_FP8_EXTERN_TILES(E5M2, E4M3)
ASTRAI_FP8_EXTERN_TILES(E5M2, E5M2)
#undef ASTRAI_FP8_EXTERN_TILES
#endif

inline void launch_plan(const CanonicalGemm& g, const GemmPlan& plan, cudaStream_t stream) {
  using F = FP8Format;
  const bool a4 = g.fmt_a == F::E4M3, b4 = g.fmt_b == F::E4M3;
  if (a4 && b4) return launch_tiles<F::E4M3, F::E4M3>(g, plan, stream);
  if (a4) return launch_tiles<F::E4M3, F::E5M2>(g, plan, stream);
  if (b4) return launch_tiles<F::E5M2, F::E4M3>(g, plan, stream);
  return launch_tiles<F::E5M2, F::E5M2>(g, plan, stream);
}

inline DeviceLimits device_limits(int device) {
  DeviceLimits d{};
  d.sms = multiprocessor_count(device);
  d.smem_per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  d.smem_per_block = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return d;
}

// The entry: arguments must already be validated (ops.cu / the test do it).
inline GemmPlan gemm(const GemmArgs& args, const DeviceLimits& dev, cudaStream_t stream) {
  const CanonicalGemm g = canonicalize_gemm(args);
  const GemmPlan plan = plan_gemm(g.problem, dev);
  launch_plan(g, plan, stream);
  return plan;
}

}  // namespace astrai::fp8
