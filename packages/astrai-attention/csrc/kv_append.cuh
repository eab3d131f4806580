// The paged KV append: one step's new keys and values written into their cache rows, k and v
// in one launch (what two index_copy_ calls did). No torch.
//
//   k_new, v_new [T, Hkv, D] or [B, L, Hkv, D] (token t = b * L + l), any strides with a
//   contiguous last dim; k_cache, v_cache [num_pages, page_size, Hkv, D], pages following
//   each other, viewed as rows [num_pages * page_size, Hkv, D]; slots int64 [T]: token t goes
//   to row slots[t]. A slot outside the rows is skipped (the plan's slots never are).
//
// A decode step's append needs no slots: with the page table instead (check_kv_append_last),
// request b's one new token k_new[b] goes to its last position kv_lens[b] - 1, the row
// kv_indices[kv_indptr[b] + (L - 1) / page_size] * page_size + (L - 1) % page_size
// (nothing for L = 0). The paged decode kernel can do this append itself
// (decode_split_kv_mma.cuh); this kernel serves the cases it can't.
//
// An fp8 cache (float8_e4m3fn / float8_e5m2 pages for 16-bit k_new / v_new) takes the layer's
// K and V dequantization scales (KvScales) and stores round_to_fp8(x / scale), rounded to
// nearest even and saturated to the format's largest finite value (NaN stays NaN): the bytes
// PagedKVCache.append's torch path writes.
//
// check_kv_append / check_kv_append_last validate everything on the host (ValueError naming
// the argument) and fill the params; launch_kv_append then only launches. Copies move 16
// bytes per thread when every pointer, stride and row allows it, else one element; fp8 writes
// eight values per thread where the rows allow it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "astrai/check.h"
#include "astrai/dtype.h"
#include "astrai/kv_scales.h"
#include "astrai/tensor_arg.h"
#include "mma_utils.cuh"  // Elem<T>

namespace astrai::attn {

struct KvAppendParams {
    const char* src[2] = {};  // k_new, v_new
    char* dst[2] = {};        // k_cache, v_cache rows
    int64_t src_stride_b[2] = {}, src_stride_l[2] = {}, src_stride_h[2] = {};  // bytes
    int64_t dst_stride_row[2] = {}, dst_stride_h[2] = {};                      // bytes
    const int64_t* slots = nullptr;  // null: the page table's last positions (below)
    const int32_t* kv_indptr = nullptr;
    const int32_t* kv_indices = nullptr;
    const int32_t* kv_lens = nullptr;
    int64_t page_size = 1;
    int64_t rows = 0;     // num_pages * page_size
    int64_t tokens = 0;   // T
    int64_t seq_len = 1;  // L of a [B, L, H, D] input (T for [T, H, D])
    int64_t heads = 0;
    int64_t units = 0;    // copy units per head row (fp8: groups of quant_vec values)
    // fp8 caches: the dequantization scales (K, V) indexed by head * scale_stride
    DType src_dtype = DType::BFloat16, cache_dtype = DType::BFloat16;
    const float* scale[2] = {};
    int scale_stride = 0;
    int quant_vec = 1;  // values per fp8 write unit: 8 or 1
};

// The cache row of token t: slots[t], or the last position of request t (-1: none).
__device__ __forceinline__ int64_t kv_append_row(const KvAppendParams& p, int64_t t) {
    if (p.slots != nullptr) return p.slots[t];
    const int64_t pos = int64_t(p.kv_lens[t]) - 1;
    if (pos < 0) return -1;
    return int64_t(p.kv_indices[p.kv_indptr[t] + pos / p.page_size]) * p.page_size + pos % p.page_size;
}

// Work item i of an append launch (2 * tokens * heads * units of them: K's, then V's): the
// head row it reads and the cache row it writes (null: a skipped slot), and its unit u.
struct KvAppendItem {
    const char* src;
    char* dst;
    int64_t u, h;
    int which;  // 0: K, 1: V
};

__device__ __forceinline__ KvAppendItem kv_append_item(const KvAppendParams& p, int64_t i, int64_t per_tensor) {
    KvAppendItem it;
    it.which = i >= per_tensor;
    const int64_t j = i - it.which * per_tensor;
    it.u = j % p.units;
    it.h = (j / p.units) % p.heads;
    const int64_t t = j / (p.units * p.heads);
    const int64_t row = kv_append_row(p, t);
    const int64_t b = t / p.seq_len, l = t - b * p.seq_len;
    it.src = p.src[it.which] + b * p.src_stride_b[it.which] + l * p.src_stride_l[it.which] +
             it.h * p.src_stride_h[it.which];
    it.dst = row < 0 || row >= p.rows ? nullptr
                                      : p.dst[it.which] + row * p.dst_stride_row[it.which] + it.h * p.dst_stride_h[it.which];
    return it;
}

// 16-bit T into fp8 format kFmt, kVec values per item: x / scale in float32 (IEEE division),
// rounded to nearest even and saturated.
template <typename T, int kVec, __nv_fp8_interpretation_t kFmt>
__global__ void kv_append_fp8_kernel(KvAppendParams p) {
    const int64_t per_tensor = p.tokens * p.heads * p.units;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < 2 * per_tensor;
         i += int64_t(gridDim.x) * blockDim.x) {
        const KvAppendItem it = kv_append_item(p, i, per_tensor);
        if (it.dst == nullptr) continue;
        const T* src = reinterpret_cast<const T*>(it.src) + it.u * kVec;
        uint8_t* dst = reinterpret_cast<uint8_t*>(it.dst) + it.u * kVec;
        const float scale = p.scale[it.which][it.h * p.scale_stride];
        if constexpr (kVec == 1) {
            *dst = __nv_cvt_float_to_fp8(__fdiv_rn(Elem<T>::to_float(*src), scale), __NV_SATFINITE, kFmt);
        } else {
            T x[kVec];
            *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(src);
            uint16_t y[kVec / 2];
#pragma unroll
            for (int k = 0; k < kVec / 2; ++k)
                y[k] = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(Elem<T>::to_float(x[2 * k]), scale),
                                                            __fdiv_rn(Elem<T>::to_float(x[2 * k + 1]), scale)),
                                                __NV_SATFINITE, kFmt);
            *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(y);
        }
    }
}

