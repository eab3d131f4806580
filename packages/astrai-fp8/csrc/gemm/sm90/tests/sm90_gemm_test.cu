// Standalone check and benchmark of the Hopper FP8 GEMM (wgmma + TMA, sm_90a).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a \
//        -I packages/astrai-fp8/csrc/gemm/sm90 -I packages/cuda-common/include \
//        packages/astrai-fp8/csrc/gemm/sm90/tests/sm90_gemm_test.cu -o /tmp/sm90_gemm_test
//   /tmp/sm90_gemm_test quick | full | sanitize | bench | configs   [--json FILE]
//
// Correctness: fresh random fp8 operands per case, the output poisoned with NaN (and a
// poisoned margin of extra rows / columns that must stay untouched), a float64 reference
// on sampled rows (all rows for small M), ||out - ref|| / ||ref|| per case.
// Timing: CUDA events around each launch after warm-up, the median of the repeats.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dispatch.cuh"

using namespace astrai::fp8::sm90;

#define CHECK_CUDA(x)                                                                     \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                \
                         cudaGetErrorString(e_));                                         \
            std::exit(2);                                                                 \
        }                                                                                 \
    } while (0)

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return static_cast<uint32_t>(x);
}

__device__ __forceinline__ float uniform(uint64_t seed, uint64_t i) {
    return (hash32(seed * 0x9E3779B97F4A7C15ULL + i) >> 8) * (1.0f / 16777216.0f) * 2.f - 1.f;
}

// rows x cols fp8 with pitch ld; pad columns get random bytes too (they must be ignored)
__global__ void fill_fp8(uint8_t* p, int64_t rows, int64_t ld, int kind, uint64_t seed, float amp) {
    const int64_t n = rows * ld;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        const float v = uniform(seed, i) * amp;
        p[i] = kind == 0 ? __nv_fp8_e4m3(v).__x : __nv_fp8_e5m2(v).__x;
    }
}

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x)
        p[i] = __float2bfloat16(uniform(seed, i));
}

// counts non-finite values inside [M, N] and finite values in the poisoned margin
__global__ void scan_out(const void* out, int out_f32, int64_t rows_alloc, int64_t ldc, int64_t M,
                         int64_t N, unsigned long long* bad_in, unsigned long long* bad_out) {
    const int64_t n = rows_alloc * ldc;
    unsigned long long in = 0, outside = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        const float v = out_f32 ? static_cast<const float*>(out)[i]
                                : __bfloat162float(static_cast<const __nv_bfloat16*>(out)[i]);
        const int64_t r = i / ldc, c = i % ldc;
        const bool inside = r < M && c < N;
        if (inside && !isfinite(v)) ++in;
        if (!inside && isfinite(v)) ++outside;
    }
    if (in) atomicAdd(bad_in, in);
    if (outside) atomicAdd(bad_out, outside);
}

template <class T>
__device__ __forceinline__ double fp8_val(uint8_t x) {
    T t;
    t.__x = x;
    return static_cast<double>(static_cast<float>(t));
}

// ref[r][n] = scale * sum_k A[rows[r], k] * B[n, k] + bias[n], in float64; 8 rows a block
template <class TA, class TB>
__global__ void reference(const uint8_t* A, int64_t lda, const uint8_t* B, int64_t ldb, int K,
                          int N, const int* rows, int R, const float* scale,
                          const __nv_bfloat16* bias, double* ref) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int r0 = blockIdx.y * 8;
    if (n >= N) return;
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const uint8_t* b = B + int64_t(n) * ldb;
    for (int k = 0; k < K; ++k) {
        const double bv = fp8_val<TB>(b[k]);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (r0 + i < R) acc[i] += fp8_val<TA>(A[int64_t(rows[r0 + i]) * lda + k]) * bv;
    }
    const double bb = bias ? double(__bfloat162float(bias[n])) : 0.0;
    for (int i = 0; i < 8; ++i)
        if (r0 + i < R) ref[int64_t(r0 + i) * N + n] = double(*scale) * acc[i] + bb;
}

