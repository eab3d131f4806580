// Plans of the Hopper FP8 GEMM remembered per thread, by everything plan() reads: a decode step
// asks the same few shapes every layer, and building a plan's trace costs a few microseconds of
// host time a call (eager calls pay it; CUDA graphs do not).
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>

#include "planning.h"

namespace astrai::fp8::sm90 {

struct PlanKey {
    int64_t M, N, K, lda, ldb;
    bool a_aligned, b_aligned;  // 16-byte operand addresses (can_implement)
    int accum, force_config, cc, num_sms, smem_optin;
    bool operator==(const PlanKey& o) const {
        return M == o.M && N == o.N && K == o.K && lda == o.lda && ldb == o.ldb && a_aligned == o.a_aligned &&
               b_aligned == o.b_aligned && accum == o.accum && force_config == o.force_config && cc == o.cc &&
               num_sms == o.num_sms && smem_optin == o.smem_optin;
    }
};

struct PlanKeyHash {
    size_t operator()(const PlanKey& k) const {
        size_t h = 0;
        for (int64_t v : {k.M, k.N, k.K, k.lda, k.ldb, int64_t{k.a_aligned} | int64_t{k.b_aligned} << 1,
                          int64_t{k.accum}, int64_t{k.force_config}, int64_t{k.cc}, int64_t{k.num_sms},
                          int64_t{k.smem_optin}})
            h = h * 1000003u ^ std::hash<int64_t>{}(v);
        return h;
    }
};

// plan(s, d, accum, force_config), computed once per thread and key (at most kMaxPlans kept).
inline const Plan& cached_plan(const ProblemShape& s, const DeviceLimits& d, Accum accum, int force_config) {
    constexpr size_t kMaxPlans = 512;
    thread_local std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
    const PlanKey key{s.M, s.N, s.K, s.lda, s.ldb, s.a_addr % 16 == 0, s.b_addr % 16 == 0, static_cast<int>(accum),
                      force_config, d.cc_major * 10 + d.cc_minor, d.num_sms, d.smem_optin};
    const auto found = plans.find(key);
    if (found != plans.end()) return found->second;
    if (plans.size() >= kMaxPlans) plans.clear();  // many shapes: start over rather than grow
    return plans.emplace(key, plan(s, d, accum, force_config)).first->second;
}

}  // namespace astrai::fp8::sm90