template <typename Unit>
__global__ void kv_append_kernel(KvAppendParams p) {
    const int64_t per_tensor = p.tokens * p.heads * p.units;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < 2 * per_tensor;
         i += int64_t(gridDim.x) * blockDim.x) {
        const KvAppendItem it = kv_append_item(p, i, per_tensor);
        if (it.dst != nullptr) reinterpret_cast<Unit*>(it.dst)[it.u] = reinterpret_cast<const Unit*>(it.src)[it.u];
    }
}

// Checks k_new / v_new against each other and the caches, and fills what both append
// modes share: pointers, head strides, rows, heads and copy units (`unit`: the copy width
// in bytes, 16 or the element size); the callers set the token strides and the rows' source.
// An fp8 cache takes `scales` (null: the caches must be of k_new's dtype).
inline KvAppendParams check_kv_rows(const TensorArg& k_new, const TensorArg& v_new, const TensorArg& k_cache,
                                    const TensorArg& v_cache, int* unit, const KvScales* scales = nullptr) {
    ASTRAI_CHECK(v_new.shape == k_new.shape && v_new.dtype == k_new.dtype, v_new.name, ": expected ",
                 dtype_name(k_new.dtype), " ", shape_str(k_new.shape), " like ", k_new.name, ", got ",
                 dtype_name(v_new.dtype), " ", shape_str(v_new.shape));
    const int64_t heads = k_new.size(-2), dim = k_new.size(-1);
    const bool quant = is_fp8(k_cache.dtype);
    if (quant) {
        ASTRAI_CHECK(k_new.dtype == DType::BFloat16 || k_new.dtype == DType::Float16, k_new.name,
                     ": an fp8 cache quantizes bfloat16 or float16 keys/values, got ", dtype_name(k_new.dtype));
        ASTRAI_CHECK(scales != nullptr, "kv_scales: a ", dtype_name(k_cache.dtype),
                     " cache needs the layer's (k_scale, v_scale)");
    } else {
        ASTRAI_CHECK(scales == nullptr, "kv_scales: only an fp8 cache takes scales, this one stores ",
                     dtype_name(k_cache.dtype));
    }
    const DType cache_dtype = quant ? k_cache.dtype : k_new.dtype;
    for (const TensorArg* c : {&k_cache, &v_cache}) {
        expect_ndim(*c, 4);
        ASTRAI_CHECK(c->dtype == cache_dtype && c->size(2) == heads && c->size(3) == dim, c->name, ": expected ",
                     dtype_name(cache_dtype), " [num_pages, page_size, ", heads, ", ", dim, "] for ", k_new.name,
                     " ", shape_str(k_new.shape), ", got ", dtype_name(c->dtype), " ", shape_str(c->shape));
        ASTRAI_CHECK(c->size(0) <= 1 || c->stride(0) == c->size(1) * c->stride(1), c->name,
                     ": pages must follow each other (stride(0) = page_size * stride(1)), got strides ",
                     shape_str(c->strides));
    }
    ASTRAI_CHECK(v_cache.shape == k_cache.shape, v_cache.name, ": shape ", shape_str(v_cache.shape),
                 " differs from ", k_cache.name, "'s ", shape_str(k_cache.shape));

    const int64_t esize = dtype_size(k_new.dtype), cache_esize = dtype_size(cache_dtype);
    // 16-byte copies (fp8: 16 bytes read, 8 written per thread) where every row allows them
    bool wide = (dim * esize) % 16 == 0;
    for (const TensorArg* t : {&k_new, &v_new, &k_cache, &v_cache}) {
        const int64_t size = t->dtype == k_new.dtype ? esize : cache_esize;
        const int64_t vec = quant && t->dtype == cache_dtype ? 8 : 16;  // bytes per unit of this tensor
        expect_last_dim_contiguous(*t);
        expect_data(*t, int(size));
        wide = wide && t->ptr % vec == 0;
        for (int d = 0; d + 1 < t->ndim(); ++d) wide = wide && (t->size(d) <= 1 || (t->stride(d) * size) % vec == 0);
    }
    *unit = wide ? 16 : int(esize);

    KvAppendParams p;
    const TensorArg* src[2] = {&k_new, &v_new};
    const TensorArg* dst[2] = {&k_cache, &v_cache};
    for (int i = 0; i < 2; ++i) {
        p.src[i] = reinterpret_cast<const char*>(src[i]->ptr);
        p.src_stride_h[i] = src[i]->stride(-2) * esize;
        p.dst[i] = reinterpret_cast<char*>(dst[i]->ptr);
        p.dst_stride_row[i] = dst[i]->stride(1) * cache_esize;
        p.dst_stride_h[i] = dst[i]->stride(2) * cache_esize;
    }
    p.rows = k_cache.size(0) * k_cache.size(1);
    p.heads = heads;
    p.src_dtype = k_new.dtype;
    p.cache_dtype = cache_dtype;
    if (quant) {
        p.scale[0] = scales->k;
        p.scale[1] = scales->v;
        p.scale_stride = scales->stride;
        p.quant_vec = wide ? 8 : 1;
        p.units = dim / p.quant_vec;
    } else {
        p.units = dim * esize / *unit;
    }
    return p;
}

