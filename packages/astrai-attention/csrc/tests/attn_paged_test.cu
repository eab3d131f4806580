// Standalone correctness tables + timings for the paged decode and paged (ragged) prefill
// kernels against a float64 host reference, with shuffled page tables.
//
// Build and run (from packages/astrai-attention):
//   nvcc -std=c++17 -I csrc -I ../cuda-common/include -gencode=arch=compute_90a,code=sm_90a \
//        -O3 --use_fast_math --expt-relaxed-constexpr -Xptxas -v -Xcompiler -fopenmp \
//        csrc/tests/attn_paged_test.cu -o /tmp/attn_paged_test && /tmp/attn_paged_test [--no-bench]
// Exit status 0 only when every case passes.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>

#include "../dispatchers.cuh"
#include "test_utils.cuh"

using namespace astrai;
using namespace astrai::attn;

namespace {

bool g_ws_only = false;  // --ws-only: time the Hopper prefill alone
bool g_check = true;     // --bench-only: skip the correctness cases
int g_dim = 0;           // --dim D: time head dim D alone (0: all)
int g_page = 16;         // --page P: the prefill timings' page size
// --in-order: the timings' pages handed out in order (as a fresh cache does) instead of
// shuffled. The checks also run cases whose first half of pages is in order and second half
// shuffled, so tiles over consecutive pages (one TMA box per panel) and tiles over scattered
// ones both occur.
bool g_in_order = false;
bool g_half_order = false;

int g_sms = 132;
std::mt19937 g_rng(4321);

// A paged cache holding every request's K/V in shuffled pages, plus the host mirror.
struct PagedCache {
    int page_size, Hkv, D, num_pages;
    HostTensor k, v;  // [num_pages, page_size, Hkv, D]
    std::vector<int> kv_indptr, kv_indices, kv_lens;
    std::unique_ptr<DeviceBuffer<uint16_t>> dk, dv;
    std::unique_ptr<DeviceBuffer<int>> d_indptr, d_indices, d_lens;