struct Case {
    int64_t M, N, K;
    Accum accum;
    bool bias;
    bool out_f32 = false;
    Fp8Kind ka = Fp8Kind::E4M3, kb = Fp8Kind::E4M3;
    int64_t pad_k = 0;  // lda = ldb = K + pad_k
    int force = -1;
};

struct Outcome {
    double rel = 0, max_rel = 0, ms = 0, tflops = 0;
    unsigned long long bad_in = 0, bad_out = 0;
    std::string error;
    int config = -1;
};

static uint64_t g_seed = 1234;

static const char* kind_name(Fp8Kind k) { return k == Fp8Kind::E4M3 ? "e4m3" : "e5m2"; }

static Outcome run_case(const Case& c, bool check, int reps) {
    Outcome o;
    const int64_t lda = c.K + c.pad_k, ldb = c.K + c.pad_k;
    const int64_t ldc = c.N + (c.N % 2 ? 3 : 8);  // poisoned margin columns
    const int64_t rows_alloc = c.M + 1;            // and one margin row
    uint8_t *A, *B;
    void* out;
    __nv_bfloat16* bias = nullptr;
    float* scale;
    CHECK_CUDA(cudaMalloc(&A, c.M * lda));
    CHECK_CUDA(cudaMalloc(&B, c.N * ldb));
    const size_t esz = c.out_f32 ? 4 : 2;
    CHECK_CUDA(cudaMalloc(&out, rows_alloc * ldc * esz));
    CHECK_CUDA(cudaMalloc(&scale, sizeof(float)));
    if (c.bias) CHECK_CUDA(cudaMalloc(&bias, c.N * sizeof(__nv_bfloat16)));
    const float h_scale = 0.37f;
    CHECK_CUDA(cudaMemcpy(scale, &h_scale, sizeof(float), cudaMemcpyHostToDevice));
    fill_fp8<<<1024, 256>>>(A, c.M, lda, int(c.ka), ++g_seed, 4.f);
    fill_fp8<<<1024, 256>>>(B, c.N, ldb, int(c.kb), ++g_seed, 4.f);
    if (bias) fill_bf16<<<256, 256>>>(bias, c.N, ++g_seed);
    CHECK_CUDA(cudaMemset(out, 0xFF, rows_alloc * ldc * esz));
    CHECK_CUDA(cudaGetLastError());

    GemmArgs a;
    a.M = c.M; a.N = c.N; a.K = c.K;
    a.a = A; a.lda = lda; a.b = B; a.ldb = ldb;
    a.out = out; a.ldc = ldc; a.out_f32 = c.out_f32;
    a.bias = bias; a.scale = scale;
    a.kind_a = c.ka; a.kind_b = c.kb; a.accum = c.accum; a.force_config = c.force;
    Result r = run_gemm(a, 0);
    o.config = r.plan.config;
    if (!r.error.empty()) {
        o.error = r.error;
    } else {
        CHECK_CUDA(cudaDeviceSynchronize());
    }
    if (o.error.empty() && check) {
        unsigned long long* cnt;
        CHECK_CUDA(cudaMalloc(&cnt, 2 * sizeof(unsigned long long)));
        CHECK_CUDA(cudaMemset(cnt, 0, 2 * sizeof(unsigned long long)));
        scan_out<<<1024, 256>>>(out, c.out_f32, rows_alloc, ldc, c.M, c.N, cnt, cnt + 1);
        unsigned long long h[2];
        CHECK_CUDA(cudaMemcpy(h, cnt, sizeof(h), cudaMemcpyDeviceToHost));
        o.bad_in = h[0];
        o.bad_out = h[1];
        CHECK_CUDA(cudaFree(cnt));

        std::vector<int> rows;
        if (c.M <= 256) {
            for (int i = 0; i < c.M; ++i) rows.push_back(i);
        } else {
            const int64_t fixed[] = {0, 1, 63, 64, 127, 128, c.M / 2, c.M - 129, c.M - 2, c.M - 1};
            for (int64_t v : fixed) rows.push_back(int(v));
            srand(unsigned(g_seed));
            while (rows.size() < 64) rows.push_back(int(rand() % c.M));
        }
        const int R = int(rows.size());
        int* d_rows;
        double* d_ref;
        CHECK_CUDA(cudaMalloc(&d_rows, R * sizeof(int)));
        CHECK_CUDA(cudaMalloc(&d_ref, size_t(R) * c.N * sizeof(double)));
        CHECK_CUDA(cudaMemcpy(d_rows, rows.data(), R * sizeof(int), cudaMemcpyHostToDevice));
        dim3 grid(unsigned((c.N + 127) / 128), unsigned((R + 7) / 8));
        if (c.ka == Fp8Kind::E4M3 && c.kb == Fp8Kind::E4M3)
            reference<__nv_fp8_e4m3, __nv_fp8_e4m3><<<grid, 128>>>(A, lda, B, ldb, int(c.K), int(c.N), d_rows, R, scale, bias, d_ref);
        else if (c.ka == Fp8Kind::E5M2 && c.kb == Fp8Kind::E4M3)
            reference<__nv_fp8_e5m2, __nv_fp8_e4m3><<<grid, 128>>>(A, lda, B, ldb, int(c.K), int(c.N), d_rows, R, scale, bias, d_ref);
        else if (c.ka == Fp8Kind::E4M3 && c.kb == Fp8Kind::E5M2)
            reference<__nv_fp8_e4m3, __nv_fp8_e5m2><<<grid, 128>>>(A, lda, B, ldb, int(c.K), int(c.N), d_rows, R, scale, bias, d_ref);
        else
            reference<__nv_fp8_e5m2, __nv_fp8_e5m2><<<grid, 128>>>(A, lda, B, ldb, int(c.K), int(c.N), d_rows, R, scale, bias, d_ref);
        CHECK_CUDA(cudaGetLastError());
        std::vector<double> ref(size_t(R) * c.N);
        CHECK_CUDA(cudaMemcpy(ref.data(), d_ref, ref.size() * sizeof(double), cudaMemcpyDeviceToHost));
        std::vector<uint8_t> row(c.N * esz);
        double num = 0, den = 0, max_err = 0, max_ref = 0;
        for (int i = 0; i < R; ++i) {
            CHECK_CUDA(cudaMemcpy(row.data(), static_cast<uint8_t*>(out) + size_t(rows[i]) * ldc * esz,
                                  c.N * esz, cudaMemcpyDeviceToHost));
            for (int64_t n = 0; n < c.N; ++n) {
                double got;
                if (c.out_f32) {
                    float f;
                    std::memcpy(&f, &row[n * 4], 4);
                    got = f;
                } else {
                    uint16_t h16;
                    std::memcpy(&h16, &row[n * 2], 2);
                    uint32_t u = uint32_t(h16) << 16;
                    float f;
                    std::memcpy(&f, &u, 4);
                    got = f;
                }
                const double rv = ref[size_t(i) * c.N + n];
                const double d = std::isfinite(got) ? got - rv : INFINITY;
                num += d * d;
                den += rv * rv;
                max_err = std::max(max_err, std::fabs(d));
                max_ref = std::max(max_ref, std::fabs(rv));
            }
        }
        o.rel = std::sqrt(num / std::max(den, 1e-300));
        o.max_rel = max_err / std::max(max_ref, 1e-300);
        CHECK_CUDA(cudaFree(d_rows));
        CHECK_CUDA(cudaFree(d_ref));
    }
    if (o.error.empty() && reps > 0) {
        for (int i = 0; i < 3; ++i) run_gemm(a, 0);
        cudaEvent_t e0, e1;
        CHECK_CUDA(cudaEventCreate(&e0));
        CHECK_CUDA(cudaEventCreate(&e1));
        std::vector<float> t;
        for (int i = 0; i < reps; ++i) {
            CHECK_CUDA(cudaEventRecord(e0));
            run_gemm(a, 0);
            CHECK_CUDA(cudaEventRecord(e1));
            CHECK_CUDA(cudaEventSynchronize(e1));
            float ms;
            CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
            t.push_back(ms);
        }
        CHECK_CUDA(cudaGetLastError());
        std::sort(t.begin(), t.end());
        o.ms = t[t.size() / 2];
        o.tflops = 2.0 * c.M * c.N * c.K / (o.ms * 1e-3) / 1e12;
        CHECK_CUDA(cudaEventDestroy(e0));
        CHECK_CUDA(cudaEventDestroy(e1));
    }
    CHECK_CUDA(cudaFree(A));
    CHECK_CUDA(cudaFree(B));
    CHECK_CUDA(cudaFree(out));
    CHECK_CUDA(cudaFree(scale));
    if (bias) CHECK_CUDA(cudaFree(bias));
    return o;
}

