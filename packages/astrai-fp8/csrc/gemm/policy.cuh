// GEMM policy: the kernel's single template parameter.
//
// A policy bundles the tile traits (common.h), the two operand layout tags and a mainloop
// tag; `Policy::Mainloop` is what the tag selects (MainloopFor below), so a second
// mainloop plugs in beside the mma.sync one without touching loads, scheduler, epilogue
// or host planning:
//
//   MmaSyncMainloopTag   mainloop.cuh: cp.async / direct loads into a kStages+1 ring,
//                        ldmatrix + mma.sync m16n8k32 (native on sm_89/sm_120, emulated
//                        through f16 on sm_90/sm_100).
//   Sm90WgmmaMainloopTag (slot) a Hopper mainloop that wants this kernel's scheduler and
//                        epilogue specialises MainloopFor<Sm90WgmmaMainloopTag, Policy>
//                        with the same surface (kThreads, kSmemBytes, Accum, run, visit).
//                        (The wgmma kernel in gemm/sm90/ is a separate persistent kernel
//                        with its own scheduler/epilogue; ops.cu offers it calls first.)
//
// Fp8GemmSmem is the shared-memory budget of one CTA (the mainloop ring, re-used by the
// epilogue's bf16 staging tile) and the occupancy it allows under a per-SM budget.
#pragma once

#include "../common.h"

namespace astrai::fp8 {

struct MmaSyncMainloopTag {};
struct Sm90WgmmaMainloopTag;  // defined by gemm/sm90/ (the Hopper mainloop)

template <class Tag, class Policy>
struct MainloopFor;  // specialised by each mainloop header

template <class Traits_, class LayoutA_, class LayoutB_, class MainloopTag_ = MmaSyncMainloopTag>
struct Fp8GemmPolicy {
  using Traits = Traits_;
  using LayoutA = LayoutA_;
  using LayoutB = LayoutB_;
  using MainloopTag = MainloopTag_;
  static constexpr int kThreads = Traits::kThreads;
  // Ask ptxas for a register budget that keeps two CTAs of 128 threads (or one of 256
  // beside another) resident: 255 registers max either way, no forced spills.
  static constexpr int kMinBlocks = Traits::kThreads == 128 ? 2 : 1;
};

template <class Traits>
struct Fp8GemmSmem {
  static constexpr int kTileA = Traits::kBlockM * Traits::kBlockK;
  static constexpr int kTileB = Traits::kBlockN * Traits::kBlockK;
  static constexpr int kRing = Traits::kRing * (kTileA + kTileB);
  // Epilogue staging: bf16 [rows][cols + 8] for either orientation (swap_ab transposes it).
  static constexpr int kPitchPad = 8;
  static constexpr int kBig = Traits::kBlockM > Traits::kBlockN ? Traits::kBlockM : Traits::kBlockN;
  static constexpr int kSmall = Traits::kBlockM > Traits::kBlockN ? Traits::kBlockN : Traits::kBlockM;
  static constexpr int kEpilogue = kBig * (kBig + kPitchPad) * 2;
  static constexpr int kBytes = kRing > kEpilogue ? kRing : kEpilogue;

  // CTAs per SM allowed by shared memory alone (registers are checked by ptxas / launch).
  static constexpr int ctas_per_sm(int smem_per_sm, int reserved_per_cta = 1024) {
    return smem_per_sm / (kBytes + reserved_per_cta);
  }
};

}  // namespace astrai::fp8
