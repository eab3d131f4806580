// The plugin's door into the Hopper FP8 GEMM (declaration only: no CUDA kernels here).
//
// fp8_gemm's binding (ops.cu) offers every call here first. On an sm_90 device, in a build
// with sm_90a code, a K-major problem ("TN": a [M, K] with trans_a = false, b [N, K] with
// trans_b = true) that the planner accepts runs on the wgmma + TMA kernel; anything else is
// NotApplicable, with the reason, and takes the mma.sync path. Defined in entry.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace astrai::fp8::sm90 {

enum class EntryStatus : int { Launched = 0, NotApplicable = 1, Failed = 2 };

struct EntryResult {
    EntryStatus status;
    std::string message;  // NotApplicable: why; Failed: the CUDA error
};

// out[M, N] (bf16, row pitch ldc) = scale * op(a) @ op(b) + bias, the plugin's convention:
// a is [M, K] ([K, M] if trans_a), b is [K, N] ([N, K] if trans_b); fmt 0 = e4m3, 1 = e5m2.
// promote: fp32 register sums every 128 of K (false: the tensor core's own accumulation).
// a_scale float32 [M] / b_scale float32 [N] (or null): row-wise scales, out[m, n] also times
// a_scale[m] * b_scale[n] (per-token activations times per-channel weights).
EntryResult gemm_entry(const void* a, int64_t lda, bool trans_a, int fmt_a, const void* b,
                       int64_t ldb, bool trans_b, int fmt_b, void* out, int64_t ldc,
                       const void* bias, const float* scale, int64_t m, int64_t n, int64_t k,
                       bool promote, cudaStream_t stream, const float* a_scale = nullptr,
                       const float* b_scale = nullptr);

}  // namespace astrai::fp8::sm90
