// Fused rotary embedding: out[..., 2i:2i+2] = rotate(x[..., 2i:2i+2], cos[l, i], sin[l, i]).
//
//   x, out  [B, L, H, D] bf16, any strides with a contiguous last dim (in-place allowed)
//   cos/sin [L, D/2] f32, contiguous last dim
//   out[2i]   = x[2i] * cos - x[2i+1] * sin
//   out[2i+1] = x[2i] * sin + x[2i+1] * cos        (interleaved pairs: a complex multiply)
//
// One thread per (head, dim pair) group: each pair is an __nv_bfloat162, rotated in f32
// registers and rounded to bf16 once. The fast path gives a thread 4 consecutive pairs
// of one head (one 16-byte load of x, one float4 each of cos and sin, one 16-byte
// store); the general path (head_dim % 8 != 0, or views not 16-byte aligned) one pair
// (4-byte accesses). 256-thread blocks walk the flattened (token, head, pair group)
// space grid-stride, each thread issuing all its loads of an iteration before using
// any, so enough bytes are in flight to reach HBM bandwidth; index math is
// multiply-high division (FastDivmod). Compiled module: astrai_rotary._rotary_emb (ABI 1).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>

#include "astrai/bind.h"
#include "astrai/check.h"
#include "astrai/device.cuh"
#include "astrai/fast_divmod.cuh"
#include "astrai/tensor_arg.h"

namespace astrai::rotary {

// Everything one launch needs. Strides of x/out count vectors of kVec pairs (kVec*2
// bf16), those of cos/sin vectors of kVec floats.
struct RotaryParams {
    static constexpr int kThreads = 256;

    const void* x;
    void* out;
    const void* cos;
    const void* sin;
    int64_t x_stride_b, x_stride_l, x_stride_h;
    int64_t out_stride_b, out_stride_l, out_stride_h;
    int64_t cos_stride_l, sin_stride_l;
    uint32_t total;             // B * L * H * (D/2) / kVec vectors
    FastDivmod per_token;       // H * (D/2) / kVec
    FastDivmod seq_len;         // L
    FastDivmod per_head;        // (D/2) / kVec
};

// kVec pairs as one memory access: bf16 data and the matching cos/sin floats.
template <int kVec>
struct PairVec;
template <>
struct PairVec<1> {
    using Data = __nv_bfloat162;
    using Angle = float;
};
template <>
struct PairVec<4> {
    using Data = uint4;    // 8 bf16 = 4 pairs
    using Angle = float4;  // 4 cos (or sin) values
};

__device__ __forceinline__ __nv_bfloat162 rotate(__nv_bfloat162 v, float c, float s) {
    const float2 f = __bfloat1622float2(v);
    return __floats2bfloat162_rn(f.x * c - f.y * s, f.x * s + f.y * c);
}

__device__ __forceinline__ __nv_bfloat162 rotate_vec(__nv_bfloat162 v, float c, float s) {
    return rotate(v, c, s);
}

__device__ __forceinline__ uint4 rotate_vec(uint4 v, float4 c, float4 s) {
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
    pairs[0] = rotate(pairs[0], c.x, s.x);
    pairs[1] = rotate(pairs[1], c.y, s.y);
    pairs[2] = rotate(pairs[2], c.z, s.z);
    pairs[3] = rotate(pairs[3], c.w, s.w);
    return v;
}

template <int kVec, int kItems>
__global__ void __launch_bounds__(RotaryParams::kThreads)
rotary_emb_kernel(const RotaryParams p) {
    using Data = typename PairVec<kVec>::Data;
    using Angle = typename PairVec<kVec>::Angle;
    constexpr uint32_t kThreads = RotaryParams::kThreads;
    const Data* x = static_cast<const Data*>(p.x);
    Data* out = static_cast<Data*>(p.out);
    const Angle* cos = static_cast<const Angle*>(p.cos);
    const Angle* sin = static_cast<const Angle*>(p.sin);

    for (uint32_t base = blockIdx.x * (kThreads * kItems) + threadIdx.x; base < p.total;
         base += gridDim.x * (kThreads * kItems)) {
        Data v[kItems];
        Angle c[kItems], s[kItems];
        int64_t dst[kItems];
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
            // past the end: read the last vector again (no branch), store nothing
            const uint32_t g = min(base + k * kThreads, p.total - 1);
            uint32_t token, in_token, b, l, h, i;
            p.per_token.divmod(g, token, in_token);
            p.seq_len.divmod(token, b, l);
            p.per_head.divmod(in_token, h, i);
            v[k] = __ldcs(x + (b * p.x_stride_b + l * p.x_stride_l + h * p.x_stride_h + i));
            c[k] = __ldg(cos + (l * p.cos_stride_l + i));
            s[k] = __ldg(sin + (l * p.sin_stride_l + i));
            dst[k] = b * p.out_stride_b + l * p.out_stride_l + h * p.out_stride_h + i;
        }
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
            if (base + k * kThreads < p.total) __stcs(out + dst[k], rotate_vec(v[k], c[k], s[k]));
        }
    }
}

