// Standalone correctness tables + timings for the contiguous decode and prefill kernels
// (mma.sync and scalar) against a float64 host reference.
//
// Build and run (from packages/astrai-attention):
//   nvcc -std=c++17 -I csrc -I ../cuda-common/include -gencode=arch=compute_90a,code=sm_90a \
//        -O3 --use_fast_math --expt-relaxed-constexpr -Xptxas -v -Xcompiler -fopenmp \
//        csrc/tests/attn_test.cu -o /tmp/attn_test && /tmp/attn_test [--no-bench]
// Exit status 0 only when every case passes.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../dispatchers.cuh"
#include "test_utils.cuh"

using namespace astrai;
using namespace astrai::attn;

namespace {

struct Strides { int64_t b, l, h; };
// [B, L, H, D] tensor stored as BLHD or BHLD.
Strides strides_for(int L, int H, int D, bool bhld) {
    if (bhld) return {int64_t(H) * L * D, D, int64_t(L) * D};
    return {int64_t(L) * H * D, int64_t(H) * D, D};
}

enum class Impl { Mma, Scalar, Wgmma };  // Wgmma: the warp-specialized sm_90a prefill (G >= 2)

void launch_decode(const AttentionParams& p, bool bf16, int D, Impl impl) {
    if (impl == Impl::Mma) {
        dispatch_decode<ContigKV>(p, bf16 ? DType::BFloat16 : DType::Float16, D, 0);
        return;
    }
    const dim3 grid(p.batch * p.kv_heads * p.head_groups, p.num_splits);
    auto go = [&](auto tag, auto dtag) {
        using T = decltype(tag);
        constexpr int DD = decltype(dtag)::value;
        decode_scalar_kernel<T, DD, ContigKV><<<grid, 128>>>(p);
        if (p.num_splits > 1) decode_combine_kernel<T, DD><<<p.batch * p.q_heads, decode_combine_threads(DD)>>>(p);
    };
    auto by_d = [&](auto tag) {
        if (D == 64) go(tag, std::integral_constant<int, 64>{});
        if (D == 128) go(tag, std::integral_constant<int, 128>{});
        if (D == 256) go(tag, std::integral_constant<int, 256>{});
    };
    if (bf16) by_d(__nv_bfloat16{}); else by_d(__half{});
    CK(cudaGetLastError());
}

void launch_prefill(const AttentionParams& p, bool bf16, int D, Impl impl) {
    const unsigned tiles = unsigned(num_q_tiles(p.q_len));
    if (impl != Impl::Scalar) {
        // Mma: the mma.sync layout the heuristic picks off Hopper; Wgmma: the Hopper kernel.
        const int layout = impl == Impl::Wgmma ? kPrefillWgmma : prefill_warps(p.group, D);
        auto go = [&](auto tag, auto dtag) {
            launch_prefill_d<decltype(tag), decltype(dtag)::value, DenseQSchedule, ContigKV>(p, tiles, p.batch, 0,
                                                                                               layout);
        };
        auto by_d = [&](auto tag) {
            if (D == 64) go(tag, std::integral_constant<int, 64>{});
            if (D == 128) go(tag, std::integral_constant<int, 128>{});
            if (D == 256) go(tag, std::integral_constant<int, 256>{});
        };
        if (bf16) by_d(__nv_bfloat16{}); else by_d(__half{});
        CK(cudaGetLastError());
        return;
    }
    const dim3 grid(tiles * p.head_block, p.kv_heads * p.head_groups, p.batch);
    auto go = [&](auto tag, auto dtag) {
        using T = decltype(tag);
        constexpr int DD = decltype(dtag)::value;
        AttentionParams ps = p;
        ps.blocks_per_tile = ps.head_block;
        prefill_scalar_kernel<T, DD, DenseQSchedule, ContigKV><<<grid, 128>>>(ps);
    };
    auto by_d = [&](auto tag) {
        if (D == 64) go(tag, std::integral_constant<int, 64>{});
        if (D == 128) go(tag, std::integral_constant<int, 128>{});
        if (D == 256) go(tag, std::integral_constant<int, 256>{});
    };
    if (bf16) by_d(__nv_bfloat16{}); else by_d(__half{});
    CK(cudaGetLastError());
}

struct Case {
    int B, Lq, Lkv, Hq, Hkv, D;
    bool bf16, causal, bhld;
    int mask_dims;  // 0, 2 or 3
};

int g_sms = 132;
bool g_ws_only = false;  // --ws-only: time the Hopper prefill alone
bool g_check = true;     // --bench-only: skip the correctness cases
int g_dim = 0;           // --dim D: time head dim D alone (0: all)
int g_prefill_kv_heads = 8;  // --mha: prefill timings with 32 kv heads (multi-head attention), else 8
double g_softcap = 0;        // --softcap C: prefill timings with a logit soft-cap of C (the variant kernel)
std::mt19937 g_rng(1234);

// One prefill (Lq > 1 or causal) or decode (Lq == 1) case; returns pass/fail.
bool run_case(const Case& c, Impl impl, bool decode) {
    const int B = c.B, Lq = c.Lq, Lkv = c.Lkv, Hq = c.Hq, Hkv = c.Hkv, D = c.D, G = Hq / Hkv;
    HostTensor q, k, v;
    q.random(size_t(B) * Lq * Hq * D, g_rng, c.bf16);
    k.random(size_t(B) * Lkv * Hkv * D, g_rng, c.bf16);
    v.random(size_t(B) * Lkv * Hkv * D, g_rng, c.bf16);
    const Strides qs = strides_for(Lq, Hq, D, c.bhld), ks = strides_for(Lkv, Hkv, D, c.bhld);
    const Strides os = strides_for(Lq, Hq, D, false);
    std::vector<uint8_t> mask;
    if (c.mask_dims) {
        const size_t rows = c.mask_dims == 3 ? size_t(Lq) : 1;
        mask.resize(size_t(B) * rows * Lkv);
        std::bernoulli_distribution keep(0.7);
        for (auto& m : mask) m = keep(g_rng);
        for (size_t r = 0; r < size_t(B) * rows; ++r) mask[r * Lkv + (r * 7) % Lkv] = 1;  // one kept per row
    }
    DeviceBuffer<uint16_t> dq(q.bits.size()), dk(k.bits.size()), dv(v.bits.size()), dout(size_t(B) * Lq * Hq * D);
    DeviceBuffer<uint8_t> dmask(mask.size());
    dq.upload(q.bits); dk.upload(k.bits); dv.upload(v.bits);
    if (!mask.empty()) dmask.upload(mask);
    dout.poison();

    AttentionParams p;
    p.q = dq.ptr; p.k = dk.ptr; p.v = dv.ptr; p.o = dout.ptr;
    p.q_stride_b = qs.b; p.q_stride_l = qs.l; p.q_stride_h = qs.h;
    p.k_stride_b = p.v_stride_b = ks.b; p.k_stride_l = p.v_stride_l = ks.l; p.k_stride_h = p.v_stride_h = ks.h;
    p.o_stride_b = os.b; p.o_stride_l = os.l; p.o_stride_h = os.h;
    if (c.mask_dims) {
        p.mask = dmask.ptr;
        p.mask_stride_b = (c.mask_dims == 3 ? int64_t(Lq) : 1) * Lkv;
        p.mask_stride_q = c.mask_dims == 3 ? Lkv : 0;
        p.mask_stride_k = 1;
    }
    p.batch = B; p.q_len = Lq; p.kv_len = Lkv; p.q_heads = Hq; p.kv_heads = Hkv; p.group = G;
    p.causal = c.causal;
    p.scale_log2 = float(1.0 / std::sqrt(double(D)) * 1.4426950408889634);
    std::unique_ptr<DeviceBuffer<float>> ws_o, ws_lse;
    if (decode) {
        p.head_groups = decode_head_groups(G);
        p.num_splits = decode_num_splits(B, Hkv, G, D, Lkv, g_sms);
        if (p.num_splits > 1) {
            ws_o.reset(new DeviceBuffer<float>(size_t(p.num_splits) * B * Hq * D));
            ws_lse.reset(new DeviceBuffer<float>(size_t(p.num_splits) * B * Hq));
            p.ws_o = ws_o->ptr; p.ws_lse = ws_lse->ptr;
        }
        launch_decode(p, c.bf16, D, impl);
    } else {
        p.head_block = prefill_head_block(G);
        p.head_groups = prefill_head_groups(G);
        launch_prefill(p, c.bf16, D, impl);
    }
    CK(cudaDeviceSynchronize());
    const auto out = dout.download();

    ErrorStats err;
    const int diag = Lkv - Lq;
    std::vector<double> ref(size_t(B) * Lq * Hq * D);
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hq; ++h)
            for (int i = 0; i < Lq; ++i) {
                const int kh = h / G;
                const float* qrow = &q.vals[b * qs.b + i * qs.l + h * qs.h];
                auto krow = [&](int j) { return &k.vals[b * ks.b + j * ks.l + kh * ks.h]; };
                auto vrow = [&](int j) { return &v.vals[b * ks.b + j * ks.l + kh * ks.h]; };
                auto keep = [&](int j) {
                    if (c.causal && j > i + diag) return false;
                    if (!c.mask_dims) return true;
                    const size_t row = c.mask_dims == 3 ? size_t(b) * Lq + i : size_t(b);
                    return mask[row * Lkv + j] != 0;
                };
                reference_row(qrow, D, Lkv, krow, vrow, keep, &ref[b * os.b + i * os.l + h * os.h]);
            }
    for (size_t i = 0; i < ref.size(); ++i) err.add(bits_to_float(out[i], c.bf16), ref[i]);
    const double tol = c.bf16 ? 2e-2 : 5e-3;
    const bool ok = err.ok(tol);
    std::printf("%-7s %-6s %s B=%-3d Lq=%-5d Lkv=%-5d H=%d/%d D=%-3d %s%s mask=%dD splits=%-2d  rel=%.2e max=%.2e  %s\n",
                decode ? "decode" : "prefill", impl == Impl::Mma ? "mma" : impl == Impl::Scalar ? "scalar" : "wgmma", c.bf16 ? "bf16" : "fp16", B, Lq,
                Lkv, Hq, Hkv, D, c.causal ? "causal " : "", c.bhld ? "BHLD" : "BLHD", c.mask_dims,
                decode ? p.num_splits : 0, err.rel(), err.max_abs, ok ? "ok" : "FAIL");
    return ok;
}

