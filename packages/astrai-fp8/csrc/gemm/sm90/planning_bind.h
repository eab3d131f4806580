// Python bindings of the Hopper planner (planning.h), so that Python never re-implements
// it: bound into _fp8_ops as the submodule `sm90`, and into a host-only module that the CPU
// tests build from this header alone (tests/helpers/build_helpers.py: sm90_planner()).
//
//   TILE_CONFIGS, TILE_M, TILE_K, GROUP_M, H200     the table and constants
//   ProblemShape(M, N, K, lda=K, ldb=K, a_addr=0, b_addr=0), DeviceLimits(cc_major, cc_minor,
//   num_sms, smem_optin)                             the inputs
//   plan(s, d=H200, accum="promote", force_config=-1) -> Plan (trace: a list of lines)
//   cached_plan(...) -> the same, as the launcher asks it (plan_cache.h)
//   plan_config(s, d, config), can_implement(s, d) -> "" or why, smem_bytes(config)
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "plan_cache.h"
#include "planning.h"

namespace astrai::fp8::sm90 {

inline std::vector<std::string> trace_lines(const std::string& trace) {
    std::vector<std::string> lines;
    size_t start = 0;
    while (start < trace.size()) {
        const size_t end = trace.find('\n', start);
        const size_t stop = end == std::string::npos ? trace.size() : end;
        if (stop > start) lines.push_back(trace.substr(start, stop - start));
        start = stop + 1;
    }
    return lines;
}

// The types are module-local: _fp8_ops.sm90 and the tests' host-only module bind the same
// C++ types and may share a process.
inline void bind_planning(pybind11::module_ m) {
    namespace py = pybind11;
    py::class_<TileConfig>(m, "TileConfig", py::module_local())
        .def_readonly("id", &TileConfig::id)
        .def_readonly("bn", &TileConfig::bn)
        .def_readonly("stages", &TileConfig::stages)
        .def_readonly("promote", &TileConfig::promote)
        .def_readonly("cluster", &TileConfig::cluster)
        .def_readonly("rate", &TileConfig::rate)
        .def_readonly("enabled", &TileConfig::enabled)
        .def_readonly("swap", &TileConfig::swap)
        .def_readonly("split", &TileConfig::split)
        .def_property_readonly("name", &config_name)
        .def("__repr__", [](const TileConfig& c) { return "<TileConfig " + std::to_string(c.id) + ": " + config_name(c) + ">"; });
    py::class_<DeviceLimits>(m, "DeviceLimits", py::module_local())
        .def(py::init([](int cc_major, int cc_minor, int num_sms, int smem_optin) {
                 DeviceLimits d;
                 d.cc_major = cc_major, d.cc_minor = cc_minor, d.num_sms = num_sms, d.smem_optin = smem_optin;
                 return d;
             }),
             py::arg("cc_major"), py::arg("cc_minor"), py::arg("num_sms"), py::arg("smem_optin"))
        .def_readonly("cc_major", &DeviceLimits::cc_major)
        .def_readonly("cc_minor", &DeviceLimits::cc_minor)
        .def_readonly("num_sms", &DeviceLimits::num_sms)
        .def_readonly("smem_optin", &DeviceLimits::smem_optin);
    py::class_<ProblemShape>(m, "ProblemShape", py::module_local())
        .def(py::init([](int64_t M, int64_t N, int64_t K, std::optional<int64_t> lda, std::optional<int64_t> ldb,
                         uint64_t a_addr, uint64_t b_addr) {
                 ProblemShape s;
                 s.M = M, s.N = N, s.K = K, s.lda = lda.value_or(K), s.ldb = ldb.value_or(K);
                 s.a_addr = a_addr, s.b_addr = b_addr;
                 return s;
             }),
             py::arg("M"), py::arg("N"), py::arg("K"), py::arg("lda") = py::none(), py::arg("ldb") = py::none(),
             py::arg("a_addr") = 0, py::arg("b_addr") = 0)
        .def_readonly("M", &ProblemShape::M)
        .def_readonly("N", &ProblemShape::N)
        .def_readonly("K", &ProblemShape::K)
        .def_readonly("lda", &ProblemShape::lda)
        .def_readonly("ldb", &ProblemShape::ldb);
    py::class_<Plan>(m, "Plan", py::module_local())
        .def_readonly("ok", &Plan::ok)
        .def_readonly("config", &Plan::config)
        .def_readonly("cluster", &Plan::cluster)
        .def_readonly("tiles_m", &Plan::tiles_m)
        .def_readonly("tiles_n", &Plan::tiles_n)
        .def_readonly("num_tiles", &Plan::num_tiles)
        .def_readonly("grid", &Plan::grid)
        .def_readonly("k_blocks", &Plan::k_blocks)
        .def_readonly("group_m", &Plan::group_m)
        .def_readonly("split", &Plan::split)
        .def_readonly("k_per_split", &Plan::k_per_split)
        .def_readonly("cost", &Plan::cost)
        .def_property_readonly("trace", [](const Plan& p) { return trace_lines(p.trace); });

    py::tuple configs(kNumTileConfigs);
    for (int i = 0; i < kNumTileConfigs; ++i) configs[i] = py::cast(kTileConfigs[i]);
    m.attr("TILE_CONFIGS") = configs;
    m.attr("TILE_M") = kTileM;
    m.attr("TILE_K") = kTileK;
    m.attr("GROUP_M") = kGroupM;
    DeviceLimits h200;
    h200.cc_major = 9, h200.cc_minor = 0, h200.num_sms = 132, h200.smem_optin = 232448;
    m.attr("H200") = py::cast(h200);

    m.def("smem_bytes", &smem_bytes, py::arg("config"), "Shared memory one CTA of the config takes.");
    m.def("can_implement", &can_implement, py::arg("s"), py::arg("d"),
          "'' when the Hopper path can take the problem, else the reason it cannot.");
    m.def("plan_config", &plan_config, py::arg("s"), py::arg("d"), py::arg("config"),
          "The plan for one tile config, or ok False with the reason in the trace.");
    const auto accum_of = [](const std::string& accum) {
        if (accum != "promote" && accum != "fast")
            throw py::value_error("accum must be 'promote' or 'fast', got '" + accum + "'");
        return accum == "fast" ? Accum::Fast : Accum::Promote;
    };
    m.def(
        "plan",
        [accum_of](const ProblemShape& s, const DeviceLimits& d, const std::string& accum, int force_config) {
            return plan(s, d, accum_of(accum), force_config);
        },
        py::arg("s"), py::arg("d") = h200, py::arg("accum") = "promote", py::arg("force_config") = -1,
        "The cheapest fitting tile config for the accumulation mode ('promote' or 'fast').");
    m.def(
        "cached_plan",
        [accum_of](const ProblemShape& s, const DeviceLimits& d, const std::string& accum, int force_config) {
            return cached_plan(s, d, accum_of(accum), force_config);
        },
        py::arg("s"), py::arg("d") = h200, py::arg("accum") = "promote", py::arg("force_config") = -1,
        "plan() as the launcher asks it: remembered per thread by everything plan() reads.");
}

}  // namespace astrai::fp8::sm90
