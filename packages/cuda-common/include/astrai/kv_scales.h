// The dequantization scales of one layer of an fp8 KV cache, as the plugins' bindings take
// them: kv_scales = None, or (k_scale, v_scale), float32 [1] (per tensor) or [kv_heads] (per kv
// head) each. The attention plugin's decode, prefill and append and the element-wise plugin's fused
// rope + append read them alike.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

#include "astrai/bind.h"
#include "astrai/check.h"
#include "astrai/dtype.h"
#include "astrai/tensor_arg.h"

namespace astrai {

struct KvScales {
    const float* k = nullptr;
    const float* v = nullptr;
    int stride = 0;  // 0: per tensor, 1: per kv head
};

inline KvScales check_kv_scales(const TensorArg& k_scale, const TensorArg& v_scale, int64_t kv_heads) {
    KvScales s;
    for (const TensorArg* t : {&k_scale, &v_scale}) {
        expect_dtype(*t, DType::Float32);
        ASTRAI_CHECK(t->ndim() == 1 && (t->size(0) == 1 || t->size(0) == kv_heads), t->name,
                     ": expected float32 [1] (per tensor) or [kv_heads] = [", kv_heads, "], got shape ",
                     shape_str(t->shape));
        ASTRAI_CHECK(t->size(0) <= 1 || t->stride(0) == 1, t->name, ": must be contiguous");
        expect_data(*t, 4);
    }
    ASTRAI_CHECK(k_scale.shape == v_scale.shape, v_scale.name, ": shape ", shape_str(v_scale.shape), " differs from ",
                 k_scale.name, "'s ", shape_str(k_scale.shape));
    s.k = k_scale.data<const float>();
    s.v = v_scale.data<const float>();
    s.stride = k_scale.size(0) > 1 ? 1 : 0;
    return s;
}

// The optional kv_scales argument for a cache storing cache_dtype: required for fp8 pages,
// refused for 16-bit ones.
inline std::optional<KvScales> kv_scales_arg(pybind11::handle a, DType cache_dtype, int64_t kv_heads) {
    if (a.is_none()) {
        ASTRAI_CHECK(!is_fp8(cache_dtype), "kv_scales: a ", dtype_name(cache_dtype),
                     " cache needs the layer's (k_scale, v_scale)");
        return std::nullopt;
    }
    ASTRAI_CHECK(is_fp8(cache_dtype), "kv_scales: only an fp8 cache takes scales, k_cache stores ",
                 dtype_name(cache_dtype));
    const auto t = pybind11::reinterpret_borrow<pybind11::tuple>(a);
    ASTRAI_CHECK(t.size() == 2, "kv_scales: expected (k_scale, v_scale), got ", t.size(), " items");
    return check_kv_scales(bind::tensor_arg("k_scale", t[0]), bind::tensor_arg("v_scale", t[1]), kv_heads);
}

}  // namespace astrai