#ifdef ASTRAI_PREFILL_TRACE
// Runs `launch` once with the kernel's per-item clocks recorded and prints where a work
// item's time goes, in thousands of cycles and in steady-state tiles.
void trace_report(const char* label, size_t max_items, const std::function<void()>& launch) {
    DeviceBuffer<unsigned long long> buf(max_items * 8);
    CK(cudaMemset(buf.ptr, 0, max_items * 8 * sizeof(unsigned long long)));
    unsigned long long* ptr = buf.ptr;
    CK(cudaMemcpyToSymbol(g_prefill_trace, &ptr, sizeof(ptr)));
    launch();
    CK(cudaDeviceSynchronize());
    std::vector<unsigned long long> h(max_items * 8);
    CK(cudaMemcpy(h.data(), buf.ptr, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
    unsigned long long* none = nullptr;
    CK(cudaMemcpyToSymbol(g_prefill_trace, &none, sizeof(none)));
    struct Rec { int sm, n; double start, q, k0, first, lastpv, end, entry; };
    std::vector<Rec> recs;
    for (size_t i = 0; i < max_items; ++i) {
        const unsigned long long* v = &h[i * 8];
        if (v[6] == 0) continue;
        recs.push_back({int(v[0] & 0xffffffffu), int(v[0] >> 32), double(v[1]), double(v[2]), double(v[3]),
                        double(v[4]), double(v[5]), double(v[6]), double(v[7])});
    }
    double loop = 0, loop_tiles = 0, q = 0, k0 = 0, first = 0, epi = 0, pre = 0, tiles = 0;
    int pre_n = 0;
    for (const Rec& r : recs) {
        if (r.n > 1) { loop += r.lastpv - r.first; loop_tiles += r.n - 1; }
        q += r.q - r.start; k0 += r.k0 - r.q; first += r.first - r.k0; epi += r.end - r.lastpv; tiles += r.n;
        if (r.entry != 0) { pre += r.start - r.entry; ++pre_n; }
    }
    std::sort(recs.begin(), recs.end(), [](const Rec& a, const Rec& b) { return a.sm != b.sm ? a.sm < b.sm : a.start < b.start; });
    double gap = 0, busy = 0, span = 0;
    int gaps = 0;
    for (size_t i = 0; i < recs.size(); ++i) {
        busy += recs[i].end - recs[i].start;
        const bool last = i + 1 == recs.size() || recs[i + 1].sm != recs[i].sm;
        if (!last) { gap += recs[i + 1].start - recs[i].end; ++gaps; }
        size_t j = i;
        while (j > 0 && recs[j - 1].sm == recs[i].sm) --j;
        if (last) span += recs[i].end - (recs[j].entry != 0 ? recs[j].entry : recs[j].start);
    }
    const double n = double(recs.size()), tile = loop_tiles > 0 ? loop / loop_tiles : 1;
    auto show = [&](const char* what, double total, double count) {
        std::printf("  %s %.1fk (%.2f tiles)", what, total / count / 1e3, total / count / tile);
    };
    std::printf("trace %s: %zu items, %.1f tiles each, tile %.1fk cycles; per item:", label, recs.size(), tiles / n, tile / 1e3);
    show("block start", pre, std::max(pre_n, 1));
    show("Q wait", q, n); show("K0 wait", k0, n); show("tile 0", first, n); show("last PV -> stored", epi, n);
    show("gap to next item", gap, std::max(gaps, 1));
    std::printf("; busy %.1f %% of the SMs' spans\n", 100.0 * busy / span);
}
#endif

void bench() {
    std::printf("\n-- timings (median of 50, us; prefill layout: 4 / 8 mma.sync warps, 90 warp-specialized wgmma) --\n");
    const int Hq = 32, Hkv = 8, D = 128;
    for (int B : {1, 4, 16, 32, 64}) {
        if (g_ws_only) break;
        const int S = 4096;
        const size_t kv_elems = size_t(B) * S * Hkv * D;
        DeviceBuffer<uint16_t> q(size_t(B) * Hq * D), k(kv_elems), v(kv_elems), o(size_t(B) * Hq * D);
        HostTensor hk;
        hk.random(kv_elems, g_rng, true);
        k.upload(hk.bits); v.upload(hk.bits);
        HostTensor hq; hq.random(size_t(B) * Hq * D, g_rng, true); q.upload(hq.bits);
        AttentionParams p;
        p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.o = o.ptr;
        p.q_stride_b = Hq * D; p.q_stride_l = Hq * D; p.q_stride_h = D;
        p.k_stride_b = p.v_stride_b = int64_t(S) * Hkv * D; p.k_stride_l = p.v_stride_l = Hkv * D; p.k_stride_h = p.v_stride_h = D;
        p.o_stride_b = Hq * D; p.o_stride_l = Hq * D; p.o_stride_h = D;
        p.batch = B; p.q_len = 1; p.kv_len = S; p.q_heads = Hq; p.kv_heads = Hkv; p.group = Hq / Hkv;
        p.head_groups = decode_head_groups(p.group);
        p.scale_log2 = float(1.0 / std::sqrt(double(D)) * 1.4426950408889634);
        p.num_splits = decode_num_splits(B, Hkv, p.group, D, S, g_sms);
        DeviceBuffer<float> wo(size_t(p.num_splits) * B * Hq * D), wl(size_t(p.num_splits) * B * Hq);
        p.ws_o = wo.ptr; p.ws_lse = wl.ptr;
        const double us = time_us([&] { dispatch_decode<ContigKV>(p, DType::BFloat16, D, 0); });
        const double bytes = 2.0 * kv_elems * 2;
        std::printf("decode  bf16 GQA 32/8 d128 B=%-3d kv=%d splits=%-2d  %8.2f us  %6.2f TB/s\n", B, S,
                    p.num_splits, us, bytes / us * 1e-6);
    }
    const int Hkv_p = g_prefill_kv_heads;  // the prefill timings' kv heads
    for (int D : {64, 128, 256})
        if (g_dim == 0 || g_dim == D) for (auto [B_, L_] : {std::pair{4, 4096}, std::pair{1, 16384}, std::pair{16, 1024}}) {
            const int B = B_, L = L_;
            const size_t qe = size_t(B) * L * Hq * D, ke = size_t(B) * L * Hkv_p * D;
            DeviceBuffer<uint16_t> q(qe), k(ke), v(ke), o(qe);
            HostTensor h; h.random(qe, g_rng, true); q.upload(h.bits);
            h.random(ke, g_rng, true); k.upload(h.bits); v.upload(h.bits);
            AttentionParams p;
            p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.o = o.ptr;
            p.q_stride_b = int64_t(L) * Hq * D; p.q_stride_l = Hq * D; p.q_stride_h = D;
            p.k_stride_b = p.v_stride_b = int64_t(L) * Hkv_p * D; p.k_stride_l = p.v_stride_l = Hkv_p * D; p.k_stride_h = p.v_stride_h = D;
            p.o_stride_b = p.q_stride_b; p.o_stride_l = Hq * D; p.o_stride_h = D;
            p.batch = B; p.q_len = L; p.kv_len = L; p.q_heads = Hq; p.kv_heads = Hkv_p; p.group = Hq / Hkv_p;
            p.head_block = prefill_head_block(p.group); p.head_groups = prefill_head_groups(p.group);
            p.scale_log2 = float(1.0 / std::sqrt(double(D)) * 1.4426950408889634);
            if (g_softcap > 0) set_variant_params(p, D, 0.0, g_softcap, -1, nullptr);
            for (bool causal : {true, false}) {
                p.causal = causal;
                for (int layout : {prefill_warps(p.group, D), kPrefillWgmma}) {
                    if (g_ws_only && layout != kPrefillWgmma) continue;
                    auto run = [&](auto dtag) {
                        launch_prefill_d<__nv_bfloat16, decltype(dtag)::value, DenseQSchedule, ContigKV>(
                            p, unsigned(num_q_tiles(L)), B, 0, layout);
                    };
                    const double us = time_us([&] {
                        if (D == 64) run(std::integral_constant<int, 64>{});
                        if (D == 128) run(std::integral_constant<int, 128>{});
                        if (D == 256) run(std::integral_constant<int, 256>{});
                    }, 20);
                    const double flops = 4.0 * B * Hq * double(L) * L * D * (causal ? 0.5 : 1.0);
                    std::printf("prefill bf16 GQA %d/%d d%-3d %2dx%-5d %-9s%s layout=%-2d %9.1f us  %6.1f TFLOP/s\n", Hq,
                                Hkv_p, D, B, L, causal ? "causal" : "noncausal", g_softcap > 0 ? " softcap" : "", layout,
                                us, flops / us * 1e-6);
#ifdef ASTRAI_PREFILL_TRACE
                    if (layout == kPrefillWgmma) {
                        char label[64];
                        std::snprintf(label, sizeof label, "d%d %dx%d %s", D, B, L, causal ? "causal" : "noncausal");
                        trace_report(label, size_t(num_q_tiles(L)) * 8 * Hkv_p * p.head_groups * B, [&] {
                            if (D == 64) run(std::integral_constant<int, 64>{});
                            if (D == 128) run(std::integral_constant<int, 128>{});
                            if (D == 256) run(std::integral_constant<int, 256>{});
                        });
                    }
#endif
                }
            }
        }
}

}  // namespace

int main(int argc, char** argv) {
    bool do_bench = true;
    for (int i = 1; i < argc; ++i) {
        if (std::string(argv[i]) == "--no-bench") do_bench = false;
        if (std::string(argv[i]) == "--ws-only") g_ws_only = true;
        if (std::string(argv[i]) == "--bench-only") g_check = false;
        if (std::string(argv[i]) == "--mha") g_prefill_kv_heads = 32;
        if (std::string(argv[i]) == "--softcap" && i + 1 < argc) g_softcap = std::atof(argv[++i]);
        if (std::string(argv[i]) == "--dim" && i + 1 < argc) g_dim = std::atoi(argv[++i]);
    }
    CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
    if (!g_check) {
        bench();
        return 0;
    }
    int fails = 0, total = 0;
    std::vector<Case> decode_cases = {
        {1, 1, 1, 8, 8, 128, true, false, false, 0},
        {1, 1, 4096, 32, 8, 128, true, false, false, 0},
        {3, 1, 1000, 32, 8, 64, true, false, true, 2},
        {2, 1, 777, 16, 16, 128, false, false, false, 3},
        {4, 1, 300, 32, 4, 256, true, false, false, 0},
        {2, 1, 33, 64, 2, 128, false, false, true, 0},  // G = 32: two head groups
        {64, 1, 129, 32, 8, 128, true, false, false, 2},
        {2, 1, 5000, 24, 8, 64, true, false, false, 0},   // G = 3
    };
    std::vector<Case> prefill_cases = {
        {1, 70, 70, 8, 8, 128, true, true, false, 0},
        {2, 130, 130, 32, 8, 128, true, true, false, 0},
        {2, 100, 300, 32, 8, 64, true, true, true, 0},   // bottom-right causal, q < kv
        {1, 200, 90, 8, 2, 128, false, true, false, 0},  // q > kv: first rows see nothing
        {2, 65, 129, 16, 16, 256, true, false, false, 2},
        {2, 77, 191, 32, 4, 128, false, false, true, 3},
        {1, 257, 257, 24, 8, 64, true, true, false, 0},  // G = 3
        {1, 64, 1000, 32, 8, 128, true, true, false, 3},
        {3, 1, 513, 32, 8, 128, true, true, false, 0},
    };
    for (Impl impl : {Impl::Mma, Impl::Scalar}) {
        for (const auto& c : decode_cases) { ++total; fails += !run_case(c, impl, true); }
        for (const auto& c : prefill_cases) { ++total; fails += !run_case(c, impl, false); }
    }
    // The Hopper kernel (G >= 2, and G = 1 with ASTRAI_PREFILL_WS_MHA): every case above plus
    // fp16 / d256 / large-group / multi-head ones.
    std::vector<Case> ws_cases = prefill_cases;
    ws_cases.insert(ws_cases.end(), {
        {2, 333, 333, 16, 16, 128, true, true, false, 0},  // G = 1: 128 rows of one head per block
        {1, 200, 90, 8, 8, 64, false, true, true, 0},     // G = 1, q > kv
        {3, 129, 300, 4, 4, 256, true, false, false, 2},   // G = 1, a 64-row tail in the last block
        {2, 333, 333, 32, 8, 256, true, true, false, 0},
        {2, 333, 333, 32, 8, 64, false, true, true, 0},
        {1, 129, 700, 64, 2, 256, false, true, false, 0},  // G = 32, chunked (q < kv)
        {2, 200, 200, 16, 8, 64, true, false, false, 3},
        {1, 1000, 1000, 32, 8, 128, false, true, false, 0},
        {2, 150, 150, 32, 16, 256, true, false, true, 2},
    });
    for (const auto& c : ws_cases)
        if (c.Hq / c.Hkv >= (ASTRAI_PREFILL_WS_MHA ? 1 : 2)) { ++total; fails += !run_case(c, Impl::Wgmma, false); }
    std::printf("\n%d/%d cases passed\n", total - fails, total);
    if (do_bench) bench();
    return fails ? 1 : 0;
}
