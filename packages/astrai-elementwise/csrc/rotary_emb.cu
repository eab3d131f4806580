// Rotary embedding entry points of astrai_elementwise._rotary_emb (ABI 1; the kernel is in
// rotary_kernel.cuh):
//
//   rotary(q, k, cos, sin, positions, q_out, k_out, interleaved, inverse, stream)
//       q [B, L, Hq, D] and optionally k [B, L, Hk, D] (float16/bfloat16/float32, any strides
//       with a contiguous last dim) rotated into q_out / k_out (their shape; the same tensor
//       as the input: in place). cos/sin float32 [max_pos, rotary_dim / 2]; positions None
//       (rows 0 .. L-1), int32/int64 [L], [B, L] or [1, L]. interleaved: pairs (2i, 2i+1), else NeoX
//       pairs (i, i + rotary_dim/2); inverse rotates backwards (the gradient).
//   rope_paged_append(q, k, v, k_cache, v_cache, cos, sin, positions, slots, q_out,
//                     interleaved, stream, kv_scales=None)
//       one decode/prefill step of a paged KV cache in one launch: q [T, Hq, D] rotated into
//       q_out, k [T, Hk, D] rotated and written, with v [T, Hk, D], to row slots[t] (int64) of
//       the layer's pages k_cache / v_cache [num_pages, page_size, Hk, D] viewed as
//       [num_pages * page_size, Hk, D]; positions [T] are the tokens' positions. fp8 pages
//       (float8_e4m3fn / float8_e5m2, for float16 / bfloat16 k and v) take kv_scales =
//       (k_scale, v_scale), float32 [1] or [Hk] each: the written values are round_to_fp8(x /
//       scale), saturated (rotary_kernel.cuh).
//   rotary_emb(x, cos, sin, out, stream)
//       the original call: interleaved, cos/sin [L, D/2], no positions.
//
// The module also holds the plugin's other element-wise ops, bound by norm.cu: rms_norm,
// fused_add_rms_norm, silu_and_mul.
//
// Every argument is checked before any CUDA call (ValueError naming it). The vector path
// (16-byte accesses) runs when every pointer, stride and channel count allows it, else the
// scalar path (one element per access) does.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include "astrai/bind.h"
#include "astrai/check.h"
#include "astrai/kv_scales.h"
#include "astrai/tensor_arg.h"
#include "capabilities.h"
#include "norm.h"
#include "rotary_kernel.cuh"

