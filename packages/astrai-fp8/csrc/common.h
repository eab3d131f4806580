// FP8 family: formats, GEMM traits, parameter PODs and operand layout tags.
// Plain host/device header: no torch, no pybind, no kernels.
#pragma once

#include <cstdint>

namespace astrai::fp8 {

// The two OCP FP8 formats. Values match the manifest/ABI dtype codes minus 3
// (float8_e4m3fn = 3, float8_e5m2 = 4) only by coincidence; never cast between them.
enum class FP8Format : int { E4M3 = 0, E5M2 = 1 };

// Largest finite magnitude of each format (quantize saturates to it).
constexpr float fp8_max(FP8Format f) { return f == FP8Format::E4M3 ? 448.0f : 57344.0f; }

// How an operand is stored relative to the tile the tensor cores want. The mma.sync
// m16n8k32 fragments of BOTH operands are K-contiguous, so:
//   Congruous: K is the contiguous dimension in global memory (A as [M][K], B as [N][K]);
//              16-byte chunks copy straight into the tile (cp.async).
//   Crosswise: M (for A) or N (for B) is contiguous (A as [K][M], B as [K][N]);
//              the tile needs a byte transpose on the way in (LDG + PRMT + STS).
struct Congruous {
  static constexpr bool kCongruous = true;
};
struct Crosswise {
  static constexpr bool kCongruous = false;
};

// Compile-time shape of one GEMM tile configuration. Every field is checked here so a
// bad combination fails at instantiation, not at run time.
template <FP8Format FmtA_, FP8Format FmtB_, int BlockM_, int BlockN_, int WarpsM_, int WarpsN_,
          int Stages_>
struct Fp8GemmTraits {
  static constexpr FP8Format FmtA = FmtA_;
  static constexpr FP8Format FmtB = FmtB_;
  static constexpr int kBlockM = BlockM_;
  static constexpr int kBlockN = BlockN_;
  static constexpr int kBlockK = 64;  // bytes == elements per k-tile (4 chunks of 16 B)
  static constexpr int kWarpsM = WarpsM_;
  static constexpr int kWarpsN = WarpsN_;
  static constexpr int kWarps = WarpsM_ * WarpsN_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = Stages_;    // tiles in flight
  static constexpr int kRing = Stages_ + 1;  // buffers per operand ring (see mainloop.cuh)
  static constexpr int kWarpM = BlockM_ / WarpsM_;
  static constexpr int kWarpN = BlockN_ / WarpsN_;
  static constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 32;
  static constexpr int kFragM = kWarpM / kMmaM;  // m16 fragments per warp
  static constexpr int kFragN = kWarpN / kMmaN;  // n8 fragments per warp
  static constexpr int kKSteps = kBlockK / kMmaK;
  static constexpr int kChunks = kBlockK / 16;   // 16-byte chunks per tile row

  static_assert(BlockM_ % (WarpsM_ * 16) == 0, "warp tile M must be a multiple of 16");
  static_assert(BlockN_ % (WarpsN_ * 16) == 0, "warp tile N must be a multiple of 16 (ldmatrix.x4 loads two n8 fragments)");
  static_assert(Stages_ >= 2 && Stages_ <= 6, "2..6 stages");
  static_assert(kThreads == 128 || kThreads == 256, "4 or 8 warps");
  static_assert(kFragM * kFragN * 4 <= 128, "accumulators exceed 128 registers per thread");
};

// GEMM arguments as the kernel sees them (already canonicalised: see gemm.cuh).
//   C[m][n] = scale * sum_k A(m,k) * B(k,n) + bias[n]      (C is bf16, row-major, ldc)
// A(m,k) = a[m*lda + k] when A is congruous, a[k*lda + m] when crosswise;
// B(k,n) = b[n*ldb + k] when B is congruous, b[k*ldb + n] when crosswise.
// With swap_ab the kernel computes E = C^T (rows of E are columns of C), so the epilogue
// writes E[i][j] to C[j][i] and bias is indexed by the kernel's row.
struct FP8Params {
  const uint8_t* a;
  const uint8_t* b;
  uint16_t* c;             // bf16 bits
  const uint16_t* bias;    // bf16 bits, may be null; length = columns of C
  const float* scale;      // device scalar: combined dequant scale
  int m, n, k;             // kernel problem (after any swap)
  int64_t lda, ldb, ldc;   // in elements
  int swap_ab;             // 1: the kernel problem is C^T (see above)
  int group_m;             // grouped raster: tile rows per group
  int a_vec, b_vec, c_vec; // 1: rows of a / b / c start 16-byte aligned (vector paths)
};

// Quantize arguments: q = saturate(x * scale) in the chosen format, amax = max |x|.
struct FP8QuantizeParams {
  const void* x;           // [rows][cols] with row stride ldx (elements), unit column stride
  uint8_t* q;              // [rows][cols] contiguous, or null
  uint8_t* q_t;            // [cols][rows] contiguous, or null
  float* amax;             // device scalar, must be zeroed before the launch sequence
  const float* scale;      // device scalar: the quantization multiplier
  int rows, cols;
  int64_t ldx;
};

// Input dtypes the quantize kernels accept (ABI codes from astrai/dtype.h).
enum class QuantInput : int { F32 = 0, F16 = 1, BF16 = 2 };

}  // namespace astrai::fp8
