// RMSNorm and SiLU-and-mul entry points of astrai_elementwise._rotary_emb (ABI 1; the kernels are
// in norm_kernel.cuh and silu_mul_kernel.cuh):
//
//   rms_norm(x, weight, out, eps, stream)
//       x [rows, hidden] (float16/bfloat16/float32, any row stride, contiguous rows)
//       normalized and scaled by weight [hidden] (x's dtype, contiguous) into out [rows,
//       hidden] (x itself: in place).
//   fused_add_rms_norm(x, residual, weight, out, eps, stream)
//       residual [rows, hidden] += x in place, then out = rms_norm(residual) (out may be x).
//   silu_and_mul(gate_up, out, stream)
//       gate_up [rows, 2 * inter] -> out [rows, inter] = silu(gate_up[:, :inter]) * gate_up[:, inter:].
//   norm_launch(hidden, dtype_code, vector) -> (threads, accesses_per_thread, channels_per_access)
//       the block shape rms_norm launches for rows of `hidden` channels (0 accesses per
//       thread: the two-pass kernel, for rows wider than the registers hold and the scalar path).
//
// Every argument is checked before any CUDA call (ValueError naming it). The vector path
// (16-byte accesses) runs when every pointer, row stride and channel count allows it, else
// the scalar path (one element per access) does.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "astrai/bind.h"
#include "astrai/check.h"
#include "astrai/tensor_arg.h"
#include "capabilities.h"
#include "norm.h"
#include "norm_kernel.cuh"
#include "silu_mul_kernel.cuh"

