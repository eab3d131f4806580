// Standalone FP8 correctness check (no torch, no Python): quantize bytes vs a host
// conversion, the GEMM vs a float64 host reference over all four operand layouts,
// ragged shapes, K tails, bias on/off and both formats, and the delayed-scaling update
// bit for bit vs a host IEEE float32 reference. Outputs are poisoned first.
//
//   nvcc -std=c++17 -O3 -I packages/cuda-common/include -I packages/astrai-fp8/csrc \
//        -gencode=arch=compute_90a,code=sm_90a packages/astrai-fp8/csrc/tests/fp8_test.cu \
//        -o /tmp/fp8_test && /tmp/fp8_test
//   (sm_89 / sm_120: -gencode=arch=compute_89,code=sm_89 ...)
//   (the plugin builds with --use_fast_math too; add it to test what ships)
// Exit code 0 only when every case passes. `--quick` keeps the small shapes (sanitizer runs):
//   compute-sanitizer --tool memcheck /tmp/fp8_test --quick   (also racecheck, synccheck)
// `--scale-update` runs the delayed-scaling update cases alone.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gemm.cuh"
#include "quantize.cuh"
#include "scale_update.cuh"

using namespace astrai::fp8;

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

static float fp8_to_float(uint8_t b, FP8Format f) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(b, f == FP8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
  __half hv;
  std::memcpy(&hv, &h, sizeof(hv));
  return __half2float(hv);
}
static uint8_t float_to_fp8(float v, FP8Format f) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == FP8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
}
static float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t float_to_bf16(float f) {
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  uint16_t u;
  std::memcpy(&u, &b, 2);
  return u;
}

static std::mt19937 rng(1234);

static int failures = 0;

static bool gemm_case(int M, int N, int K, bool ta, bool tb, FP8Format fa, FP8Format fb,
                      bool bias, const DeviceLimits& dev) {
  std::normal_distribution<float> nd(0.f, 1.f);
  // a as stored: [M][K] or [K][M]; b: [K][N] or [N][K]; contiguous.
  std::vector<uint8_t> a(static_cast<size_t>(M) * K), b(static_cast<size_t>(K) * N);
  for (auto& v : a) v = float_to_fp8(nd(rng) * (fa == FP8Format::E4M3 ? 2.f : 8.f), fa);
  for (auto& v : b) v = float_to_fp8(nd(rng) * (fb == FP8Format::E4M3 ? 2.f : 8.f), fb);
  std::vector<uint16_t> hb(N);
  for (auto& v : hb) v = float_to_bf16(nd(rng));
  const float scale = 0.37f / std::sqrt(static_cast<float>(K));
  const int64_t lda = ta ? M : K, ldb = tb ? K : N;

  uint8_t *da, *db;
  uint16_t *dc, *dbias;
  float* dscale;
  CK(cudaMalloc(&da, a.size()));
  CK(cudaMalloc(&db, b.size()));
  CK(cudaMalloc(&dc, static_cast<size_t>(M) * N * 2));
  CK(cudaMalloc(&dbias, N * 2));
  CK(cudaMalloc(&dscale, 4));
  CK(cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, b.data(), b.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dbias, hb.data(), N * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dscale, &scale, 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dc, 0xff, static_cast<size_t>(M) * N * 2));  // bf16 NaN poison

  GemmArgs g{da, db, dc, bias ? dbias : nullptr, dscale, M, N, K, lda, ldb, N, ta, tb, fa, fb};
  GemmPlan plan{};
  try {
    plan = gemm(g, dev, nullptr);
  } catch (const std::exception& e) {
    std::printf("launch failed: %s\n", e.what());
    std::exit(2);
  }
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> c(static_cast<size_t>(M) * N);
  CK(cudaMemcpy(c.data(), dc, c.size() * 2, cudaMemcpyDeviceToHost));

  std::vector<float> af(a.size()), bf(b.size());
  for (size_t i = 0; i < a.size(); ++i) af[i] = fp8_to_float(a[i], fa);
  for (size_t i = 0; i < b.size(); ++i) bf[i] = fp8_to_float(b[i], fb);
  double err2 = 0, ref2 = 0, worst = 0;
  int unwritten = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < K; ++k) {
        const float av = ta ? af[static_cast<size_t>(k) * M + m] : af[static_cast<size_t>(m) * K + k];
        const float bv = tb ? bf[static_cast<size_t>(n) * K + k] : bf[static_cast<size_t>(k) * N + n];
        s += static_cast<double>(av) * bv;
      }
      const double ref = s * scale + (bias ? bf16_to_float(hb[n]) : 0.0);
      const float out = bf16_to_float(c[static_cast<size_t>(m) * N + n]);
      if (std::isnan(out)) ++unwritten;
      const double d = out - ref;
      err2 += d * d;
      ref2 += ref * ref;
      const double rel = std::fabs(d) / (std::fabs(ref) + 1e-2);
      if (rel > worst) worst = rel;
    }
  const double rel = std::sqrt(err2 / (ref2 > 0 ? ref2 : 1));
  const bool ok = unwritten == 0 && rel < 4e-3;
  std::printf("%-4s M=%5d N=%5d K=%5d ta=%d tb=%d %s x %s bias=%d tile=%d  rel=%.2e %s%s\n",
              ok ? "ok" : "FAIL", M, N, K, ta, tb, fa == FP8Format::E4M3 ? "e4m3" : "e5m2",
              fb == FP8Format::E4M3 ? "e4m3" : "e5m2", bias, static_cast<int>(plan.tile), rel,
              unwritten ? "UNWRITTEN " : "", unwritten ? std::to_string(unwritten).c_str() : "");
  CK(cudaFree(da));
  CK(cudaFree(db));
  CK(cudaFree(dc));
  CK(cudaFree(dbias));
  CK(cudaFree(dscale));
  if (!ok) ++failures;
  return ok;
}

