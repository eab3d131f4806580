// Module _attn_planner: the launch heuristics of heuristics.h bound for Python with host
// C++ only (no CUDA toolkit), so the CPU tests check the rules themselves instead of a
// Python copy. The kernel modules bind the same functions (decode_plan, prefill_plan).
// prefill_coverage walks every block of a prefill launch through the kernels' own schedule
// code (prefill_schedule.h) and counts how often each (request, row, query head) is computed
// and, for the Hopper kernel, stored (a warpgroup's TMA box of O or its 16-byte chunks).
//
//   c++ -O1 -std=c++17 -shared -fPIC $(python3 -m pybind11 --includes) -I csrc \
//       csrc/tests/planner_module.cpp -o _attn_planner$(python3-config --extension-suffix)
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "heuristics.h"
#include "prefill_schedule.h"

namespace {

using namespace astrai::attn;

// kernel: "mma4" / "mma8" (the mma.sync block of 4 or 8 warps), "ws" (the Hopper kernel) or
// "ws_mha" (the Hopper kernel built with ASTRAI_PREFILL_WS_MHA). Dense launches take equal
// q_lens (a [B, L] batch), packed ones any (the plan's 64-row host tiles per request).
pybind11::dict prefill_coverage(const std::vector<int>& q_lens, bool packed, int q_heads, int kv_heads,
                                const std::string& kernel, bool causal) {
    AttentionParams p;
    p.q_heads = q_heads;
    p.kv_heads = kv_heads;
    p.group = q_heads / kv_heads;
    p.head_block = prefill_head_block(p.group);
    p.head_groups = prefill_head_groups(p.group);
    p.causal = causal;
    const int batch = int(q_lens.size());
    std::vector<int> qo_indptr = {0}, tile_b, tile_i;
    for (int b = 0; b < batch; ++b) {
        qo_indptr.push_back(qo_indptr.back() + q_lens[b]);
        for (int t = 0; t < num_q_tiles(q_lens[b]); ++t) { tile_b.push_back(b); tile_i.push_back(t); }
    }
    unsigned tiles = unsigned(tile_b.size()), launch_batch = 1;
    if (packed) {
        p.qo_indptr = qo_indptr.data();
        p.q_tile_to_batch = tile_b.data();
        p.q_tile_to_index = tile_i.data();
        p.num_q_tiles = int(tiles);
    } else {
        p.q_len = q_lens.at(0);
        p.batch = batch;
        tiles = unsigned(num_q_tiles(p.q_len));
        launch_batch = unsigned(batch);
    }
    const PrefillGrid g = kernel.rfind("mma", 0) == 0
                              ? prefill_mma_grid(p, tiles, launch_batch, kernel == "mma8" ? 8 : kPrefillWarps)
                              : prefill_ws_grid(p, tiles, launch_batch, packed, kernel == "ws_mha");
    std::vector<std::vector<int>> counts(batch), stores(batch);  // [b][row * q_heads + head]
    for (int b = 0; b < batch; ++b) counts[b].assign(size_t(q_lens[b]) * q_heads, 0);
    stores = counts;
    const bool hopper = kernel.rfind("ws", 0) == 0;
    int blocks = 0, empty = 0, tma_boxes = 0, boxes_outside = 0;
    for (unsigned z = 0; z < g.z; ++z)
        for (unsigned y = 0; y < g.y; ++y)
            for (unsigned x = 0; x < g.x; ++x) {
                const BlockCoord c{int(x), int(y), int(z), int(g.x)};
                const QWork qw = packed ? PackedQSchedule::get(p, c) : DenseQSchedule::get(p, c);
                ++blocks;
                if (qw.row_base >= qw.q_len) {  // the kernels skip such blocks
                    ++empty;
                    continue;
                }
                const PrefillSpan s = prefill_heads(p, int(y));
                for (int slot = 0; slot < s.nslots; ++slot)
                    for (int r = 0; r < s.rows_blk && qw.row_base + r < qw.q_len; ++r)
                        ++counts[qw.b][size_t(qw.row_base + r) * q_heads + s.head0 + slot];
                if (!hopper) continue;
                // each consumer warpgroup's 64 pairs (block rows 64 wg ..): a TMA box where it
                // lies inside, else the chunk loop's (slot, row) pairs inside the request
                for (int wg = 0; wg < 2; ++wg) {
                    const OStoreBox box = o_store_box(p, qw, s, wg);
                    if (box.inside) {
                        ++tma_boxes;
                        for (int h = box.head; h < box.head + box.shape.heads; ++h)
                            for (int r = qw.row_base + box.row_off; r < qw.row_base + box.row_off + box.shape.rows;
                                 ++r) {
                                const bool in = r < qw.q_len && h >= s.head0 && h < s.head0 + s.nslots;
                                if (in) ++stores[qw.b][size_t(r) * q_heads + h];
                                boxes_outside += !in;
                            }
                        continue;
                    }
                    for (int pair = 64 * wg; pair < 64 * wg + 64; ++pair) {
                        const int slot = pair / s.rows_blk, row = qw.row_base + pair % s.rows_blk;
                        if (slot < s.nslots && row < qw.q_len) ++stores[qw.b][size_t(row) * q_heads + s.head0 + slot];
                    }
                }
            }
    auto range = [](const std::vector<std::vector<int>>& per_request) {
        int lo = 1 << 30, hi = 0;
        for (const auto& v : per_request)
            for (int n : v) { lo = std::min(lo, n); hi = std::max(hi, n); }
        return std::pair{lo, hi};
    };
    const auto [lo, hi] = range(counts);
    pybind11::dict out;
    out["min"] = lo;
    out["max"] = hi;
    if (hopper) {
        const auto [store_lo, store_hi] = range(stores);
        out["store_min"] = store_lo;
        out["store_max"] = store_hi;
        out["tma_boxes"] = tma_boxes;
        out["pairs_outside_boxes"] = boxes_outside;  // (row, head) pairs a box reached outside its block
    }
    out["blocks"] = blocks;
    out["empty_blocks"] = empty;
    out["head_block"] = p.head_block;
    out["rows_per_block"] = prefill_block_rows(p);
    return out;
}

}  // namespace

