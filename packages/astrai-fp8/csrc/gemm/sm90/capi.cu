// C entry points of the Hopper FP8 GEMM, for callers that hold raw device pointers
// (ctypes in the benchmarks and GPU tests; the plugin's pybind module wraps the same
// run_gemm). Build as a shared library:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -shared \
//        -I packages/astrai-fp8/csrc/gemm/sm90 packages/astrai-fp8/csrc/gemm/sm90/capi.cu \
//        -o libastrai_fp8_sm90.so
//
// Return codes: 0 launched; 1 the path cannot take the problem (msg: the planner trace);
// 2 a CUDA error (msg: the CUDA error string).
#include <cstring>

#include "dispatch.cuh"

using namespace astrai::fp8::sm90;

static void copy_msg(const std::string& s, char* msg, int len) {
    if (msg == nullptr || len <= 0) return;
    std::strncpy(msg, s.c_str(), static_cast<size_t>(len - 1));
    msg[len - 1] = '\0';
}

extern "C" int astrai_fp8_sm90_gemm(int64_t M, int64_t N, int64_t K, const void* a, int64_t lda,
                                    const void* b, int64_t ldb, void* out, int64_t ldc,
                                    int out_f32, const void* bias, const float* scale, int kind_a,
                                    int kind_b, int accum, int force_config, void* stream,
                                    char* msg, int msg_len) {
    GemmArgs g;
    g.M = M; g.N = N; g.K = K;
    g.a = a; g.lda = lda; g.b = b; g.ldb = ldb;
    g.out = out; g.ldc = ldc; g.out_f32 = out_f32 != 0;
    g.bias = bias; g.scale = scale;
    g.kind_a = kind_a == 1 ? Fp8Kind::E5M2 : Fp8Kind::E4M3;
    g.kind_b = kind_b == 1 ? Fp8Kind::E5M2 : Fp8Kind::E4M3;
    g.accum = accum == 1 ? Accum::Fast : Accum::Promote;
    g.force_config = force_config;
    const Result r = run_gemm(g, static_cast<cudaStream_t>(stream));
    if (r.error.empty()) {
        copy_msg(r.plan.trace, msg, msg_len);
        return 0;
    }
    copy_msg(r.error, msg, msg_len);
    return r.unavailable ? 1 : 2;
}