// tolerance on ||out - ref|| / ||ref||: bf16 rounding of the output dominates (~1e-3)
static double tolerance(const Case& c) {
    if (!c.out_f32) return 8e-3;
    return c.accum == Accum::Promote ? 5e-4 : 8e-3;  // Hopper FP8 wgmma sums keep ~2^-13
}

int main(int argc, char** argv) {
    const std::string mode = argc > 1 ? argv[1] : "quick";
    FILE* json = nullptr;
    for (int i = 2; i + 1 < argc; ++i)
        if (std::string(argv[i]) == "--json") json = std::fopen(argv[i + 1], "w");

    if (mode == "probe") {  // the binary loads on this machine
        std::printf("probe ok\n");
        return 0;
    }
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("device %s sm_%d%d, %d SMs, smem opt-in %zu B, L2 %d B\n", prop.name, prop.major,
                prop.minor, prop.multiProcessorCount, prop.sharedMemPerBlockOptin, prop.l2CacheSize);

    std::vector<Case> cases;
    bool check = true;
    int reps = 0;
    const Accum P = Accum::Promote, F = Accum::Fast;
    const int64_t llm[4][2] = {{8192, 8192}, {28672, 8192}, {8192, 28672}, {10240, 8192}};
    if (mode == "quick" || mode == "full") {
        const int64_t odd[][3] = {{1088, 1088, 1088}, {77, 300, 272}, {129, 257, 144}, {1, 1, 16},
                                  {3000, 5000, 4000}, {1000, 999, 1008}, {256, 8, 48}, {64, 200, 16}};
        for (auto& s : odd)
            for (int f = 0; f < kNumTileConfigs; ++f) cases.push_back({s[0], s[1], s[2], kTileConfigs[f].promote ? P : F, f >= 2, false, Fp8Kind::E4M3, Fp8Kind::E4M3, 0, f});
        cases.push_back({1000, 1000, 1024, P, true, false, Fp8Kind::E5M2, Fp8Kind::E4M3});
        cases.push_back({1000, 1000, 1024, P, true, false, Fp8Kind::E4M3, Fp8Kind::E5M2});
        cases.push_back({1000, 1000, 1024, F, false, false, Fp8Kind::E5M2, Fp8Kind::E5M2});
        cases.push_back({512, 768, 1024, P, true, false, Fp8Kind::E4M3, Fp8Kind::E4M3, 64});
        cases.push_back({512, 768, 1040, F, false, false, Fp8Kind::E4M3, Fp8Kind::E4M3, 16});
        for (int64_t K : {8192L, 28672L})
            for (Accum acc : {P, F}) cases.push_back({1024, 1024, K, acc, false, true});
        const int64_t ms_quick[] = {1, 128, 4096};
        const int64_t ms_full[] = {1, 16, 128, 1024, 4096, 8192};
        const bool full = mode == "full";
        for (auto& nk : llm)
            for (int64_t M : full ? std::vector<int64_t>(ms_full, ms_full + 6) : std::vector<int64_t>(ms_quick, ms_quick + 3))
                for (Accum acc : {P, F}) cases.push_back({M, nk[0], nk[1], acc, (M % 3) != 0});
    } else if (mode == "sanitize") {
        const int64_t s3[][3] = {{128, 256, 256}, {77, 300, 272}, {256, 512, 1040}};
        for (auto& s : s3)
            for (int f = 0; f < kNumTileConfigs; ++f) cases.push_back({s[0], s[1], s[2], kTileConfigs[f].promote ? P : F, true, false, Fp8Kind::E4M3, Fp8Kind::E4M3, 0, f});
    } else if (mode == "bench" || mode == "configs") {
        check = false;
        reps = 20;
        const int64_t ms[] = {1, 16, 128, 1024, 4096, 8192};
        for (auto& nk : llm)
            for (int64_t M : ms) {
                if (mode == "bench") {
                    for (Accum acc : {P, F}) cases.push_back({M, nk[0], nk[1], acc, false});
                } else if (M >= 1024) {
                    for (int f = 0; f < kNumTileConfigs; ++f)
                        if (!kTileConfigs[f].swap) cases.push_back({M, nk[0], nk[1], kTileConfigs[f].promote ? P : F, false, false, Fp8Kind::E4M3, Fp8Kind::E4M3, 0, f});
                }
            }
        cases.push_back({8192, 8192, 8192, P, false});
        cases.push_back({8192, 8192, 8192, F, false});
    } else {
        std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
        return 2;
    }

    int failures = 0;
    std::printf("%-22s %-5s %-9s %-4s %-3s %4s %10s %10s %6s %6s %9s %8s  %s\n", "MxNxK", "acc",
                "fmt", "bias", "out", "cfg", "rel_err", "max_rel", "nan_in", "margin", "ms",
                "TFLOP/s", "status");
    for (const Case& c : cases) {
        Outcome o = run_case(c, check, reps);
        bool ok = o.error.empty();
        if (ok && check)
            ok = o.bad_in == 0 && o.bad_out == 0 && o.rel < tolerance(c) && std::isfinite(o.rel);
        if (!ok) ++failures;
        char shape[64];
        std::snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)c.M, (long long)c.N, (long long)c.K);
        char fmt[16];
        std::snprintf(fmt, sizeof fmt, "%s.%s", kind_name(c.ka), kind_name(c.kb));
        std::printf("%-22s %-5s %-9s %-4s %-3s %4d %10.3e %10.3e %6llu %6llu %9.4f %8.1f  %s%s\n", shape,
                    c.accum == P ? "prom" : "fast", fmt, c.bias ? "yes" : "no", c.out_f32 ? "f32" : "b16",
                    o.config, o.rel, o.max_rel, o.bad_in, o.bad_out, o.ms, o.tflops, ok ? "ok" : "FAIL ",
                    o.error.c_str());
        if (json)
            std::fprintf(json,
                         "{\"M\":%lld,\"N\":%lld,\"K\":%lld,\"accum\":\"%s\",\"fmt\":\"%s\",\"bias\":%d,"
                         "\"out_f32\":%d,\"pad_k\":%lld,\"config\":%d,\"rel_err\":%.6e,\"max_rel\":%.6e,"
                         "\"nan_in\":%llu,\"margin\":%llu,\"ms\":%.6f,\"tflops\":%.2f,\"ok\":%d}\n",
                         (long long)c.M, (long long)c.N, (long long)c.K, c.accum == P ? "promote" : "fast",
                         fmt, c.bias, c.out_f32, (long long)c.pad_k, o.config, o.rel, o.max_rel, o.bad_in,
                         o.bad_out, o.ms, o.tflops, ok);
        std::fflush(stdout);
    }
    if (json) std::fclose(json);
    std::printf("%s: %zu cases, %d failed\n", mode.c_str(), cases.size(), failures);
    return failures == 0 ? 0 : 1;
}