// Checks the append's arguments against each other (ValueError naming the argument) and
// returns its params; `unit` is set to the copy width in bytes (16, or the element size).
inline KvAppendParams check_kv_append(const TensorArg& k_new, const TensorArg& v_new, const TensorArg& k_cache,
                                      const TensorArg& v_cache, const TensorArg& slots, int* unit,
                                      const KvScales* scales = nullptr) {
    ASTRAI_CHECK(k_new.ndim() == 3 || k_new.ndim() == 4, k_new.name,
                 ": expected [T, kv_heads, head_dim] or [B, L, kv_heads, head_dim], got shape ",
                 shape_str(k_new.shape));
    KvAppendParams p = check_kv_rows(k_new, v_new, k_cache, v_cache, unit, scales);
    const int64_t tokens = k_new.ndim() == 3 ? k_new.size(0) : k_new.size(0) * k_new.size(1);
    expect_ndim(slots, 1);
    expect_dtype(slots, DType::Int64);
    ASTRAI_CHECK(slots.size(0) == tokens, slots.name, ": expected one slot per new token [", tokens, "], got shape ",
                 shape_str(slots.shape));
    ASTRAI_CHECK(slots.size(0) <= 1 || slots.stride(0) == 1, slots.name, ": must be contiguous");
    expect_data(slots, 8);
    const int64_t esize = dtype_size(k_new.dtype);
    const TensorArg* src[2] = {&k_new, &v_new};
    for (int i = 0; i < 2; ++i) {
        p.src_stride_b[i] = src[i]->ndim() == 4 ? src[i]->stride(0) * esize : 0;
        p.src_stride_l[i] = src[i]->stride(-3) * esize;
    }
    p.slots = slots.data<const int64_t>();
    p.tokens = tokens;
    p.seq_len = k_new.ndim() == 4 ? k_new.size(1) : (tokens > 0 ? tokens : 1);
    return p;
}

