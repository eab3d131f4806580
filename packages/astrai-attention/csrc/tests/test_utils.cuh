// Helpers shared by the standalone attention tests: CUDA checks, bf16/fp16 host
// conversion, random data, a float64 host reference and error metrics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#define CK(expr)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (expr);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_),   \
                         __FILE__, __LINE__, #expr);                                      \
            std::exit(2);                                                                 \
        }                                                                                 \
    } while (0)

inline float bits_to_float(uint16_t h, bool bf16) {
    if (bf16) {
        uint32_t u = uint32_t(h) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    return __half2float(__half_raw{h});
}
inline uint16_t float_to_bits(float f, bool bf16) {
    if (bf16) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
        return uint16_t(u >> 16);
    }
    __half_raw r = __float2half_rn(f);
    return r.x;
}

// A host vector of 16-bit values with a float mirror (the rounded values).
struct HostTensor {
    std::vector<uint16_t> bits;
    std::vector<float> vals;
    void random(size_t n, std::mt19937& rng, bool bf16, float scale = 1.f) {
        std::normal_distribution<float> dist(0.f, scale);
        bits.resize(n);
        vals.resize(n);
        for (size_t i = 0; i < n; ++i) {
            bits[i] = float_to_bits(dist(rng), bf16);
            vals[i] = bits_to_float(bits[i], bf16);
        }
    }
};

template <typename T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) { CK(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T))); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    ~DeviceBuffer() { cudaFree(ptr); }
    void upload(const std::vector<T>& v) { CK(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> download() const {
        std::vector<T> v(n);
        CK(cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return v;
    }
    void poison() { CK(cudaMemset(ptr, 0xff, n * sizeof(T))); }  // NaN for 16-bit floats
};

// Softmax(q . k * scale) v over the kept columns, in float64. Rows with nothing kept -> 0.
inline void reference_row(const float* q, int D, int n, const std::function<const float*(int)>& krow,
                          const std::function<const float*(int)>& vrow, const std::function<bool(int)>& keep,
                          double* out) {
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> s(n);
    double mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
        if (!keep(j)) { s[j] = -INFINITY; continue; }
        const float* k = krow(j);
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += double(q[d]) * k[d];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
    }
    for (int d = 0; d < D; ++d) out[d] = 0;
    if (mx == -INFINITY) return;
    double l = 0;
    for (int j = 0; j < n; ++j) {
        if (s[j] == -INFINITY) continue;
        const double p = std::exp(s[j] - mx);
        l += p;
        const float* v = vrow(j);
        for (int d = 0; d < D; ++d) out[d] += p * v[d];
    }
    for (int d = 0; d < D; ++d) out[d] /= l;
}

// Accumulates max |err| and the relative L2 error; NaN anywhere fails.
struct ErrorStats {
    double max_abs = 0, num = 0, den = 0;
    bool nan = false;
    void add(double got, double ref) {
        if (!std::isfinite(got)) nan = true;
        max_abs = std::max(max_abs, std::fabs(got - ref));
        num += (got - ref) * (got - ref);
        den += ref * ref;
    }
    double rel() const { return den > 0 ? std::sqrt(num / den) : std::sqrt(num); }
    bool ok(double tol) const { return !nan && rel() < tol; }
};

// Median kernel time in microseconds of fn over `iters` timed runs after warmup.
inline double time_us(const std::function<void()>& fn, int iters = 50) {
    for (int i = 0; i < 5; ++i) fn();
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int i = 0; i < iters; ++i) {
        CK(cudaEventRecord(a));
        fn();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        ts.push_back(ms * 1000.f);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
}
