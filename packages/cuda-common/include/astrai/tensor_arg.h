// A tensor as the compiled ABI sees it: device pointer, shape, strides (elements), dtype.
// Framework-neutral (no torch, no pybind11); bind.h builds one from a Python tuple.
// The expect_* helpers validate on the host and throw InvalidArgument naming the tensor.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "astrai/check.h"
#include "astrai/dtype.h"

namespace astrai {

struct TensorArg {
    const char* name = "tensor";
    std::uintptr_t ptr = 0;
    std::vector<int64_t> shape;
    std::vector<int64_t> strides;  // in elements
    DType dtype = DType::Float32;

    int ndim() const { return static_cast<int>(shape.size()); }
    int64_t size(int dim) const { return shape[static_cast<size_t>(dim < 0 ? dim + ndim() : dim)]; }
    int64_t stride(int dim) const {
        return strides[static_cast<size_t>(dim < 0 ? dim + ndim() : dim)];
    }
    int64_t numel() const {
        int64_t n = 1;
        for (int64_t s : shape) n *= s;
        return n;
    }
    template <typename T>
    T* data() const { return reinterpret_cast<T*>(ptr); }
};

inline std::string shape_str(const std::vector<int64_t>& dims) {
    std::string out = "[";
    for (size_t i = 0; i < dims.size(); ++i) {
        if (i) out += ", ";
        out += std::to_string(dims[i]);
    }
    return out + "]";
}

// Shape/stride sanity every tensor must pass; called by the binding when it builds one.
inline void check_layout(const TensorArg& t) {
    ASTRAI_CHECK(t.shape.size() == t.strides.size(), t.name, ": shape ", shape_str(t.shape),
                 " and strides ", shape_str(t.strides), " differ in length");
    for (size_t i = 0; i < t.shape.size(); ++i) {
        ASTRAI_CHECK(t.shape[i] >= 0, t.name, ": negative size in shape ", shape_str(t.shape));
        ASTRAI_CHECK(t.strides[i] >= 0, t.name, ": negative stride in ", shape_str(t.strides));
    }
}

inline void expect_dtype(const TensorArg& t, DType want) {
    ASTRAI_CHECK(t.dtype == want, t.name, ": expected dtype ", dtype_name(want), ", got ",
                 dtype_name(t.dtype));
}

inline void expect_ndim(const TensorArg& t, int ndim) {
    ASTRAI_CHECK(t.ndim() == ndim, t.name, ": expected ", ndim, " dims, got shape ",
                 shape_str(t.shape));
}

// `want` uses -1 for "any size"; `what` describes the expected shape in words.
inline void expect_shape(const TensorArg& t, std::initializer_list<int64_t> want, const char* what) {
    bool ok = t.shape.size() == want.size();
    size_t i = 0;
    for (int64_t w : want) {
        if (!ok) break;
        ok = w < 0 || t.shape[i] == w;
        ++i;
    }
    ASTRAI_CHECK(ok, t.name, ": expected shape ", what, ", got ", shape_str(t.shape));
}

inline void expect_last_dim_contiguous(const TensorArg& t) {
    ASTRAI_CHECK(t.ndim() > 0 && (t.stride(-1) == 1 || t.size(-1) <= 1), t.name,
                 ": the last dim must be contiguous (stride 1), got strides ", shape_str(t.strides));
}

// Row-major with no gaps (size-1 dims may carry any stride).
inline void expect_contiguous(const TensorArg& t) {
    int64_t want = 1;
    for (int d = t.ndim() - 1; d >= 0; --d) {
        ASTRAI_CHECK(t.size(d) <= 1 || t.stride(d) == want, t.name, ": must be contiguous, got shape ",
                     shape_str(t.shape), " with strides ", shape_str(t.strides));
        want *= t.size(d);
    }
}

// The bytes a non-empty tensor spans, [first, last] (its strides may leave gaps inside).
inline std::pair<std::uintptr_t, std::uintptr_t> byte_span(const TensorArg& t) {
    int64_t last = 0;
    for (int d = 0; d < t.ndim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto size = static_cast<std::uintptr_t>(dtype_size(t.dtype));
    return {t.ptr, t.ptr + static_cast<std::uintptr_t>(last) * size + size - 1};
}

// Whether two tensors' spans share a byte (an empty tensor shares none).
inline bool spans_overlap(const TensorArg& a, const TensorArg& b) {
    if (a.numel() == 0 || b.numel() == 0) return false;
    const auto x = byte_span(a), y = byte_span(b);
    return !(x.second < y.first || y.second < x.first);
}

// A non-empty tensor needs a non-null pointer aligned to `bytes`.
inline void expect_data(const TensorArg& t, int bytes) {
    if (t.numel() == 0) return;
    ASTRAI_CHECK(t.ptr != 0, t.name, ": null data pointer for a non-empty tensor");
    ASTRAI_CHECK(t.ptr % static_cast<std::uintptr_t>(bytes) == 0, t.name, ": data pointer ",
                 detail::Hex{t.ptr}, " is not ", bytes, "-byte aligned");
}

}  // namespace astrai