    PagedCache(const std::vector<int>& lens, int page, int hkv, int d, bool bf16)
        : page_size(page), Hkv(hkv), D(d), kv_lens(lens) {
        kv_indptr = {0};
        for (int l : lens) kv_indptr.push_back(kv_indptr.back() + (l + page - 1) / page);
        num_pages = kv_indptr.back() + 3;  // a few unused pages
        std::vector<int> perm(num_pages);
        std::iota(perm.begin(), perm.end(), 0);
        if (g_half_order) {
            std::shuffle(perm.begin() + num_pages / 2, perm.end(), g_rng);
        } else if (!g_in_order) {
            std::shuffle(perm.begin(), perm.end(), g_rng);
        }
        kv_indices.assign(perm.begin(), perm.begin() + kv_indptr.back());
        const size_t n = size_t(num_pages) * page * hkv * d;
        k.random(n, g_rng, bf16);
        v.random(n, g_rng, bf16);
        // Slots past each request's length are NaN on the device (stale slots must never
        // reach an output: 0 x NaN would poison P V); the reference never reads them.
        std::vector<uint16_t> kd = k.bits, vd = v.bits;
        for (size_t b = 0; b < lens.size(); ++b)
            for (int pos = lens[b]; pos < (kv_indptr[b + 1] - kv_indptr[b]) * page; ++pos)
                for (int h = 0; h < hkv; ++h) {
                    const size_t o = offset(int(b), pos, h);
                    std::fill(kd.begin() + o, kd.begin() + o + d, uint16_t(0xffff));
                    std::fill(vd.begin() + o, vd.begin() + o + d, uint16_t(0xffff));
                }
        dk.reset(new DeviceBuffer<uint16_t>(n)); dk->upload(kd);
        dv.reset(new DeviceBuffer<uint16_t>(n)); dv->upload(vd);
        d_indptr.reset(new DeviceBuffer<int>(kv_indptr.size())); d_indptr->upload(kv_indptr);
        d_indices.reset(new DeviceBuffer<int>(kv_indices.size())); d_indices->upload(kv_indices);
        d_lens.reset(new DeviceBuffer<int>(lens.size())); d_lens->upload(lens);
    }
    size_t offset(int b, int pos, int h) const {
        const int page = kv_indices[kv_indptr[b] + pos / page_size];
        return ((size_t(page) * page_size + pos % page_size) * Hkv + h) * D;
    }
    void fill(AttentionParams& p) const {
        p.k = dk->ptr; p.v = dv->ptr;
        p.k_stride_b = p.v_stride_b = int64_t(page_size) * Hkv * D;
        p.k_stride_l = p.v_stride_l = int64_t(Hkv) * D;
        p.k_stride_h = p.v_stride_h = D;
        p.kv_indptr = d_indptr->ptr; p.kv_indices = d_indices->ptr; p.kv_lens = d_lens->ptr;
        p.page_size = page_size;
        p.page_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctz(page_size) : -1;
        p.num_pages = num_pages;
    }
};

float scale_log2(int D) { return float(1.0 / std::sqrt(double(D)) * 1.4426950408889634); }

bool decode_case(const std::vector<int>& lens, int page, int Hq, int Hkv, int D, bool bf16) {
    const int B = int(lens.size()), G = Hq / Hkv;
    PagedCache cache(lens, page, Hkv, D, bf16);
    HostTensor q;
    q.random(size_t(B) * Hq * D, g_rng, bf16);
    DeviceBuffer<uint16_t> dq(q.bits.size()), dout(q.bits.size());
    dq.upload(q.bits);
    dout.poison();
    AttentionParams p;
    p.q = dq.ptr; p.o = dout.ptr;
    p.q_stride_b = p.o_stride_b = int64_t(Hq) * D; p.q_stride_l = p.o_stride_l = int64_t(Hq) * D;
    p.q_stride_h = p.o_stride_h = D;
    cache.fill(p);
    p.batch = B; p.q_len = 1; p.q_heads = Hq; p.kv_heads = Hkv; p.group = G;
    p.head_groups = decode_head_groups(G);
    p.scale_log2 = scale_log2(D);
    const int64_t hint = cdiv(int64_t(cache.kv_indices.size()) * page, B);
    p.num_splits = decode_num_splits(B, Hkv, G, D, hint, g_sms);
    DeviceBuffer<float> wo(size_t(p.num_splits) * B * Hq * D), wl(size_t(p.num_splits) * B * Hq);
    p.ws_o = wo.ptr; p.ws_lse = wl.ptr;
    dispatch_decode<PagedKV>(p, bf16 ? DType::BFloat16 : DType::Float16, D, 0);
    CK(cudaDeviceSynchronize());
    const auto out = dout.download();
    std::vector<double> ref(size_t(B) * Hq * D);
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hq; ++h) {
            auto krow = [&](int j) { return &cache.k.vals[cache.offset(b, j, h / G)]; };
            auto vrow = [&](int j) { return &cache.v.vals[cache.offset(b, j, h / G)]; };
            reference_row(&q.vals[(size_t(b) * Hq + h) * D], D, lens[b], krow, vrow, [](int) { return true; },
                          &ref[(size_t(b) * Hq + h) * D]);
        }
    ErrorStats err;
    for (size_t i = 0; i < ref.size(); ++i) err.add(bits_to_float(out[i], bf16), ref[i]);
    const bool ok = err.ok(bf16 ? 2e-2 : 5e-3);
    std::printf("paged decode  %s B=%-3d page=%-2d H=%d/%d D=%-3d kv=[%d..%d] splits=%-2d rel=%.2e max=%.2e  %s\n",
                bf16 ? "bf16" : "fp16", B, page, Hq, Hkv, D, *std::min_element(lens.begin(), lens.end()),
                *std::max_element(lens.begin(), lens.end()), p.num_splits, err.rel(), err.max_abs, ok ? "ok" : "FAIL");
    return ok;
}

template <typename T>
void launch_prefill_layout_t(const AttentionParams& p, int D, unsigned tiles, int warps) {
    switch (D) {
        case 64: return launch_prefill_d<T, 64, PackedQSchedule, PagedKV>(p, tiles, 1, 0, warps);
        case 128: return launch_prefill_d<T, 128, PackedQSchedule, PagedKV>(p, tiles, 1, 0, warps);
        default: return launch_prefill_d<T, 256, PackedQSchedule, PagedKV>(p, tiles, 1, 0, warps);
    }
}