template <FP8Format F>
static void quant_case(int rows, int cols, int layout, int sms) {
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<__nv_bfloat16> x(static_cast<size_t>(rows) * cols);
  float amax = 0.f;
  for (auto& v : x) {
    v = __float2bfloat16_rn(nd(rng));
    amax = std::fmax(amax, std::fabs(__bfloat162float(v)));
  }
  const float scale = 97.f / amax;  // pushes some values past the format max (saturation)
  void* dx;
  uint8_t *dq, *dqt;
  float *damax, *dscale;
  const size_t n = x.size();
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&dq, n));
  CK(cudaMalloc(&dqt, n));
  CK(cudaMalloc(&damax, 4));
  CK(cudaMalloc(&dscale, 4));
  CK(cudaMemcpy(dx, x.data(), n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dscale, &scale, 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dq, 0x7f, n));
  CK(cudaMemset(dqt, 0x7f, n));
  CK(cudaMemset(damax, 0xff, 4));
  FP8QuantizeParams p{dx, layout != 1 ? dq : nullptr, layout != 0 ? dqt : nullptr, damax, dscale,
                      rows, cols, cols};
  quantize_launch<__nv_bfloat16, F>(p, layout, sms, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<uint8_t> q(n), qt(n);
  float got_amax;
  CK(cudaMemcpy(q.data(), dq, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(qt.data(), dqt, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&got_amax, damax, 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const float v = __bfloat162float(x[static_cast<size_t>(r) * cols + c]) * scale;
      const uint8_t want = float_to_fp8(v, F);
      if (layout != 1 && q[static_cast<size_t>(r) * cols + c] != want) ++bad;
      if (layout != 0 && qt[static_cast<size_t>(c) * rows + r] != want) ++bad;
    }
  const bool ok = bad == 0 && got_amax == amax;
  std::printf("%-4s quantize %s rows=%d cols=%d layout=%d bad=%d amax %g vs %g\n", ok ? "ok" : "FAIL",
              F == FP8Format::E4M3 ? "e4m3" : "e5m2", rows, cols, layout, bad, got_amax, amax);
  if (!ok) ++failures;
  CK(cudaFree(dx));
  CK(cudaFree(dq));
  CK(cudaFree(dqt));
  CK(cudaFree(damax));
  CK(cudaFree(dscale));
}

// ------------------------------------------------------------ delayed-scaling update
static uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Row r's contents by r % 7: 0 clean; 1 pending 0 / inf / NaN in turn; 2 one NaN or inf
// inside the kept window; 3 all zeros; 4 a huge value in the slot that drops out; 5 -0.0 and
// +0.0 only with a positive pending; 6 subnormal amaxes or prev (if `subnormal`), else clean.
static void scale_update_case(int rows, int len, bool most_recent, bool alias, bool subnormal,
                              float factor) {
  std::uniform_real_distribution<float> ex(-20.f, 20.f);
  std::uniform_int_distribution<int> pos(0, len - 1);
  const float inf = INFINITY, nan = NAN;
  const size_t n = static_cast<size_t>(rows) * len;
  std::vector<float> hist(n), pending(rows), prev(rows);
  for (int r = 0; r < rows; ++r) {
    float* h = &hist[static_cast<size_t>(r) * len];
    for (int i = 0; i < len; ++i) h[i] = std::exp2(ex(rng));
    pending[r] = std::exp2(ex(rng));
    prev[r] = std::exp2(ex(rng) * 0.25f);
    switch (r % 7) {
      case 1: pending[r] = r % 3 == 0 ? 0.f : (r % 3 == 1 ? inf : nan); break;
      case 2: if (len > 1) h[pos(rng) % (len - 1)] = r % 2 ? nan : inf; break;
      case 3: for (int i = 0; i < len; ++i) h[i] = 0.f;
              pending[r] = 0.f; break;
      case 4: h[len - 1] = r % 2 ? nan : 3.0e38f; break;
      case 5: for (int i = 0; i < len; ++i) h[i] = i % 2 ? -0.f : 0.f; break;
      case 6:
        if (!subnormal) break;
        // odd rows: nothing usable, prev a subnormal with a finite reciprocal;
        // even rows: subnormal amaxes (x * factor underflows, 1 / scale overflows)
        for (int i = 0; i < len; ++i) h[i] = r % 2 ? 0.f : float_of(1u + static_cast<uint32_t>(pos(rng)) * 977u);
        pending[r] = r % 2 ? 0.f : float_of(0x00000100u + static_cast<uint32_t>(r));
        prev[r] = float_of(0x00400000u + static_cast<uint32_t>(r) * 12345u);
        break;
      default: break;
    }
  }
  // host reference: IEEE float32 with subnormals
  std::vector<float> want_hist(n), want_scale(rows), want_inv(rows);
  for (int r = 0; r < rows; ++r) {
    const float* h = &hist[static_cast<size_t>(r) * len];
    float* w = &want_hist[static_cast<size_t>(r) * len];
    w[0] = pending[r];
    for (int i = 1; i < len; ++i) w[i] = h[i - 1];
    float amax = pending[r];
    if (!most_recent) {
      amax = w[0];
      for (int i = 0; i < len; ++i) amax = std::isnan(w[i]) || std::isnan(amax) ? nan : std::fmax(amax, w[i]);
    }
    const float s = std::isfinite(amax) && amax > 0.f ? amax * factor : prev[r];
    want_scale[r] = s;
    want_inv[r] = 1.0f / s;
  }

  float *dh, *dp, *ds, *dprev, *di;
  CK(cudaMalloc(&dh, n * 4));
  CK(cudaMalloc(&dp, rows * 4));
  CK(cudaMalloc(&ds, rows * 4));
  CK(cudaMalloc(&di, rows * 4));
  CK(cudaMalloc(&dprev, rows * 4));
  CK(cudaMemcpy(dh, hist.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dp, pending.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(alias ? ds : dprev, prev.data(), rows * 4, cudaMemcpyHostToDevice));
  if (!alias) CK(cudaMemset(ds, 0xa5, rows * 4));  // poison
  CK(cudaMemset(di, 0xa5, rows * 4));
  const ScaleUpdateParams prm{dh, dp, alias ? ds : dprev, ds, di, factor, rows, len, 0, most_recent};
  scale_update_launch(prm, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<float> got_hist(n), got_p(rows), got_s(rows), got_i(rows);
  CK(cudaMemcpy(got_hist.data(), dh, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_p.data(), dp, rows * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_s.data(), ds, rows * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_i.data(), di, rows * 4, cudaMemcpyDeviceToHost));
  int bad_hist = 0, bad_scale = 0, bad_pending = 0;
  for (size_t i = 0; i < n; ++i) bad_hist += bits_of(got_hist[i]) != bits_of(want_hist[i]);
  for (int r = 0; r < rows; ++r) {
    bad_pending += bits_of(got_p[r]) != 0u;
    const bool bad = bits_of(got_s[r]) != bits_of(want_scale[r]) || bits_of(got_i[r]) != bits_of(want_inv[r]);
    if (bad && bad_scale < 3)
      std::printf("     row %d: scale %a / inv %a, want %a / %a\n", r, got_s[r], got_i[r], want_scale[r],
                  want_inv[r]);
    bad_scale += bad;
  }
  const bool ok = bad_hist == 0 && bad_scale == 0 && bad_pending == 0;
  std::printf("%-4s scale_update rows=%d L=%d %s alias=%d subnormal=%d  bad hist=%d scale=%d pending=%d\n",
              ok ? "ok" : "FAIL", rows, len, most_recent ? "most_recent" : "max", alias, subnormal, bad_hist,
              bad_scale, bad_pending);
  if (!ok) ++failures;
  CK(cudaFree(dh));
  CK(cudaFree(dp));
  CK(cudaFree(ds));
  CK(cudaFree(di));
  CK(cudaFree(dprev));
}

int main(int argc, char** argv) {
  // --quick: small shapes only (for compute-sanitizer memcheck / racecheck runs).
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool update_only = argc > 1 && std::strcmp(argv[1], "--scale-update") == 0;
  int dev_id = 0;
  CK(cudaGetDevice(&dev_id));
  const DeviceLimits dev = device_limits(dev_id);
  std::printf("sms=%d smem/sm=%d smem/block=%d\n", dev.sms, dev.smem_per_sm, dev.smem_per_block);

  // delayed-scaling update: cheap, in --quick too
  const float factors[] = {static_cast<float>(1.0 / 448.0), static_cast<float>(8.0 / 57344.0)};
  for (int rows : {1, 300})
    for (int len : {1, 2, 16, 31, 128, 129, 1024, 1500})
      for (int algo = 0; algo < 2; ++algo)
        for (int alias = 0; alias < 2; ++alias)
          scale_update_case(rows, len, algo == 1, alias == 1, (len + alias) % 2 == 0, factors[algo ^ alias]);
  if (update_only) {
    std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
  }

  for (int layout = 0; layout < 3; ++layout) {
    quant_case<FP8Format::E4M3>(257, 1000, layout, dev.sms);
    quant_case<FP8Format::E5M2>(64, 4096, layout, dev.sms);
    quant_case<FP8Format::E4M3>(33, 7, layout, dev.sms);
  }

  const FP8Format E4 = FP8Format::E4M3, E5 = FP8Format::E5M2;
  struct Shape {
    int m, n, k;
  };
  const Shape shapes[] = {{1, 64, 64},    {16, 256, 512}, {128, 128, 128}, {200, 136, 1000},
                          {256, 512, 320}, {77, 33, 65},   {1088, 1088, 256}, {640, 384, 2048}};
  for (const Shape& s : shapes) {
    if (quick && static_cast<long long>(s.m) * s.n * s.k > 40000000LL) continue;
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) gemm_case(s.m, s.n, s.k, ta, tb, E4, E4, (s.m + ta) % 2 == 0, dev);
  }
  gemm_case(300, 200, 192, false, true, E5, E5, true, dev);
  gemm_case(300, 200, 192, true, false, E4, E5, false, dev);
  gemm_case(300, 200, 192, false, false, E5, E4, true, dev);
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
