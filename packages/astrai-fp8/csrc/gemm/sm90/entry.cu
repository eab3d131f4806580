// gemm_entry (entry.h): the Hopper FP8 GEMM behind the plugin's fp8_gemm. This translation
// unit holds every instantiation of the wgmma kernel (18 tile configs x 4 format pairs);
// their bodies are compiled for sm_90a only; other archs get stubs that trap, and a build
// without any sm_90 target reports NotApplicable (astrai::built_for_sm90(), cuda-common device.cuh).
#include "entry.h"

#include "dispatch.cuh"

namespace astrai::fp8::sm90 {

EntryResult gemm_entry(const void* a, int64_t lda, bool trans_a, int fmt_a, const void* b,
                       int64_t ldb, bool trans_b, int fmt_b, void* out, int64_t ldc,
                       const void* bias, const float* scale, int64_t m, int64_t n, int64_t k,
                       bool promote, cudaStream_t stream, const float* a_scale, const float* b_scale) {
    int major = 0, minor = 0;
    if (query_current_device({{cudaDevAttrComputeCapabilityMajor, &major},
                              {cudaDevAttrComputeCapabilityMinor, &minor}}) != cudaSuccess)
        return {EntryStatus::NotApplicable, "device query failed"};
    if (major != 9 || minor != 0) return {EntryStatus::NotApplicable, "not an sm_90 device"};
    if (trans_a || !trans_b)
        return {EntryStatus::NotApplicable,
                "wgmma reads FP8 operands K-major only: needs a [M, K] (trans_a = false) and "
                "b [N, K] (trans_b = true); quantize with the transposed out_layout to get them"};
    GemmArgs g;
    g.M = m;
    g.N = n;
    g.K = k;
    g.a = a;
    g.lda = lda;
    g.b = b;
    g.ldb = ldb;
    g.out = out;
    g.ldc = ldc;
    g.bias = bias;
    g.scale = scale;
    g.a_scale = a_scale;
    g.b_scale = b_scale;
    g.kind_a = fmt_a == 1 ? Fp8Kind::E5M2 : Fp8Kind::E4M3;
    g.kind_b = fmt_b == 1 ? Fp8Kind::E5M2 : Fp8Kind::E4M3;
    g.accum = promote ? Accum::Promote : Accum::Fast;
    const Result r = run_gemm(g, stream);
    if (r.error.empty()) return {EntryStatus::Launched, ""};
    return {r.unavailable ? EntryStatus::NotApplicable : EntryStatus::Failed, r.error};
}

}  // namespace astrai::fp8::sm90
