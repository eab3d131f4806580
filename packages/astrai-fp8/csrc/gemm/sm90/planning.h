// Host planning for the Hopper FP8 GEMM: pure functions (no CUDA calls). The one copy of
// these rules: Python reaches it through planning_bind.h (``_fp8_ops.sm90``, and a
// host-only module the CPU tests build from this header with the host compiler).
//
//   can_implement(shape, device) -> "" or the reason this path cannot take the problem
//   plan(shape, device, accum)   -> the tile config with the smallest estimated time
//                                   among those that fit, with a trace of every candidate
#pragma once

#include <cstdint>
#include <string>

namespace astrai::fp8::sm90 {

struct DeviceLimits {
    int cc_major = 0, cc_minor = 0;
    int num_sms = 0;
    int smem_optin = 0;  // bytes a block may opt in to
};

struct ProblemShape {
    int64_t M = 0, N = 0, K = 0;
    int64_t lda = 0, ldb = 0;       // elements between rows of A [M,K] and of B [N,K]
    uint64_t a_addr = 0, b_addr = 0;  // for the 16-byte alignment TMA needs
};

enum class Accum : int { Promote = 0, Fast = 1 };

struct TileConfig {
    int id;
    int bn;
    int stages;
    bool promote;
    int cluster;  // CTAs along M sharing B through TMA multicast (1 or 2)
    double rate;  // relative per-SM throughput of a full tile (measured on an H200)
    bool enabled; // considered by default; a disabled config runs only when forced
    bool swap;    // swap-AB: 128-row tiles over N, bn columns over M (small M only)
    bool split;   // split-K over a cluster of 2..kMaxSplitK CTAs per tile (swap-AB only)
};

// Kept in step with the instantiations in dispatch.cuh.
inline constexpr TileConfig kTileConfigs[] = {
    {0, 256, 4, false, 1, 1.00, true, false, false},
    {1, 192, 5, true, 1, 0.935, true, false, false},
    // dominated by config 14 (the same tile, pipelined promotion): forced only
    {2, 128, 6, true, 1, 0.833, false, false, false},
    {3, 128, 6, false, 1, 0.955, true, false, false},
    // 2-CTA clusters with B multicast, timed on the H200 (docs/kernels/fp8-hopper.md): fast
    // 128x256 0-5 % over config 0 at 10 of 12 shapes, promoted mixed; forced only for now
    {4, 256, 4, false, 2, 1.05, false, false, false},
    {5, 192, 5, true, 2, 0.98, false, false, false},
    {6, 128, 6, false, 2, 1.00, false, false, false},
    {7, 128, 6, true, 2, 0.87, false, false, false},
    // swap-AB for M <= bn (decode-sized M): memory-bound, so deep rings; the tile's MMA
    // work is bn / 128 of a square tile, hence the cost model's preference needs no rate
    {8, 16, 12, true, 1, 1.00, true, true, false},
    {9, 16, 12, false, 1, 1.00, true, true, false},
    {10, 32, 11, true, 1, 1.00, true, true, false},
    {11, 32, 11, false, 1, 1.00, true, true, false},
    {12, 64, 9, true, 1, 1.00, true, true, false},
    {13, 64, 9, false, 1, 1.00, true, true, false},
    // promoted sums with two wgmma chains in turn (GemmConfig Promote = 2): timed in turn
    // with configs 1 and 2 on the H200, 0.99-1.24x config 1 at the 13 shapes with M >= 1024
    // (docs/kernels/fp8-hopper.md); its rate makes it the promoted choice wherever the
    // rounds are not much fewer with 192-wide tiles
    {14, 128, 6, true, 1, 0.97, true, false, false},
    // swap-AB split-K for N too short to give each SM a tile: a tile's K shared by a cluster
    // of 2..4 CTAs, whose partial sums meet in rank 0's shared memory; the rate charges
    // that meeting (promoted sums only: the route they serve asks for them)
    {15, 16, 12, true, 1, 0.9, true, true, true},
    {16, 32, 11, true, 1, 0.9, true, true, true},
    {17, 64, 9, true, 1, 0.9, true, true, true},
};
inline constexpr int kNumTileConfigs = 18;
inline constexpr int kMaxSplitK = 4;  // CTAs of a split-K cluster, at most
inline constexpr int kTileM = 128;
inline constexpr int kTileK = 128;
inline constexpr int kGroupM = 8;

inline int64_t smem_bytes(const TileConfig& c) {
    return static_cast<int64_t>(c.stages) * (kTileM + c.bn) * kTileK + 2 * c.stages * 8 + 1024;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline std::string can_implement(const ProblemShape& s, const DeviceLimits& d) {
    if (!(d.cc_major == 9 && d.cc_minor == 0))
        return "wgmma/TMA path needs sm_90 (device is sm_" + std::to_string(d.cc_major) +
               std::to_string(d.cc_minor) + ")";
    if (s.M <= 0 || s.N <= 0 || s.K <= 0) return "M, N and K must be positive";
    if (s.M > INT32_MAX || s.N > INT32_MAX || s.K > INT32_MAX)
        return "M, N and K must each fit in int32";
    if (s.K % 16 != 0) return "K must be a multiple of 16 (TMA row pitch is 16-byte granular)";
    if (s.lda < s.K || s.ldb < s.K) return "lda and ldb must be >= K";
    if (s.lda % 16 != 0 || s.ldb % 16 != 0)
        return "lda and ldb must be multiples of 16 bytes for TMA";
    if (s.a_addr % 16 != 0 || s.b_addr % 16 != 0)
        return "A and B must be 16-byte aligned for TMA";
    return "";
}

struct Plan {
    bool ok = false;
    int config = -1;
    // tiles_m counts groups of `cluster` vertically adjacent tiles; num_tiles = tiles_m * tiles_n
    // such groups, one per cluster and round; grid = CTAs (cluster * clusters)
    int cluster = 1;
    int tiles_m = 0, tiles_n = 0, num_tiles = 0, grid = 0, k_blocks = 0, group_m = kGroupM;
    // split-K: CTAs per tile (the cluster) and the k-blocks each sums (1 and k_blocks without)
    int split = 1, k_per_split = 0;
    double cost = 0.0;   // estimated, in units of one 128x256 tile at rate 1.0
    std::string trace;   // one line per candidate: accepted (with its cost) or why not
};

// "sm90 128x256x128 s4 fast cluster 1": how traces and benchmarks name a config.
inline std::string config_name(const TileConfig& c) {
    return std::string(c.swap ? "sm90 swap-AB " : "sm90 ") + "128x" + std::to_string(c.bn) + "x128 s" +
           std::to_string(c.stages) + (c.promote ? " promote" : " fast") +
           (c.split ? std::string(" split-K") : " cluster " + std::to_string(c.cluster));
}

// The plan for one tile config, or ok == false with the reason in `trace`.
inline Plan plan_config(const ProblemShape& s, const DeviceLimits& d, const TileConfig& c) {
    Plan p;
    p.trace = config_name(c) + ": ";
    if (smem_bytes(c) > d.smem_optin) {
        p.trace += "needs " + std::to_string(smem_bytes(c)) + " B shared memory, device allows " +
                   std::to_string(d.smem_optin) + "\n";
        return p;
    }
    // swap-AB: the kernel's rows run over N and its bn-wide columns over M
    const int64_t rows = c.swap ? s.N : s.M, cols = c.swap ? s.M : s.N;
    const int64_t tm = ceil_div(ceil_div(rows, kTileM), c.cluster), tn = ceil_div(cols, c.bn);
    const int64_t tiles = tm * tn;
    if (tiles > INT32_MAX) {
        p.trace += "too many tiles\n";
        return p;
    }
    const int64_t k_blocks = ceil_div(s.K, kTileK);
    int64_t split = 1, k_per_split = k_blocks;
    if (c.split) {
        // as many CTAs per tile as fill the SMs once, each with at least one k-block (a cluster
        // owns one tile whatever the grid, so any split is correct; plan() skips a split of 1)
        split = d.num_sms / tiles;
        if (split > kMaxSplitK) split = kMaxSplitK;
        if (split > k_blocks) split = k_blocks;
        if (split < 1) split = 1;
        k_per_split = ceil_div(k_blocks, split);
        split = ceil_div(k_blocks, k_per_split);  // no rank without k-blocks
    }
    const int64_t slots = d.num_sms / (c.cluster * split);  // clusters resident at once (an estimate)
    const int64_t clusters = tiles < slots ? tiles : slots;
    const int64_t rounds = ceil_div(tiles, clusters);
    p.ok = true;
    p.config = c.id;
    p.cluster = c.cluster;
    p.tiles_m = static_cast<int>(tm);
    p.tiles_n = static_cast<int>(tn);
    p.num_tiles = static_cast<int>(tiles);
    p.grid = static_cast<int>(c.split ? tiles * split : clusters * c.cluster);
    p.k_blocks = static_cast<int>(k_blocks);
    p.split = static_cast<int>(split);
    p.k_per_split = static_cast<int>(k_per_split);
    // a split CTA sums k_per_split of the k_blocks
    p.cost = static_cast<double>(rounds) * c.bn / (256.0 * c.rate) * k_per_split / k_blocks;
    p.trace += std::to_string(tiles * c.cluster) + " tiles, " +
               (c.split ? "K split " + std::to_string(split) + " ways, " : std::string()) +
               std::to_string(rounds) + " rounds on " + std::to_string(p.grid) + " CTAs, cost " +
               std::to_string(p.cost) + "\n";
    return p;
}

// The cheapest fitting config for the accumulation mode (force_config >= 0: that one only).
inline Plan plan(const ProblemShape& s, const DeviceLimits& d, Accum accum,
                 int force_config = -1) {
    Plan best;
    const std::string why = can_implement(s, d);
    if (!why.empty()) {
        best.trace = "sm90: " + why + "\n";
        return best;
    }
    std::string trace;
    for (const TileConfig& c : kTileConfigs) {
        if (force_config >= 0 && c.id != force_config) continue;
        if (force_config < 0 && c.promote != (accum == Accum::Promote)) continue;
        if (force_config < 0 && !c.enabled) continue;
        if (force_config < 0 && c.swap && s.M > c.bn) {
            trace += std::string("sm90 swap-AB 128x") + std::to_string(c.bn) + ": only for M <= " +
                     std::to_string(c.bn) + "\n";
            continue;
        }
        Plan p = plan_config(s, d, c);
        if (force_config < 0 && c.split && p.ok && p.split < 2) {
            trace += config_name(c) + ": " +
                     (p.k_blocks < 2 ? std::string("one k-block: nothing to split")
                                     : std::to_string(p.num_tiles) + " tiles leave no SMs for a second CTA per tile" +
                                           " (needs <= " + std::to_string(d.num_sms / 2) + ")") +
                     "\n";
            continue;
        }
        trace += p.trace;
        if (p.ok && (!best.ok || p.cost < best.cost)) best = p;
    }
    if (!best.ok) trace += "sm90: no tile config fits\n";
    best.trace = trace;
    return best;
}

}  // namespace astrai::fp8::sm90
