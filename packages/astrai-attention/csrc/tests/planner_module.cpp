// Module _attn_planner: the launch heuristics of heuristics.h bound for Python with host
// C++ only (no CUDA toolkit), so the CPU tests check the rules themselves instead of a
// Python copy. The kernel modules bind the same functions (decode_plan, prefill_plan).
//
//   c++ -O1 -std=c++17 -shared -fPIC $(python3 -m pybind11 --includes) -I csrc \
//       csrc/tests/planner_module.cpp -o _attn_planner$(python3-config --extension-suffix)
#include <pybind11/pybind11.h>

#include "heuristics.h"

PYBIND11_MODULE(_attn_planner, m) {
    namespace py = pybind11;
    using namespace astrai::attn;
    m.def("decode_plan", &decode_num_splits, py::arg("batch"), py::arg("kv_heads"), py::arg("group"),
          py::arg("head_dim"), py::arg("kv_len_hint"), py::arg("num_sms"), "Split count of a decode launch.");
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
    m.attr("Q_TILE_ROWS") = kQTileRows;
    m.attr("MAX_SPLITS") = kMaxDecodeSplits;
    m.attr("PREFILL_WARPS") = kPrefillWarps;
}