namespace astrai::norm {

namespace py = pybind11;

namespace {

constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();

using rotary::is_dtype;

// A [rows, channels] operand: float dtype, contiguous rows, aligned data.
void expect_rows(const TensorArg& t) {
    expect_ndim(t, 2);
    ASTRAI_CHECK(is_dtype(t.dtype), t.name, ": expected " ASTRAI_ROTARY_DTYPES_TEXT ", got ", dtype_name(t.dtype));
    expect_last_dim_contiguous(t);
    expect_data(t, dtype_size(t.dtype));
    ASTRAI_CHECK(t.size(0) <= kMaxRows, t.name, ": ", t.size(0), " rows, at most 2^31 - 1 per call");
}

void expect_like(const TensorArg& t, const TensorArg& like) {
    ASTRAI_CHECK(t.dtype == like.dtype, t.name, ": dtype ", dtype_name(t.dtype), " must equal ", like.name, "'s ",
                 dtype_name(like.dtype));
    ASTRAI_CHECK(t.shape == like.shape, t.name, ": shape ", shape_str(t.shape), " must equal ", like.name,
                 "'s shape ", shape_str(like.shape));
    expect_rows(t);
}

// The bytes a tensor spans, [first, last].
std::pair<std::uintptr_t, std::uintptr_t> span(const TensorArg& t) {
    int64_t last = 0;
    for (int d = 0; d < t.ndim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto size = static_cast<std::uintptr_t>(dtype_size(t.dtype));
    return {t.ptr, t.ptr + static_cast<std::uintptr_t>(last) * size + size - 1};
}

// `out` is `in` itself (in place) or shares none of its memory.
void expect_apart(const TensorArg& out, const TensorArg& in, bool may_alias) {
    if (out.numel() == 0 || in.numel() == 0) return;
    const bool same = out.ptr == in.ptr && out.strides == in.strides;
    if (may_alias && same) return;
    const auto a = span(out), b = span(in);
    ASTRAI_CHECK(a.second < b.first || b.second < a.first, out.name, ": overlaps ", in.name,
                 may_alias ? " (it may only be the same tensor, in place)" : "");
}

bool aligned(const TensorArg& t, int64_t elems) {
    return t.ptr % 16 == 0 && (t.size(0) <= 1 || t.stride(0) % elems == 0);
}

// The accesses per thread of the register-resident instantiations, narrowest first; wider
// rows and the scalar path take the two-pass instantiation (0).
constexpr int kVectorVecs[] = {1, 2, 4, 8};

struct NormShape {
    int threads = 0;
    int vecs = 0;  // 0: two passes over the row
    int elems = 0;
};

// The block shape for rows of `hidden` channels of `elem_bytes` each: the fewest accesses per
// thread that keep the row in registers with at most kMaxThreads threads, else two passes
// (a pure function of its inputs).
NormShape norm_shape(int64_t hidden, int elem_bytes, bool vector) {
    NormShape shape;
    shape.elems = vector ? 16 / elem_bytes : 1;
    const int64_t accesses = hidden / shape.elems;
    if (vector) {
        for (int vecs : kVectorVecs) {
            if (accesses <= int64_t{NormConfig<float, 4, 1>::kMaxThreads} * vecs) {
                shape.vecs = vecs;
                break;
            }
        }
    }
    switch (shape.vecs) {
        case 1: shape.threads = NormConfig<float, 4, 1>::threads(accesses); break;
        case 2: shape.threads = NormConfig<float, 4, 2>::threads(accesses); break;
        case 4: shape.threads = NormConfig<float, 4, 4>::threads(accesses); break;
        case 8: shape.threads = NormConfig<float, 4, 8>::threads(accesses); break;
        default: shape.threads = NormConfig<float, 4, 0>::threads(accesses); break;
    }
    return shape;
}

template <typename T, int kElems, int kVecs>
void launch_norm(const NormParams& p, int64_t rows, cudaStream_t stream) {
    using Config = NormConfig<T, kElems, kVecs>;
    rms_norm_kernel<T, kElems, kVecs><<<static_cast<unsigned>(rows), Config::threads(p.accesses), 0, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
}

template <typename T>
void launch_norm_dtype(const NormParams& p, int64_t rows, const NormShape& shape, cudaStream_t stream) {
    constexpr int kVector = 16 / int(sizeof(T));
    if (shape.elems == 1) return launch_norm<T, 1, 0>(p, rows, stream);
    switch (shape.vecs) {
        case 1: return launch_norm<T, kVector, 1>(p, rows, stream);
        case 2: return launch_norm<T, kVector, 2>(p, rows, stream);
        case 4: return launch_norm<T, kVector, 4>(p, rows, stream);
        case 8: return launch_norm<T, kVector, 8>(p, rows, stream);
        default: return launch_norm<T, kVector, 0>(p, rows, stream);
    }
}

// rms_norm with or without the residual add, every argument checked first.
void norm_checked(const TensorArg& x, const TensorArg* residual, const TensorArg& weight, const TensorArg& out,
                  double eps, cudaStream_t stream) {
    expect_rows(x);
    const int64_t rows = x.size(0), hidden = x.size(1);
    ASTRAI_CHECK(hidden > 0 && hidden <= std::numeric_limits<int32_t>::max(), x.name,
                 ": hidden size (last dim) must be in [1, 2^31 - 1], got shape ", shape_str(x.shape));
    expect_ndim(weight, 1);
    ASTRAI_CHECK(weight.dtype == x.dtype && weight.size(0) == hidden, weight.name, ": expected ", dtype_name(x.dtype),
                 " [", hidden, "] like ", x.name, "'s last dim, got ", dtype_name(weight.dtype), " ",
                 shape_str(weight.shape));
    expect_last_dim_contiguous(weight);
    expect_data(weight, dtype_size(weight.dtype));
    expect_like(out, x);
    ASTRAI_CHECK(std::isfinite(eps) && eps >= 0, "eps: expected a finite value >= 0, got ", eps);
    if (residual != nullptr) {
        expect_like(*residual, x);
        expect_apart(*residual, x, false);
        expect_apart(out, *residual, false);
    }
    expect_apart(out, x, true);
    const int64_t elems = 16 / dtype_size(x.dtype);
    bool vector = hidden % elems == 0 && aligned(x, elems) && aligned(out, elems) && weight.ptr % 16 == 0;
    if (residual != nullptr) vector = vector && aligned(*residual, elems);
    const NormShape shape = norm_shape(hidden, dtype_size(x.dtype), vector);
    if (rows == 0) return;
    NormParams p;
    p.x = x.data<const void>();
    p.residual = residual == nullptr ? nullptr : residual->data<void>();
    p.weight = weight.data<const void>();
    p.out = out.data<void>();
    p.x_stride = x.stride(0);
    p.residual_stride = residual == nullptr ? 0 : residual->stride(0);
    p.out_stride = out.stride(0);
    p.accesses = static_cast<int32_t>(hidden / shape.elems);
    p.inv_hidden = 1.f / static_cast<float>(hidden);
    p.eps = static_cast<float>(eps);
    switch (x.dtype) {
        case DType::Float32: return launch_norm_dtype<float>(p, rows, shape, stream);
        case DType::Float16: return launch_norm_dtype<__half>(p, rows, shape, stream);
        default: return launch_norm_dtype<__nv_bfloat16>(p, rows, shape, stream);
    }
}

template <typename T, int kElems>
void launch_silu(const SiluMulParams& p, cudaStream_t stream) {
    using Config = SiluMulConfig<T, kElems>;
    silu_and_mul_kernel<T, kElems><<<Config::blocks(p.total), Config::kThreads, 0, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
}

template <typename T>
void launch_silu_dtype(const SiluMulParams& p, bool vector, cudaStream_t stream) {
    vector ? launch_silu<T, 16 / int(sizeof(T))>(p, stream) : launch_silu<T, 1>(p, stream);
}

}  // namespace

void rms_norm(py::handle x_arg, py::handle weight_arg, py::handle out_arg, double eps, py::handle stream_arg) {
    const auto [x, weight, out] = bind::tensor_args({"x", "weight", "out"}, {x_arg, weight_arg, out_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    norm_checked(x, nullptr, weight, out, eps, stream);
}

void fused_add_rms_norm(py::handle x_arg, py::handle residual_arg, py::handle weight_arg, py::handle out_arg,
                        double eps, py::handle stream_arg) {
    const auto [x, residual, weight, out] =
        bind::tensor_args({"x", "residual", "weight", "out"}, {x_arg, residual_arg, weight_arg, out_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    norm_checked(x, &residual, weight, out, eps, stream);
}

void silu_and_mul(py::handle gate_up_arg, py::handle out_arg, py::handle stream_arg) {
    const auto [in, out] = bind::tensor_args({"gate_up", "out"}, {gate_up_arg, out_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    expect_rows(in);
    ASTRAI_CHECK(in.size(1) > 0 && in.size(1) % 2 == 0, in.name,
                 ": the last dim (gate and up, 2 * intermediate) must be even and positive, got shape ",
                 shape_str(in.shape));
    const int64_t rows = in.size(0), inter = in.size(1) / 2;
    ASTRAI_CHECK(out.dtype == in.dtype && out.ndim() == 2 && out.size(0) == rows && out.size(1) == inter, out.name,
                 ": expected ", dtype_name(in.dtype), " [", rows, ", ", inter, "], got ", dtype_name(out.dtype), " ",
                 shape_str(out.shape));
    expect_rows(out);
    expect_apart(out, in, false);
    const int64_t elems = 16 / dtype_size(in.dtype);
    const bool vector = inter % elems == 0 && aligned(in, elems) && aligned(out, elems);
    const int64_t per_row = inter / (vector ? elems : 1);
    ASTRAI_CHECK(rows * per_row <= std::numeric_limits<int32_t>::max(), in.name, ": shape ", shape_str(in.shape),
                 " is too large (at most 2^31 - 1 accesses per call)");
    if (rows == 0) return;
    SiluMulParams p;
    p.in = in.data<const void>();
    p.out = out.data<void>();
    p.in_stride = in.stride(0);
    p.out_stride = out.stride(0);
    p.inter = inter;
    p.total = static_cast<uint32_t>(rows * per_row);
    p.per_row = FastDivmod(static_cast<uint32_t>(per_row));
    switch (in.dtype) {
        case DType::Float32: return launch_silu_dtype<float>(p, vector, stream);
        case DType::Float16: return launch_silu_dtype<__half>(p, vector, stream);
        default: return launch_silu_dtype<__nv_bfloat16>(p, vector, stream);
    }
}

std::tuple<int, int, int> norm_launch(int64_t hidden, int64_t dtype_code, bool vector) {
    const DType dtype = dtype_from_code(dtype_code, "dtype_code");
    ASTRAI_CHECK(is_dtype(dtype), "dtype_code: expected " ASTRAI_ROTARY_DTYPES_TEXT ", got ", dtype_name(dtype));
    ASTRAI_CHECK(hidden > 0, "hidden: must be positive, got ", hidden);
    const NormShape shape = norm_shape(hidden, dtype_size(dtype), vector);
    return {shape.threads, shape.vecs, shape.elems};
}

void bind(py::module_& m) {
    m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("eps"), py::arg("stream"),
          "RMSNorm of the rows of x [rows, hidden] (f16/bf16/f32, contiguous rows) scaled by weight [hidden]\n"
          "(x's dtype) into out [rows, hidden] (x itself: in place); float32 statistics. Each tensor is a\n"
          "tuple (data_ptr, shape, strides_in_elements, dtype_code); stream is the cudaStream_t as an int.\n"
          "ValueError on bad arguments before any CUDA call, RuntimeError when CUDA fails.");
    m.def("fused_add_rms_norm", &fused_add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"),
          py::arg("out"), py::arg("eps"), py::arg("stream"),
          "residual [rows, hidden] += x in place, then out = rms_norm(residual, weight, eps) (out may be x).");
    m.def("silu_and_mul", &silu_and_mul, py::arg("gate_up"), py::arg("out"), py::arg("stream"),
          "out [rows, inter] = silu(gate_up[:, :inter]) * gate_up[:, inter:] for gate_up [rows, 2 * inter].");
    m.def("norm_launch", &norm_launch, py::arg("hidden"), py::arg("dtype_code"), py::arg("vector"),
          "(threads, accesses per thread, channels per access) of rms_norm's block for rows of `hidden`\n"
          "channels on the vector (16-byte) or scalar path; 0 accesses per thread: two passes over the row.");
}

}  // namespace astrai::norm