// Host side ---------------------------------------------------------------------------

// Checks every argument; no CUDA call happens before this returns.
void validate(const TensorArg& x, const TensorArg& cos, const TensorArg& sin, const TensorArg& out) {
    expect_ndim(x, 4);
    expect_dtype(x, DType::BFloat16);
    const int64_t L = x.size(1), D = x.size(3);
    ASTRAI_CHECK(D > 0 && D % 2 == 0, "x: head_dim (last dim) must be even and positive, got ", D);
    expect_last_dim_contiguous(x);
    expect_data(x, 4);

    expect_ndim(out, 4);
    expect_dtype(out, DType::BFloat16);
    ASTRAI_CHECK(out.shape == x.shape, "out: shape ", shape_str(out.shape),
                 " must equal x's shape ", shape_str(x.shape));
    expect_last_dim_contiguous(out);
    expect_data(out, 4);

    for (const TensorArg* t : {&cos, &sin}) {
        expect_ndim(*t, 2);
        expect_dtype(*t, DType::Float32);
        ASTRAI_CHECK(t->size(0) == L && t->size(1) == D / 2, t->name,
                     ": expected shape [seq_len, head_dim/2] = [", L, ", ", D / 2, "] for x of shape ",
                     shape_str(x.shape), ", got ", shape_str(t->shape));
        expect_last_dim_contiguous(*t);
        expect_data(*t, 4);
    }
    for (const TensorArg* t : {&x, &out}) {
        for (int dim = 0; dim < 3; ++dim) {
            ASTRAI_CHECK(t->size(dim) == 1 || t->stride(dim) % 2 == 0, t->name,
                         ": strides must be even (bf16 pairs are loaded as 4-byte words), got ",
                         shape_str(t->strides));
        }
    }
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    ASTRAI_CHECK(x.numel() / 2 <= kMax, "x: shape ", shape_str(x.shape),
                 " is too large (at most 2^31 - 1 pairs per call)");
}

// Stride of `dim` in units of `unit` elements; a size-1 dim's stride is irrelevant.
int64_t stride_in(const TensorArg& t, int dim, int64_t unit) {
    return t.size(dim) == 1 ? 0 : t.stride(dim) / unit;
}

// Whether every access of a kVec-pair vector is aligned (pointers, strides, head_dim).
bool fits_vec(const TensorArg& x, const TensorArg& cos, const TensorArg& sin, const TensorArg& out,
              int vec) {
    const int64_t bytes = 4 * vec;
    if ((x.size(3) / 2) % vec != 0) return false;
    for (const TensorArg* t : {&x, &out, &cos, &sin}) {
        if (t->ptr % static_cast<std::uintptr_t>(bytes) != 0) return false;
        const int64_t unit = t->dtype == DType::BFloat16 ? 2 * vec : vec;  // elements per access
        for (int dim = 0; dim < t->ndim() - 1; ++dim) {
            if (t->size(dim) != 1 && t->stride(dim) % unit != 0) return false;
        }
    }
    return true;
}

