// Fused rotary embedding: out[..., 2i:2i+2] = rotate(x[..., 2i:2i+2], cos[l, i], sin[l, i]).
//
//   x, out  [B, L, H, D] bf16, any strides with a contiguous last dim (in-place allowed)
//   cos/sin [L, D/2] f32, contiguous last dim
//   out[2i]   = x[2i] * cos - x[2i+1] * sin
//   out[2i+1] = x[2i] * sin + x[2i+1] * cos        (interleaved pairs: a complex multiply)
//
// One thread per (head, dim pair): each pair is one __nv_bfloat162 load and store; the
// rotation is done in f32 registers and rounded to bf16 once. Work is cut into units of
// (token, chunk of kThreads * kItems pairs of that token); 256-thread blocks walk the
// units grid-stride, each thread issuing its kItems loads before using any, so enough
// bytes are in flight to reach HBM bandwidth. A unit's cos/sin row is shared by all its
// heads and stays in L1. Compiled module: astrai_rotary._rotary_emb (ABI 1).
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

// Everything one launch needs; strides of x/out in __nv_bfloat162 units (elements / 2).
struct RotaryParams {
    static constexpr int kThreads = 256;

    const __nv_bfloat162* x;
    __nv_bfloat162* out;
    const float* cos;
    const float* sin;
    int64_t x_stride_b, x_stride_l, x_stride_h;
    int64_t out_stride_b, out_stride_l, out_stride_h;
    int64_t cos_stride_l, sin_stride_l;
    uint32_t pairs_per_token;  // H * D/2
    uint32_t units;            // B * L * chunks_per_token
    FastDivmod chunks_per_token;
    FastDivmod seq_len;        // L
    FastDivmod pairs_per_head; // D/2
};

template <int kItems>
__global__ void __launch_bounds__(RotaryParams::kThreads)
rotary_emb_kernel(const RotaryParams p) {
    constexpr int kThreads = RotaryParams::kThreads;
    for (uint32_t unit = blockIdx.x; unit < p.units; unit += gridDim.x) {
        uint32_t token, chunk, b, l;
        p.chunks_per_token.divmod(unit, token, chunk);
        p.seq_len.divmod(token, b, l);
        const __nv_bfloat162* x = p.x + b * p.x_stride_b + l * p.x_stride_l;
        __nv_bfloat162* out = p.out + b * p.out_stride_b + l * p.out_stride_l;
        const float* cos_row = p.cos + l * p.cos_stride_l;
        const float* sin_row = p.sin + l * p.sin_stride_l;
        const uint32_t first = chunk * (kThreads * kItems) + threadIdx.x;

        __nv_bfloat162 v[kItems];
        float c[kItems], s[kItems];
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
            const uint32_t q = first + k * kThreads;
            if (q < p.pairs_per_token) {
                uint32_t h, i;
                p.pairs_per_head.divmod(q, h, i);
                v[k] = __ldcs(x + h * p.x_stride_h + i);
                c[k] = __ldg(cos_row + i);
                s[k] = __ldg(sin_row + i);
            }
        }
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
            const uint32_t q = first + k * kThreads;
            if (q < p.pairs_per_token) {
                uint32_t h, i;
                p.pairs_per_head.divmod(q, h, i);
                const float2 f = __bfloat1622float2(v[k]);
                const float re = f.x * c[k] - f.y * s[k];
                const float im = f.x * s[k] + f.y * c[k];
                __stcs(out + h * p.out_stride_h + i, __floats2bfloat162_rn(re, im));
            }
        }
    }
}

// Host side ---------------------------------------------------------------------------

// Stride of `dim` in bf16 pairs; a size-1 dim's stride is irrelevant (torch may report any).
int64_t pair_stride(const TensorArg& t, int dim) {
    if (t.size(dim) == 1) return 0;
    ASTRAI_CHECK(t.stride(dim) % 2 == 0, t.name, ": strides must be even (bf16 pairs are loaded as ",
                 "4-byte words), got ", shape_str(t.strides));
    return t.stride(dim) / 2;
}

// Checks every argument (no CUDA call before this returns) and packs the launch params.
// Returns false when there is nothing to do (an empty tensor).
bool make_params(const TensorArg& x, const TensorArg& cos, const TensorArg& sin,
                 const TensorArg& out, RotaryParams& p, int& items) {
    expect_ndim(x, 4);
    expect_dtype(x, DType::BFloat16);
    const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3);
    ASTRAI_CHECK(D > 0 && D % 2 == 0, "x: head_dim (last dim) must be even and positive, got ", D);
    const int64_t P = D / 2;
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
        ASTRAI_CHECK(t->size(0) == L && t->size(1) == P, t->name, ": expected shape [seq_len, head_dim/2] = [",
                     L, ", ", P, "] for x of shape ", shape_str(x.shape), ", got ",
                     shape_str(t->shape));
        expect_last_dim_contiguous(*t);
        expect_data(*t, 4);
    }

    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    ASTRAI_CHECK(B * L <= kMax && H * P <= kMax, "x: shape ", shape_str(x.shape),
                 " is too large (B*L and H*D/2 must each be < 2^31)");
    if (x.numel() == 0) return false;

    const int64_t pairs = H * P;
    items = pairs >= 4 * RotaryParams::kThreads ? 4 : pairs >= 2 * RotaryParams::kThreads ? 2 : 1;
    const int64_t chunk = int64_t{RotaryParams::kThreads} * items;
    const int64_t chunks = (pairs + chunk - 1) / chunk;
    ASTRAI_CHECK(B * L * chunks <= kMax, "x: shape ", shape_str(x.shape), " is too large");

    p.x = x.data<const __nv_bfloat162>();
    p.out = out.data<__nv_bfloat162>();
    p.cos = cos.data<const float>();
    p.sin = sin.data<const float>();
    p.x_stride_b = pair_stride(x, 0);
    p.x_stride_l = pair_stride(x, 1);
    p.x_stride_h = pair_stride(x, 2);
    p.out_stride_b = pair_stride(out, 0);
    p.out_stride_l = pair_stride(out, 1);
    p.out_stride_h = pair_stride(out, 2);
    p.cos_stride_l = cos.stride(0);
    p.sin_stride_l = sin.stride(0);
    p.pairs_per_token = static_cast<uint32_t>(pairs);
    p.units = static_cast<uint32_t>(B * L * chunks);
    p.chunks_per_token = FastDivmod(static_cast<uint32_t>(chunks));
    p.seq_len = FastDivmod(static_cast<uint32_t>(L));
    p.pairs_per_head = FastDivmod(static_cast<uint32_t>(P));
    return true;
}

template <int kItems>
void launch(const RotaryParams& p, cudaStream_t stream) {
    const auto kernel = rotary_emb_kernel<kItems>;
    const int device = current_device();
    int per_sm = 0;
    ASTRAI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                    RotaryParams::kThreads, 0));
    const int64_t resident = int64_t{multiprocessor_count(device)} * (per_sm > 0 ? per_sm : 1);
    const auto blocks = static_cast<unsigned>(p.units < resident ? p.units : resident);
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
    RotaryParams p{};
    int items = 1;
    if (!make_params(x, cos, sin, out, p, items)) return;
    switch (items) {
        case 4: launch<4>(p, stream); break;
        case 2: launch<2>(p, stream); break;
        default: launch<1>(p, stream); break;
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