// The dim of k_new that runs over the batch's requests, once k_new is checked to be one new
// token per request, [B, 1, Hkv, D], [1, B, Hkv, D] or [B, Hkv, D], of the cache's dtype,
// kv heads and head dim.
inline int request_dim(const TensorArg& k_new, int64_t batch, const TensorArg& k_cache) {
    expect_ndim(k_cache, 4);
    const int64_t heads = k_cache.size(2), dim = k_cache.size(3);
    const int n = k_new.ndim();
    const bool rows_ok = n >= 3 && k_new.size(-2) == heads && k_new.size(-1) == dim;
    const bool lead_ok = (n == 3 && k_new.size(0) == batch) ||
                         (n == 4 && ((k_new.size(0) == batch && k_new.size(1) == 1) ||
                                     (k_new.size(0) == 1 && k_new.size(1) == batch)));
    ASTRAI_CHECK(rows_ok && lead_ok, k_new.name, ": append_last takes one new token per request, [", batch, ", 1, ",
                 heads, ", ", dim, "], [1, ", batch, ", ", heads, ", ", dim, "] or [", batch, ", ", heads, ", ", dim,
                 "] (the cache's kv_heads and head_dim); got shape ", shape_str(k_new.shape));
    ASTRAI_CHECK(k_new.dtype == k_cache.dtype || is_fp8(k_cache.dtype), k_new.name, ": dtype ",
                 dtype_name(k_new.dtype), " differs from ", k_cache.name, "'s ", dtype_name(k_cache.dtype));
    return n == 4 && k_new.size(0) == 1 && k_new.size(1) == batch ? 1 : 0;
}

// The append of a decode step (append_last): request b's one new token k_new[b] / v_new[b]
// to its last position kv_lens[b] - 1 through the page table (kv_indptr [B + 1],
// kv_indices, kv_lens [B] int32 device pointers, checked by the caller), no slots.
inline KvAppendParams check_kv_append_last(const TensorArg& k_new, const TensorArg& v_new, const TensorArg& k_cache,
                                           const TensorArg& v_cache, int64_t batch, const int32_t* kv_indptr,
                                           const int32_t* kv_indices, const int32_t* kv_lens, int* unit,
                                           const KvScales* scales = nullptr) {
    const int dim = request_dim(k_new, batch, k_cache);
    KvAppendParams p = check_kv_rows(k_new, v_new, k_cache, v_cache, unit, scales);
    const int64_t esize = dtype_size(k_new.dtype);
    const TensorArg* src[2] = {&k_new, &v_new};
    for (int i = 0; i < 2; ++i) p.src_stride_b[i] = src[i]->stride(dim) * esize;
    p.kv_indptr = kv_indptr;
    p.kv_indices = kv_indices;
    p.kv_lens = kv_lens;
    p.page_size = k_cache.size(1);
    p.tokens = batch;
    p.seq_len = 1;
    return p;
}

template <typename T>
void launch_kv_append_fp8_t(const KvAppendParams& p, unsigned grid, int threads, cudaStream_t stream) {
    const bool e4m3 = p.cache_dtype == DType::Float8E4M3;
    if (p.quant_vec == 8) {
        if (e4m3) kv_append_fp8_kernel<T, 8, __NV_E4M3><<<grid, threads, 0, stream>>>(p);
        else kv_append_fp8_kernel<T, 8, __NV_E5M2><<<grid, threads, 0, stream>>>(p);
    } else {
        if (e4m3) kv_append_fp8_kernel<T, 1, __NV_E4M3><<<grid, threads, 0, stream>>>(p);
        else kv_append_fp8_kernel<T, 1, __NV_E5M2><<<grid, threads, 0, stream>>>(p);
    }
}

inline void launch_kv_append_fp8(const KvAppendParams& p, unsigned grid, int threads, cudaStream_t stream) {
    if (p.src_dtype == DType::Float16) launch_kv_append_fp8_t<__half>(p, grid, threads, stream);
    else launch_kv_append_fp8_t<__nv_bfloat16>(p, grid, threads, stream);
    ASTRAI_CHECK_LAUNCH();
}

inline void launch_kv_append(const KvAppendParams& p, int unit, cudaStream_t stream) {
    const int64_t items = 2 * p.tokens * p.heads * p.units;
    if (items == 0) return;
    constexpr int kThreads = 256;
    const int64_t blocks = (items + kThreads - 1) / kThreads;
    const unsigned grid = unsigned(blocks < 65535 * 8 ? blocks : 65535 * 8);  // grid-stride beyond
    if (is_fp8(p.cache_dtype)) {
        launch_kv_append_fp8(p, grid, kThreads, stream);
        return;
    }
    switch (unit) {
        case 16: kv_append_kernel<uint4><<<grid, kThreads, 0, stream>>>(p); break;
        case 8: kv_append_kernel<uint2><<<grid, kThreads, 0, stream>>>(p); break;
        case 4: kv_append_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(p); break;
        case 2: kv_append_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(p); break;
        default: kv_append_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(p); break;
    }
    ASTRAI_CHECK_LAUNCH();
}

}  // namespace astrai::attn