RotaryParams make_params(const TensorArg& x, const TensorArg& cos, const TensorArg& sin,
                         const TensorArg& out, int vec) {
    const int64_t L = x.size(1), H = x.size(2), P = x.size(3) / 2;
    const int64_t x_unit = 2 * vec;
    RotaryParams p{};
    p.x = x.data<const void>();
    p.out = out.data<void>();
    p.cos = cos.data<const void>();
    p.sin = sin.data<const void>();
    p.x_stride_b = stride_in(x, 0, x_unit);
    p.x_stride_l = stride_in(x, 1, x_unit);
    p.x_stride_h = stride_in(x, 2, x_unit);
    p.out_stride_b = stride_in(out, 0, x_unit);
    p.out_stride_l = stride_in(out, 1, x_unit);
    p.out_stride_h = stride_in(out, 2, x_unit);
    p.cos_stride_l = stride_in(cos, 0, vec);
    p.sin_stride_l = stride_in(sin, 0, vec);
    p.total = static_cast<uint32_t>(x.numel() / x_unit);
    p.per_token = FastDivmod(static_cast<uint32_t>(H * P / vec));
    p.seq_len = FastDivmod(static_cast<uint32_t>(L));
    p.per_head = FastDivmod(static_cast<uint32_t>(P / vec));
    return p;
}

template <int kVec, int kItems>
void launch(const RotaryParams& p, cudaStream_t stream) {
    const auto kernel = rotary_emb_kernel<kVec, kItems>;
    const int device = current_device();
    int per_sm = 0;
    ASTRAI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                    RotaryParams::kThreads, 0));
    const int64_t chunk = int64_t{RotaryParams::kThreads} * kItems;
    const int64_t needed = (int64_t{p.total} + chunk - 1) / chunk;
    const int64_t resident = int64_t{multiprocessor_count(device)} * (per_sm > 0 ? per_sm : 1);
    const auto blocks = static_cast<unsigned>(needed < resident ? needed : resident);
    kernel<<<blocks, RotaryParams::kThreads, 0, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
}

void rotary_emb(pybind11::handle x_arg, pybind11::handle cos_arg, pybind11::handle sin_arg,
                pybind11::handle out_arg, pybind11::handle stream_arg) {
    const TensorArg x = bind::tensor_arg("x", x_arg);
    const TensorArg cos = bind::tensor_arg("cos", cos_arg);
    const TensorArg sin = bind::tensor_arg("sin", sin_arg);
    const TensorArg out = bind::tensor_arg("out", out_arg);
    const cudaStream_t stream = bind::stream_arg(stream_arg);
    validate(x, cos, sin, out);
    if (x.numel() == 0) return;
    if (fits_vec(x, cos, sin, out, 4)) {
        launch<4, 2>(make_params(x, cos, sin, out, 4), stream);
    } else {
        launch<1, 4>(make_params(x, cos, sin, out, 1), stream);
    }
}

}  // namespace astrai::rotary

PYBIND11_MODULE(_rotary_emb, m) {
    astrai::bind::init_module(m);
    m.doc() = "AstrAI fused rotary embedding (ABI 1): torch-free, pointers + shapes + strides.";
    m.def("rotary_emb", &astrai::rotary::rotary_emb, pybind11::arg("x"), pybind11::arg("cos"),
          pybind11::arg("sin"), pybind11::arg("out"), pybind11::arg("stream"),
          "Rotate interleaved pairs of x [B, L, H, D] (bf16) by cos/sin [L, D/2] (f32) into out.\n"
          "Each tensor is a tuple (data_ptr, shape, strides_in_elements, dtype_code); stream is\n"
          "the cudaStream_t as an int. Raises ValueError on bad arguments before any CUDA call,\n"
          "RuntimeError when CUDA fails.");
}