// warps = 0: the launch heuristic's layout; else 4 or 8 mma.sync warps or the Hopper kernel
// (kPrefillWgmma) when the head packing, D and the device allow it (else the heuristic's).
void launch_prefill_layout(const AttentionParams& p, bool bf16, int D, unsigned tiles, int warps) {
    if (bf16) return launch_prefill_layout_t<__nv_bfloat16>(p, D, tiles, warps);
    launch_prefill_layout_t<__half>(p, D, tiles, warps);
}

bool prefill_case(const std::vector<int>& q_lens, const std::vector<int>& prefix, int page, int Hq, int Hkv,
                  int D, bool bf16, bool causal) {
    const int B = int(q_lens.size()), G = Hq / Hkv;
    std::vector<int> kv_lens(B), qo_indptr = {0}, tile_b, tile_i;
    for (int b = 0; b < B; ++b) {
        kv_lens[b] = q_lens[b] + prefix[b];
        qo_indptr.push_back(qo_indptr.back() + q_lens[b]);
        for (int t = 0; t < cdiv(q_lens[b], kQTileRows); ++t) { tile_b.push_back(b); tile_i.push_back(t); }
    }
    const int total_q = qo_indptr.back();
    PagedCache cache(kv_lens, page, Hkv, D, bf16);
    HostTensor q;
    q.random(size_t(total_q) * Hq * D, g_rng, bf16);
    DeviceBuffer<uint16_t> dq(q.bits.size()), dout(q.bits.size());
    DeviceBuffer<int> d_qo(qo_indptr.size()), d_tb(tile_b.size()), d_ti(tile_i.size());
    dq.upload(q.bits); d_qo.upload(qo_indptr); d_tb.upload(tile_b); d_ti.upload(tile_i);
    AttentionParams p;
    p.q = dq.ptr; p.o = dout.ptr;
    p.q_stride_l = p.o_stride_l = int64_t(Hq) * D; p.q_stride_h = p.o_stride_h = D;
    cache.fill(p);
    p.batch = B; p.q_heads = Hq; p.kv_heads = Hkv; p.group = G; p.causal = causal;
    p.head_block = prefill_head_block(G); p.head_groups = prefill_head_groups(G);
    p.scale_log2 = scale_log2(D);
    p.qo_indptr = d_qo.ptr; p.q_tile_to_batch = d_tb.ptr; p.q_tile_to_index = d_ti.ptr;
    p.num_q_tiles = int(tile_b.size());
    p.q_total_rows = total_q;
    std::vector<double> ref(size_t(total_q) * Hq * D);
    for (int b = 0; b < B; ++b) {
#pragma omp parallel for collapse(2)
        for (int i = 0; i < q_lens[b]; ++i)
            for (int h = 0; h < Hq; ++h) {
                const int row = qo_indptr[b] + i;
                auto krow = [&](int j) { return &cache.k.vals[cache.offset(b, j, h / G)]; };
                auto vrow = [&](int j) { return &cache.v.vals[cache.offset(b, j, h / G)]; };
                const int limit = i + kv_lens[b] - q_lens[b];
                reference_row(&q.vals[(size_t(row) * Hq + h) * D], D, kv_lens[b], krow, vrow,
                              [&](int j) { return !causal || j <= limit; }, &ref[(size_t(row) * Hq + h) * D]);
            }
    }
    std::string ql;
    for (int x : q_lens) ql += std::to_string(x) + ",";
    bool all_ok = true;
    // Every block layout the packing allows: the heuristic's, then each forced one.
    for (int warps : {0, 4, 8, kPrefillWgmma}) {
        dout.poison();
        launch_prefill_layout(p, bf16, D, unsigned(tile_b.size()), warps);
        CK(cudaDeviceSynchronize());
        const auto out = dout.download();
        ErrorStats err;
        for (size_t i = 0; i < ref.size(); ++i) err.add(bits_to_float(out[i], bf16), ref[i]);
        const bool ok = err.ok(bf16 ? 2e-2 : 5e-3);
        all_ok = all_ok && ok;
        std::printf("paged prefill %s q=[%s] page=%-2d H=%d/%d D=%-3d %s layout=%d rel=%.2e max=%.2e  %s\n",
                    bf16 ? "bf16" : "fp16", ql.c_str(), page, Hq, Hkv, D, causal ? "causal" : "full", warps,
                    err.rel(), err.max_abs, ok ? "ok" : "FAIL");
    }
    return all_ok;
}

