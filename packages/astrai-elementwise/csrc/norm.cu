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
//   rms_norm_fp8(x, residual, weight, q, scale, eps, stream)
//       rms_norm (residual None) or fused_add_rms_norm (residual updated in place, x left as it
//       is) with the normalized rows leaving as e4m3 q [rows, hidden] and their float32
//       dequantization scales scale [rows] (row_fp8.cuh): the W8A8 linear's input, quantized.
//   silu_and_mul_fp8(gate_up, q, scale, stream)
//       silu_and_mul into e4m3 q [rows, inter] and scale [rows] the same way.
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
#include "astrai/device.cuh"
#include "astrai/tensor_arg.h"
#include "capabilities.h"
#include "norm.h"
#include "norm_kernel.cuh"
#include "row_fp8.cuh"
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

// `out` is `in` itself (in place) or shares none of its memory.
void expect_apart(const TensorArg& out, const TensorArg& in, bool may_alias) {
    if (may_alias && out.ptr == in.ptr && out.strides == in.strides) return;
    ASTRAI_CHECK(!spans_overlap(out, in), out.name, ": overlaps ", in.name,
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

// One block a row: the norm (kFp8: into e4m3 rows), or with kSilu the fp8 SiLU-and-mul.
template <typename T, int kElems, int kVecs, bool kFp8, bool kSilu, typename Params>
void launch_rows(const Params& p, int64_t rows, cudaStream_t stream) {
    using Config = NormConfig<T, kElems, kVecs>;
    const int threads = Config::threads(p.accesses);
    if constexpr (kSilu) {
        if (p.row_accesses > 0) return launch_cluster_rows(silu_and_mul_fp8_kernel<T, kElems, kVecs, true>, p, rows,
                                                           threads, stream);
        silu_and_mul_fp8_kernel<T, kElems, kVecs><<<static_cast<unsigned>(rows), threads, 0, stream>>>(p);
    } else {
        rms_norm_kernel<T, kElems, kVecs, kFp8><<<static_cast<unsigned>(rows), threads, 0, stream>>>(p);
    }
    ASTRAI_CHECK_LAUNCH();
}

template <typename T, bool kFp8 = false, bool kSilu = false, typename Params>
void launch_rows_dtype(const Params& p, int64_t rows, const NormShape& shape, cudaStream_t stream) {
    constexpr int kVector = 16 / int(sizeof(T));
    if (shape.elems == 1) return launch_rows<T, 1, 0, kFp8, kSilu>(p, rows, stream);
    switch (shape.vecs) {
        case 1: return launch_rows<T, kVector, 1, kFp8, kSilu>(p, rows, stream);
        case 2: return launch_rows<T, kVector, 2, kFp8, kSilu>(p, rows, stream);
        case 4: return launch_rows<T, kVector, 4, kFp8, kSilu>(p, rows, stream);
        case 8: return launch_rows<T, kVector, 8, kFp8, kSilu>(p, rows, stream);
        default: return launch_rows<T, kVector, 0, kFp8, kSilu>(p, rows, stream);
    }
}

template <bool kFp8 = false, bool kSilu = false, typename Params>
void launch_rows_any(DType dtype, const Params& p, int64_t rows, const NormShape& shape, cudaStream_t stream) {
    if constexpr (kFp8) {  // from 16-bit rows only (is_fp8_row_source_dtype, checked)
        if (dtype == DType::Float16) return launch_rows_dtype<__half, true, kSilu>(p, rows, shape, stream);
        return launch_rows_dtype<__nv_bfloat16, true, kSilu>(p, rows, shape, stream);
    } else {
        switch (dtype) {
            case DType::Float32: return launch_rows_dtype<float>(p, rows, shape, stream);
            case DType::Float16: return launch_rows_dtype<__half>(p, rows, shape, stream);
            default: return launch_rows_dtype<__nv_bfloat16>(p, rows, shape, stream);
        }
    }
}

// An e4m3 output q [rows, channels] and its scales [rows] for rows of `like`: q 1-byte elements
// with contiguous rows, scale float32 contiguous, neither overlapping `like`.
void expect_fp8_rows(const TensorArg& q, const TensorArg& scale, const TensorArg& like, int64_t channels) {
    const int64_t rows = like.size(0);
    ASTRAI_CHECK(rotary::is_fp8_row_source_dtype(like.dtype), like.name,
                 ": expected " ASTRAI_ROTARY_FP8_ROW_SOURCE_DTYPES_TEXT " for e4m3 rows, got ", dtype_name(like.dtype));
    ASTRAI_CHECK(rotary::is_fp8_row_dtype(q.dtype) && q.ndim() == 2 && q.size(0) == rows && q.size(1) == channels,
                 q.name, ": expected " ASTRAI_ROTARY_FP8_ROW_DTYPES_TEXT " [", rows, ", ", channels, "], got ",
                 dtype_name(q.dtype), " ", shape_str(q.shape));
    expect_last_dim_contiguous(q);
    expect_data(q, 1);
    ASTRAI_CHECK(scale.dtype == DType::Float32 && scale.ndim() == 1 && scale.size(0) == rows, scale.name,
                 ": expected float32 [", rows, "] (one scale a row), got ", dtype_name(scale.dtype), " ",
                 shape_str(scale.shape));
    expect_last_dim_contiguous(scale);
    expect_data(scale, 4);
    expect_apart(q, like, false);
    expect_apart(scale, like, false);
    expect_apart(scale, q, false);
}

// q's rows take the vector path's stores (8 bytes for 16-bit rows, 4 for float32).
bool aligned_q(const TensorArg& q, int64_t elems) {
    return q.ptr % elems == 0 && (q.size(0) <= 1 || q.stride(0) % elems == 0);
}

// rms_norm with or without the residual add, every argument checked first.
// The normalized rows go to `out` (16-bit) or, where `q` is given, to e4m3 `q` and `scale`.
void norm_checked(const TensorArg& x, const TensorArg* residual, const TensorArg& weight, const TensorArg* out,
                  const TensorArg* q, const TensorArg* scale, double eps, cudaStream_t stream) {
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
    if (out != nullptr) expect_like(*out, x);
    ASTRAI_CHECK(std::isfinite(eps) && eps >= 0, "eps: expected a finite value >= 0, got ", eps);
    if (residual != nullptr) {
        expect_like(*residual, x);
        expect_apart(*residual, x, false);
        if (out != nullptr) expect_apart(*out, *residual, false);
    }
    if (out != nullptr) expect_apart(*out, x, true);
    const int64_t elems = 16 / dtype_size(x.dtype);
    bool vector = hidden % elems == 0 && aligned(x, elems) && weight.ptr % 16 == 0;
    vector = vector && (out != nullptr ? aligned(*out, elems) : aligned_q(*q, elems));
    if (residual != nullptr) vector = vector && aligned(*residual, elems);
    if (q != nullptr) {
        expect_fp8_rows(*q, *scale, x, hidden);
        if (residual != nullptr) {
            expect_apart(*q, *residual, false);
            expect_apart(*scale, *residual, false);
        }
    }
    const NormShape shape = norm_shape(hidden, dtype_size(x.dtype), vector);
    if (rows == 0) return;
    NormParams p;
    p.x = x.data<const void>();
    p.residual = residual == nullptr ? nullptr : residual->data<void>();
    p.weight = weight.data<const void>();
    p.x_stride = x.stride(0);
    p.residual_stride = residual == nullptr ? 0 : residual->stride(0);
    p.accesses = static_cast<int32_t>(hidden / shape.elems);
    p.inv_hidden = 1.f / static_cast<float>(hidden);
    p.eps = static_cast<float>(eps);
    if (q != nullptr) {
        p.q = q->data<uint8_t>();
        p.scale = scale->data<float>();
        p.q_stride = q->stride(0);
        return launch_rows_any<true>(x.dtype, p, rows, shape, stream);
    }
    p.out = out->data<void>();
    p.out_stride = out->stride(0);
    launch_rows_any(x.dtype, p, rows, shape, stream);
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
    norm_checked(x, nullptr, weight, &out, nullptr, nullptr, eps, stream);
}

void fused_add_rms_norm(py::handle x_arg, py::handle residual_arg, py::handle weight_arg, py::handle out_arg,
                        double eps, py::handle stream_arg) {
    const auto [x, residual, weight, out] =
        bind::tensor_args({"x", "residual", "weight", "out"}, {x_arg, residual_arg, weight_arg, out_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    norm_checked(x, &residual, weight, &out, nullptr, nullptr, eps, stream);
}

void rms_norm_fp8(py::handle x_arg, py::handle residual_arg, py::handle weight_arg, py::handle q_arg,
                  py::handle scale_arg, double eps, py::handle stream_arg) {
    const auto [x, weight, q, scale] =
        bind::tensor_args({"x", "weight", "q", "scale"}, {x_arg, weight_arg, q_arg, scale_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    if (residual_arg.is_none()) return norm_checked(x, nullptr, weight, nullptr, &q, &scale, eps, stream);
    const auto [residual] = bind::tensor_args({"residual"}, {residual_arg});
    norm_checked(x, &residual, weight, nullptr, &q, &scale, eps, stream);
}

// gate_up [rows, 2 * inter] checked: its rows and inter.
int64_t gate_up_inter(const TensorArg& in) {
    expect_rows(in);
    ASTRAI_CHECK(in.size(1) > 0 && in.size(1) % 2 == 0, in.name,
                 ": the last dim (gate and up, 2 * intermediate) must be even and positive, got shape ",
                 shape_str(in.shape));
    return in.size(1) / 2;
}

void silu_and_mul(py::handle gate_up_arg, py::handle out_arg, py::handle stream_arg) {
    const auto [in, out] = bind::tensor_args({"gate_up", "out"}, {gate_up_arg, out_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    const int64_t rows = in.size(0), inter = gate_up_inter(in);
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

void silu_and_mul_fp8(py::handle gate_up_arg, py::handle q_arg, py::handle scale_arg, py::handle stream_arg) {
    const auto [in, q, scale] = bind::tensor_args({"gate_up", "q", "scale"}, {gate_up_arg, q_arg, scale_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    const int64_t rows = in.size(0), inter = gate_up_inter(in);
    ASTRAI_CHECK(inter <= std::numeric_limits<int32_t>::max(), in.name, ": shape ", shape_str(in.shape),
                 " is too large (at most 2^31 - 1 channels a row)");
    expect_fp8_rows(q, scale, in, inter);
    const int64_t elems = 16 / dtype_size(in.dtype);
    const bool vector = inter % elems == 0 && aligned(in, elems) && aligned_q(q, elems);
    if (rows == 0) return;
    const int64_t per = vector ? elems : 1, accesses = inter / per;
    const int split = silu_fp8_split(rows, accesses, cached_device_attribute<cudaDevAttrMultiProcessorCount>(),
                                     built_for_sm90() && current_device_sm() == 90);
    const int64_t share = (accesses + split - 1) / split;  // a block's accesses of its row
    const NormShape shape = norm_shape(share * per, dtype_size(in.dtype), vector);
    SiluMulParams p;
    p.in = in.data<const void>();
    p.in_stride = in.stride(0);
    p.inter = inter;
    p.q = q.data<uint8_t>();
    p.scale = scale.data<float>();
    p.q_stride = q.stride(0);
    p.accesses = static_cast<int32_t>(share);
    p.row_accesses = split > 1 ? static_cast<int32_t>(accesses) : 0;
    launch_rows_any<true, true>(in.dtype, p, rows, shape, stream);
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
    m.def("rms_norm_fp8", &rms_norm_fp8, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("q"),
          py::arg("scale"), py::arg("eps"), py::arg("stream"),
          "rms_norm of x (residual None) or of residual += x (in place; x unchanged) into e4m3 rows\n"
          "q [rows, hidden] with float32 dequantization scales scale [rows] (amax / 448 per row).");
    m.def("silu_and_mul_fp8", &silu_and_mul_fp8, py::arg("gate_up"), py::arg("q"), py::arg("scale"),
          py::arg("stream"),
          "silu_and_mul of gate_up [rows, 2 * inter] into e4m3 rows q [rows, inter] with float32\n"
          "dequantization scales scale [rows] (amax / 448 per row).");
    m.def("norm_launch", &norm_launch, py::arg("hidden"), py::arg("dtype_code"), py::arg("vector"),
          "(threads, accesses per thread, channels per access) of rms_norm's block for rows of `hidden`\n"
          "channels on the vector (16-byte) or scalar path; 0 accesses per thread: two passes over the row.");
}

}  // namespace astrai::norm