namespace astrai::rotary {

namespace py = pybind11;

void expect_rotated(const TensorArg& t, int ndim) {
    expect_ndim(t, ndim);
    ASTRAI_CHECK(is_dtype(t.dtype), t.name, ": expected " ASTRAI_ROTARY_DTYPES_TEXT ", got ", dtype_name(t.dtype));
    ASTRAI_CHECK(t.size(-1) > 0 && t.size(-1) % 2 == 0, t.name, ": head_dim (last dim) must be even and positive, got ",
                 t.size(-1));
    expect_last_dim_contiguous(t);
    expect_data(t, dtype_size(t.dtype));
}

void expect_like(const TensorArg& t, const TensorArg& like) {
    ASTRAI_CHECK(t.dtype == like.dtype, t.name, ": dtype ", dtype_name(t.dtype), " must equal ", like.name, "'s ",
                 dtype_name(like.dtype));
    ASTRAI_CHECK(t.shape == like.shape, t.name, ": shape ", shape_str(t.shape), " must equal ", like.name, "'s shape ",
                 shape_str(like.shape));
    expect_last_dim_contiguous(t);
    expect_data(t, dtype_size(t.dtype));
}

// cos/sin: float32 [max_pos, rotary_dim / 2], rotary_dim <= head_dim; returns rotary_dim / 2.
int64_t expect_tables(const TensorArg& cos, const TensorArg& sin, int64_t head_dim) {
    for (const TensorArg* t : {&cos, &sin}) {
        expect_ndim(*t, 2);
        expect_dtype(*t, DType::Float32);
        ASTRAI_CHECK(t->size(0) > 0 && t->size(1) > 0 && 2 * t->size(1) <= head_dim, t->name,
                     ": expected [max_pos, rotary_dim / 2] with rotary_dim <= head_dim ", head_dim, ", got ",
                     shape_str(t->shape));
        expect_last_dim_contiguous(*t);
        expect_data(*t, 4);
    }
    ASTRAI_CHECK(sin.shape == cos.shape, "sin: shape ", shape_str(sin.shape), " must equal cos's ", shape_str(cos.shape));
    return cos.size(1);
}

// positions: int32/int64 of one of the shapes given (B = 0: [L] only).
void expect_positions(const TensorArg& t, int64_t B, int64_t L) {
    ASTRAI_CHECK(t.dtype == DType::Int32 || t.dtype == DType::Int64, t.name, ": expected int32 or int64, got ",
                 dtype_name(t.dtype));
    const bool flat = t.ndim() == 1 && t.size(0) == L;
    const bool per_batch = B > 0 && t.ndim() == 2 && (t.size(0) == B || t.size(0) == 1) && t.size(1) == L;
    ASTRAI_CHECK(flat || per_batch, t.name, ": expected shape [", L, "]", B > 0 ? ", [B, L] or [1, L]" : "",
                 ", got ", shape_str(t.shape));
    expect_data(t, dtype_size(t.dtype));
}

int64_t stride_or_zero(const TensorArg& t, int dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

bool aligned(const TensorArg& t, int64_t bytes, int64_t elems, int dims) {
    if (t.ptr % static_cast<std::uintptr_t>(bytes) != 0) return false;
    for (int d = 0; d < dims; ++d) {
        if (t.size(d) != 1 && t.stride(d) % elems != 0) return false;
    }
    return true;
}

// What one launch covers, before the items are counted.
struct Plan {
    RotaryParams p;
    DType dtype = DType::BFloat16;
    bool interleaved = true;
    int64_t head_dim = 0, half = 0;
    const TensorArg* tensors[2 * kMaxSlots] = {};  // in/out of each slot (for the vector check)
    int num_tensors = 0;
    const TensorArg* cos = nullptr;
    const TensorArg* sin = nullptr;
};

// 16-byte accesses everywhere? (channel counts, pointers, strides, the angle rows)
bool fits_vector(const Plan& plan) {
    const int64_t elems = 16 / dtype_size(plan.dtype);
    if (plan.head_dim % elems != 0) return false;
    if ((plan.interleaved ? 2 * plan.half : plan.half) % elems != 0) return false;
    for (int i = 0; i < plan.num_tensors; ++i) {
        const TensorArg& t = *plan.tensors[i];
        if (!aligned(t, 16, elems, t.ndim() - 1)) return false;
    }
    const int64_t angle_bytes = std::min<int64_t>(16, 4 * (plan.interleaved ? elems / 2 : elems));
    for (const TensorArg* t : {plan.cos, plan.sin}) {
        if (!aligned(*t, angle_bytes, angle_bytes / 4, 1)) return false;
    }
    return true;
}

// Fills slot `index` of [B, L, H, D] input `in`, written to `out` (or its rows); returns its end.
uint32_t set_slot(Plan& plan, int index, const TensorArg& in, const TensorArg& out, bool rotates, uint32_t start,
                  int64_t elems, const int64_t* out_rows = nullptr) {
    Slot& s = plan.p.slot[index];
    const int nd = in.ndim();  // 4: [B, L, H, D]; 3: [T, H, D] (B = 1)
    s.in = in.data<const void>();
    s.out = out.data<void>();
    s.in_stride_b = nd == 4 ? stride_or_zero(in, 0) : 0;
    s.in_stride_l = stride_or_zero(in, nd - 3);
    s.in_stride_h = stride_or_zero(in, nd - 2);
    if (out_rows != nullptr) {  // [rows, H, D]
        s.out_stride_b = 0;
        s.out_stride_l = out.stride(0);
        s.out_stride_h = out.stride(1);
        s.out_row_count = out.size(0);
    } else {
        s.out_stride_b = nd == 4 ? stride_or_zero(out, 0) : 0;
        s.out_stride_l = stride_or_zero(out, nd - 3);
        s.out_stride_h = stride_or_zero(out, nd - 2);
    }
    s.out_rows = out_rows;
    const bool in_place = out_rows == nullptr && in.ptr == out.ptr && in.strides == out.strides;
    const int64_t rotated = rotates ? 2 * plan.half : 0;
    s.rot_items = static_cast<uint32_t>((plan.interleaved || !rotates ? rotated : plan.half) / elems);
    const int64_t copied = in_place ? 0 : (plan.head_dim - rotated) / elems;
    const int64_t per_head = s.rot_items + copied;
    const int64_t tokens = in.numel() / (in.size(-2) * in.size(-1));
    const int64_t items = tokens * in.size(-2) * per_head;
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    ASTRAI_CHECK(int64_t{start} + items <= kMax, in.name, ": shape ", shape_str(in.shape),
                 " is too large (at most 2^31 - 1 accesses per call)");
    s.per_head = FastDivmod(static_cast<uint32_t>(per_head > 0 ? per_head : 1));
    s.per_token = FastDivmod(static_cast<uint32_t>(per_head > 0 ? in.size(-2) * per_head : 1));
    s.end = start + static_cast<uint32_t>(items);
    plan.tensors[plan.num_tensors++] = &in;
    plan.tensors[plan.num_tensors++] = &out;
    plan.p.num_slots = index + 1;
    return s.end;
}

void set_angles(Plan& plan, const TensorArg& cos, const TensorArg& sin, const TensorArg* positions, int64_t B) {
    RotaryParams& p = plan.p;
    plan.cos = &cos;
    plan.sin = &sin;
    p.cos = cos.data<const float>();
    p.sin = sin.data<const float>();
    p.cos_stride = cos.stride(0);
    p.sin_stride = sin.stride(0);
    p.max_pos = cos.size(0);
    p.half = static_cast<int32_t>(plan.half);
    if (positions != nullptr) {
        p.positions = positions->data<const void>();
        p.pos_int64 = positions->dtype == DType::Int64;
        p.pos_stride_l = positions->stride(-1);
        p.pos_stride_b = positions->ndim() == 2 && positions->size(0) > 1 ? positions->stride(0) : 0;
    }
}

template <typename T, bool kInterleaved, bool kVector, Fp8Out kFp8>
void launch_kernel(const RotaryParams& p, cudaStream_t stream) {
    constexpr uint32_t kPerBlock = RotaryParams::kThreads * kItemsPerThread<kFp8>;
    const uint32_t total = p.slot[p.num_slots - 1].end;
    rotary_kernel<T, kInterleaved, kVector, kFp8>
        <<<(total + kPerBlock - 1) / kPerBlock, RotaryParams::kThreads, 0, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
}

template <typename T, Fp8Out kFp8 = Fp8Out::None>
void launch_layout(const RotaryParams& p, bool interleaved, bool vector, cudaStream_t stream) {
    if (interleaved) {
        vector ? launch_kernel<T, true, true, kFp8>(p, stream) : launch_kernel<T, true, false, kFp8>(p, stream);
    } else {
        vector ? launch_kernel<T, false, true, kFp8>(p, stream) : launch_kernel<T, false, false, kFp8>(p, stream);
    }
}

void launch(const RotaryParams& p, DType dtype, bool interleaved, bool vector, cudaStream_t stream,
            Fp8Out fp8 = Fp8Out::None) {
    if (p.slot[p.num_slots - 1].end == 0) return;
    switch (dtype) {
        case DType::Float32: return launch_layout<float>(p, interleaved, vector, stream);
        case DType::Float16:
            if (fp8 == Fp8Out::E4M3) return launch_layout<__half, Fp8Out::E4M3>(p, interleaved, vector, stream);
            if (fp8 == Fp8Out::E5M2) return launch_layout<__half, Fp8Out::E5M2>(p, interleaved, vector, stream);
            return launch_layout<__half>(p, interleaved, vector, stream);
        default:
            if (fp8 == Fp8Out::E4M3) return launch_layout<__nv_bfloat16, Fp8Out::E4M3>(p, interleaved, vector, stream);
            if (fp8 == Fp8Out::E5M2) return launch_layout<__nv_bfloat16, Fp8Out::E5M2>(p, interleaved, vector, stream);
            return launch_layout<__nv_bfloat16>(p, interleaved, vector, stream);
    }
}

int64_t elems_of(const Plan& plan, bool vector) {
    return vector ? 16 / dtype_size(plan.dtype) : (plan.interleaved ? 2 : 1);
}

std::optional<TensorArg> optional_arg(const char* name, py::handle obj) {
    if (obj.is_none()) return std::nullopt;
    return bind::tensor_arg(name, obj);
}

void rotary_checked(const TensorArg& q, const TensorArg* k, const TensorArg& cos, const TensorArg& sin,
                    const TensorArg* positions, const TensorArg& q_out, const TensorArg* k_out, bool interleaved,
                    bool inverse, cudaStream_t stream) {
    expect_rotated(q, 4);
    const int64_t B = q.size(0), L = q.size(1), D = q.size(3);
    expect_like(q_out, q);
    ASTRAI_CHECK((k != nullptr) == (k_out != nullptr), "k_out: must be given exactly when k is");
    if (k != nullptr) {
        expect_rotated(*k, 4);
        ASTRAI_CHECK(k->dtype == q.dtype && k->size(0) == B && k->size(1) == L && k->size(3) == D,
                     k->name, ": expected ", dtype_name(q.dtype), " [", B, ", ", L, ", kv_heads, ", D, "] like ",
                     q.name, ", got ", dtype_name(k->dtype), " ", shape_str(k->shape));
        expect_like(*k_out, *k);
    }
    Plan plan;
    plan.dtype = q.dtype;
    plan.interleaved = interleaved;
    plan.head_dim = D;
    plan.half = expect_tables(cos, sin, D);
    if (positions != nullptr) {
        expect_positions(*positions, B, L);
    } else {
        ASTRAI_CHECK(cos.size(0) >= L, cos.name, ": ", cos.size(0), " rows, but positions 0 .. ", L - 1,
                     " are rotated");
    }
    plan.p.sign = inverse ? -1.f : 1.f;
    plan.p.seq_len = FastDivmod(static_cast<uint32_t>(L > 0 ? L : 1));
    set_angles(plan, cos, sin, positions, B);
    // the vector check needs every tensor; the item counts need the access width
    for (int pass = 0; pass < 2; ++pass) {
        const bool vector = pass == 0;
        plan.num_tensors = 0;
        const int64_t elems = elems_of(plan, vector);
        const uint32_t end = set_slot(plan, 0, q, q_out, true, 0, elems);
        if (k != nullptr) set_slot(plan, 1, *k, *k_out, true, end, elems);
        if (!vector || fits_vector(plan)) return launch(plan.p, plan.dtype, interleaved, vector, stream);
    }
}

void rotary(py::handle q_arg, py::handle k_arg, py::handle cos_arg, py::handle sin_arg, py::handle positions_arg,
            py::handle q_out_arg, py::handle k_out_arg, bool interleaved, bool inverse, py::handle stream_arg) {
    const TensorArg q = bind::tensor_arg("q", q_arg);
    const std::optional<TensorArg> k = optional_arg("k", k_arg);
    const TensorArg cos = bind::tensor_arg("cos", cos_arg);
    const TensorArg sin = bind::tensor_arg("sin", sin_arg);
    const std::optional<TensorArg> positions = optional_arg("positions", positions_arg);
    const TensorArg q_out = bind::tensor_arg("q_out", q_out_arg);
    const std::optional<TensorArg> k_out = optional_arg("k_out", k_out_arg);
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    rotary_checked(q, k ? &*k : nullptr, cos, sin, positions ? &*positions : nullptr, q_out, k_out ? &*k_out : nullptr,
                   interleaved, inverse, stream);
}

void rope_paged_append(py::handle q_arg, py::handle k_arg, py::handle v_arg, py::handle k_cache_arg,
                       py::handle v_cache_arg, py::handle cos_arg, py::handle sin_arg, py::handle positions_arg,
                       py::handle slots_arg, py::handle q_out_arg, bool interleaved, py::handle stream_arg,
                       py::handle kv_scales_arg_) {
    const auto [q, k, v, k_cache, v_cache, cos, sin, positions, slots, q_out] = bind::tensor_args(
        {"q", "k", "v", "k_cache", "v_cache", "cos", "sin", "positions", "slots", "q_out"},
        {q_arg, k_arg, v_arg, k_cache_arg, v_cache_arg, cos_arg, sin_arg, positions_arg, slots_arg, q_out_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);

    expect_rotated(q, 3);
    const int64_t T = q.size(0), D = q.size(2);
    expect_like(q_out, q);
    expect_rotated(k, 3);
    ASTRAI_CHECK(k.dtype == q.dtype && k.size(0) == T && k.size(2) == D, "k: expected ", dtype_name(q.dtype), " [", T,
                 ", kv_heads, ", D, "] like q, got ", dtype_name(k.dtype), " ", shape_str(k.shape));
    expect_like(v, k);
    const DType page_dtype = is_fp8_kv_dtype(k_cache.dtype) ? k_cache.dtype : k.dtype;
    ASTRAI_CHECK(!is_fp8_kv_dtype(page_dtype) || is_fp8_kv_source_dtype(k.dtype),
                 "k_cache: an fp8 cache quantizes " ASTRAI_ROTARY_FP8_KV_SOURCE_DTYPES_TEXT " keys/values, got ",
                 dtype_name(k.dtype));
    for (const TensorArg* c : {&k_cache, &v_cache}) {
        expect_ndim(*c, 4);
        ASTRAI_CHECK(c->dtype == page_dtype && c->size(2) == k.size(1) && c->size(3) == D, c->name, ": expected ",
                     dtype_name(page_dtype), " [num_pages, page_size, ", k.size(1), ", ", D, "], got ",
                     dtype_name(c->dtype), " ", shape_str(c->shape));
        ASTRAI_CHECK(c->size(0) <= 1 || c->stride(0) == c->size(1) * c->stride(1), c->name,
                     ": pages must follow each other (stride(0) = page_size * stride(1)), got strides ",
                     shape_str(c->strides));
        expect_last_dim_contiguous(*c);
        expect_data(*c, dtype_size(c->dtype));
    }
    expect_positions(positions, 0, T);
    expect_positions(slots, 0, T);
    expect_dtype(slots, DType::Int64);
    const auto scales = kv_scales_arg(kv_scales_arg_, page_dtype, k.size(1));
    const Fp8Out fp8 = !scales ? Fp8Out::None : page_dtype == DType::Float8E4M3 ? Fp8Out::E4M3 : Fp8Out::E5M2;

    Plan plan;
    plan.dtype = q.dtype;
    plan.interleaved = interleaved;
    plan.head_dim = D;
    plan.half = expect_tables(cos, sin, D);
    plan.p.seq_len = FastDivmod(static_cast<uint32_t>(T > 0 ? T : 1));
    set_angles(plan, cos, sin, &positions, 1);
    // the caches viewed as [rows, H, D]
    TensorArg k_rows = k_cache, v_rows = v_cache;
    for (TensorArg* r : {&k_rows, &v_rows}) {
        r->shape = {r->size(0) * r->size(1), r->size(2), r->size(3)};
        r->strides = {r->strides[1], r->strides[2], r->strides[3]};
    }
    const int64_t* rows = slots.data<const int64_t>();
    for (int pass = 0; pass < 2; ++pass) {
        const bool vector = pass == 0;
        plan.num_tensors = 0;
        const int64_t elems = elems_of(plan, vector);
        uint32_t end = set_slot(plan, 0, q, q_out, true, 0, elems);
        end = set_slot(plan, 1, k, k_rows, true, end, elems, rows);
        set_slot(plan, 2, v, v_rows, false, end, elems, rows);
        if (scales) {
            plan.p.slot[1].scale = scales->k;
            plan.p.slot[2].scale = scales->v;
            plan.p.slot[1].scale_stride_h = plan.p.slot[2].scale_stride_h = scales->stride;
        }
        if (!vector || fits_vector(plan)) return launch(plan.p, plan.dtype, interleaved, vector, stream, fp8);
    }
}

void rotary_emb(py::handle x_arg, py::handle cos_arg, py::handle sin_arg, py::handle out_arg, py::handle stream_arg) {
    const auto [x, cos, sin, out] = bind::tensor_args({"x", "cos", "sin", "out"}, {x_arg, cos_arg, sin_arg, out_arg});
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    expect_rotated(x, 4);
    for (const TensorArg* t : {&cos, &sin}) {  // the original call: rows 0 .. L-1 of every pair
        expect_dtype(*t, DType::Float32);
        ASTRAI_CHECK(t->ndim() == 2 && t->size(0) == x.size(1) && 2 * t->size(1) == x.size(3), t->name,
                     ": expected shape [seq_len, head_dim/2] = [", x.size(1), ", ", x.size(3) / 2, "] for x of shape ",
                     shape_str(x.shape), ", got ", shape_str(t->shape));
    }
    rotary_checked(x, nullptr, cos, sin, nullptr, out, nullptr, true, false, stream);
}

}  // namespace astrai::rotary

PYBIND11_MODULE(_rotary_emb, m) {
    namespace py = pybind11;
    astrai::bind::init_module(m);
    m.doc() = "AstrAI rotary embedding, RMSNorm and SiLU-and-mul (ABI 1): torch-free, pointers + shapes + strides.";
    m.def("rotary", &astrai::rotary::rotary, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"),
          py::arg("positions"), py::arg("q_out"), py::arg("k_out"), py::arg("interleaved"), py::arg("inverse"),
          py::arg("stream"),
          "Rotate q [B, L, Hq, D] (and k [B, L, Hk, D], or None) by rows of cos/sin [max_pos, rotary_dim/2]\n"
          "(f32) at positions (None, int32/int64 [L] or [B, L]) into q_out / k_out (the inputs: in place).\n"
          "interleaved: GPT-J pairs, else NeoX; inverse: rotate backwards. Each tensor is a tuple\n"
          "(data_ptr, shape, strides_in_elements, dtype_code); stream is the cudaStream_t as an int.\n"
          "ValueError on bad arguments before any CUDA call, RuntimeError when CUDA fails.");
    m.def("rope_paged_append", &astrai::rotary::rope_paged_append, py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("k_cache"), py::arg("v_cache"), py::arg("cos"), py::arg("sin"), py::arg("positions"),
          py::arg("slots"), py::arg("q_out"), py::arg("interleaved"), py::arg("stream"),
          py::arg("kv_scales") = py::none(),
          "One launch: q [T, Hq, D] rotated into q_out; k [T, Hk, D] rotated and v [T, Hk, D] written to row\n"
          "slots[t] (int64) of k_cache / v_cache [num_pages, page_size, Hk, D]; positions [T] select the\n"
          "rows of cos/sin. fp8 pages take kv_scales = (k_scale, v_scale) and store x / scale as fp8.");
    // page dtypes written besides the keys' (with kv_scales)
    m.attr("KV_DTYPES") = py::make_tuple(ASTRAI_ROTARY_FP8_KV_DTYPE_NAMES);
    m.def("rotary_emb", &astrai::rotary::rotary_emb, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"),
          py::arg("stream"), "The original call: interleaved pairs of x [B, L, H, D], cos/sin [L, D/2], into out.");
    astrai::norm::bind(m);
}