void bench() {
    std::printf("\n-- paged timings (median, us; prefill layout: 4 / 8 mma.sync warps, 90 warp-specialized wgmma) --\n");
    const int Hq = 32, Hkv = 8, D = 128;
    for (int page : {1, 16})
        for (int B : {1, 16, 64}) {
            const int S = 4096;
            std::vector<int> lens(B, S);
            PagedCache cache(lens, page, Hkv, D, true);
            DeviceBuffer<uint16_t> dq(size_t(B) * Hq * D), dout(size_t(B) * Hq * D);
            HostTensor q; q.random(size_t(B) * Hq * D, g_rng, true); dq.upload(q.bits);
            AttentionParams p;
            p.q = dq.ptr; p.o = dout.ptr;
            p.q_stride_b = p.o_stride_b = p.q_stride_l = p.o_stride_l = int64_t(Hq) * D;
            p.q_stride_h = p.o_stride_h = D;
            cache.fill(p);
            p.batch = B; p.q_len = 1; p.q_heads = Hq; p.kv_heads = Hkv; p.group = Hq / Hkv;
            p.head_groups = decode_head_groups(p.group); p.scale_log2 = scale_log2(D);
            p.num_splits = decode_num_splits(B, Hkv, p.group, D, S, g_sms);
            DeviceBuffer<float> wo(size_t(p.num_splits) * B * Hq * D), wl(size_t(p.num_splits) * B * Hq);
            p.ws_o = wo.ptr; p.ws_lse = wl.ptr;
            const double us = time_us([&] { dispatch_decode<PagedKV>(p, DType::BFloat16, D, 0); });
            const double bytes = 2.0 * 2.0 * B * S * Hkv * D;
            std::printf("paged decode bf16 32/8 d128 page=%-2d B=%-3d kv=%d splits=%-2d %8.2f us %6.2f TB/s\n", page, B,
                        S, p.num_splits, us, bytes / us * 1e-6);
        }
}


template <int D>
void bench_prefill_d() {
    if (g_dim != 0 && g_dim != D) return;
    const int Hq = 32, Hkv = 8;
    for (auto [B_, L_] : {std::pair{4, 4096}, std::pair{1, 16384}, std::pair{16, 1024}}) {
        const int B = B_, L = L_;
        std::vector<int> lens(B, L), qo = {0}, tb, ti;
        for (int b = 0; b < B; ++b) {
            qo.push_back(qo.back() + L);
            for (int t = 0; t < L / kQTileRows; ++t) { tb.push_back(b); ti.push_back(t); }
        }
        std::reverse(tb.begin(), tb.end());  // the order BatchPlan.q_tiles starts them in
        std::reverse(ti.begin(), ti.end());
        PagedCache cache(lens, g_page, Hkv, D, true);
        DeviceBuffer<uint16_t> dq(size_t(B) * L * Hq * D), dout(size_t(B) * L * Hq * D);
        HostTensor q; q.random(dq.n, g_rng, true); dq.upload(q.bits);
        DeviceBuffer<int> d_qo(qo.size()), d_tb(tb.size()), d_ti(ti.size());
        d_qo.upload(qo); d_tb.upload(tb); d_ti.upload(ti);
        AttentionParams p;
        p.q = dq.ptr; p.o = dout.ptr;
        p.q_stride_l = p.o_stride_l = int64_t(Hq) * D; p.q_stride_h = p.o_stride_h = D;
        cache.fill(p);
        p.batch = B; p.q_heads = Hq; p.kv_heads = Hkv; p.group = Hq / Hkv; p.causal = true;
        p.head_block = prefill_head_block(p.group); p.head_groups = prefill_head_groups(p.group);
        p.scale_log2 = scale_log2(D);
        p.qo_indptr = d_qo.ptr; p.q_tile_to_batch = d_tb.ptr; p.q_tile_to_index = d_ti.ptr;
        p.num_q_tiles = int(tb.size());
        p.q_total_rows = B * L;
        for (bool causal : {true, false}) {
            p.causal = causal;
            for (int warps : {prefill_warps(p.group, D), kPrefillWgmma}) {
                if (g_ws_only && warps != kPrefillWgmma) continue;
                const double us = time_us([&] {
                    launch_prefill_d<__nv_bfloat16, D, PackedQSchedule, PagedKV>(p, unsigned(tb.size()), 1, 0, warps);
                }, 10);
                const double flops = 4.0 * B * Hq * double(L) * (causal ? (L + 1) / 2.0 : L) * D;
                std::printf("paged prefill bf16 32/8 d%-3d page=%-3d%s %2dx%-5d %-9s layout=%-2d %9.1f us %6.1f TFLOP/s\n",
                            D, g_page, g_in_order ? " in order" : "", B, L, causal ? "causal" : "noncausal", warps, us,
                            flops / us * 1e-6);
            }
        }
    }
}