PYBIND11_MODULE(_attn_planner, m) {
    namespace py = pybind11;
    using namespace astrai::attn;
    m.def("decode_plan", &decode_num_splits, py::arg("batch"), py::arg("kv_heads"), py::arg("group"),
          py::arg("head_dim"), py::arg("kv_len_hint"), py::arg("num_sms"), py::arg("kv_bytes") = 2,
          "Split count of a decode launch.");
    m.def("decode_kv_tile", &decode_kv_tile, py::arg("head_dim"), "K/V rows per decode tile.");
    m.def("decode_head_groups", &decode_head_groups, py::arg("group"), "Decode blocks per kv head.");
    m.def("num_q_tiles", &num_q_tiles, py::arg("q_len"), "Host Q tiles of a request of q_len rows.");
    m.def(
        "prefill_launch",
        [](int group, int head_dim) {
            const PrefillLaunch l = prefill_launch(group, head_dim);
            return py::make_tuple(l.head_block, l.head_groups, l.warps, l.blocks_per_tile);
        },
        py::arg("group"), py::arg("head_dim"), "(head_block, head_groups, warps, blocks_per_tile).");
    m.def("prefill_coverage", &prefill_coverage, py::arg("q_lens"), py::arg("packed"), py::arg("q_heads"),
          py::arg("kv_heads"), py::arg("kernel"), py::arg("causal"),
          "Every block of a prefill launch through the kernels' schedules: {min, max} computations of a "
          "(request, row, head), blocks, empty_blocks, head_block, rows_per_block.");
    m.attr("Q_TILE_ROWS") = kQTileRows;
    m.attr("MAX_SPLITS") = kMaxDecodeSplits;
    m.attr("PREFILL_WARPS") = kPrefillWarps;
}