void bench_prefill() {
    bench_prefill_d<64>();
    bench_prefill_d<128>();
    bench_prefill_d<256>();
}

}  // namespace

int main(int argc, char** argv) {
    bool do_bench = true;
    for (int i = 1; i < argc; ++i) {
        if (std::string(argv[i]) == "--no-bench") do_bench = false;
        if (std::string(argv[i]) == "--ws-only") g_ws_only = true;
        if (std::string(argv[i]) == "--bench-only") g_check = false;
        if (std::string(argv[i]) == "--dim" && i + 1 < argc) g_dim = std::atoi(argv[++i]);
        if (std::string(argv[i]) == "--page" && i + 1 < argc) g_page = std::atoi(argv[++i]);
        if (std::string(argv[i]) == "--in-order") g_in_order = true;
    }
    CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
    if (!g_check) {
        bench_prefill();
        return 0;
    }
    int fails = 0, total = 0;
    auto check = [&](bool ok) { ++total; fails += !ok; };
    for (int page : {1, 16}) {
        check(decode_case({1, 17, 64, 65, 1000, 4097}, page, 32, 8, 128, true));
        check(decode_case({300, 5, 2000}, page, 16, 16, 64, false));
        check(decode_case({129, 31}, page, 32, 4, 256, true));
        check(decode_case(std::vector<int>(64, 200), page, 32, 8, 128, true));
        check(prefill_case({70, 10, 130}, {0, 0, 0}, page, 32, 8, 128, true, true));
        check(prefill_case({70, 10, 130}, {5, 100, 63}, page, 32, 8, 64, false, true));
        check(prefill_case({1, 1, 1000}, {0, 7, 24}, page, 32, 8, 128, true, true));
        check(prefill_case({65, 200}, {0, 300}, page, 16, 16, 256, true, false));
        check(prefill_case({33, 129}, {10, 0}, page, 24, 8, 128, true, true));  // G = 3
    }
    // the warp-specialized Hopper kernel's head dims, group sizes and a large page
    for (int page : {1, 16, 64}) {
        check(prefill_case({70, 10, 130}, {0, 33, 64}, page, 32, 8, 256, true, true));
        check(prefill_case({1, 1, 1000}, {0, 7, 24}, page, 32, 8, 64, true, false));
        check(prefill_case({257, 64}, {700, 0}, page, 64, 2, 128, false, true));  // G = 32
        check(prefill_case({129, 5}, {64, 1}, page, 16, 8, 256, false, false));   // G = 2
        check(prefill_case({70, 10, 130}, {0, 33, 64}, page, 8, 8, 128, true, true));  // G = 1: odd tile counts
    }
    // tables half in page order: whole-tile runs and scattered tiles
    g_half_order = true;
    for (int page : {8, 16, 64}) {
        check(prefill_case({70, 10, 1300}, {0, 33, 64}, page, 32, 8, 128, true, true));
        check(prefill_case({1000, 513}, {24, 0}, page, 32, 8, 64, false, true));
        check(prefill_case({700, 129}, {0, 300}, page, 16, 8, 256, true, false));
    }
    g_half_order = false;
    // a page size that is not a power of two (the kernels divide instead of shifting)
    check(decode_case({1, 50, 301}, 3, 32, 8, 128, true));
    check(prefill_case({70, 10, 130}, {5, 0, 9}, 3, 32, 8, 128, true, true));
    std::printf("\n%d/%d cases passed\n", total - fails, total);
    if (do_bench) {
        if (!g_ws_only) bench();
        bench_prefill();
    }
    return fails ? 1 : 0;
}
