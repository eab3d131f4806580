// Host-side helpers shared by the four binding files: argument checks that name the
// argument (ValueError before any launch) and AttentionParams packing. No torch.
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>

#include "astrai/bind.h"
#include "astrai/check.h"
#include "astrai/dtype.h"
#include "astrai/tensor_arg.h"
#include "capabilities.h"
#include "common.h"
#include "heuristics.h"
#include "kv_append.cuh"
#include "variant.cuh"

namespace astrai::attn {

// Rows the kernels copy 16 bytes at a time (cp.async): last dim contiguous, a 16-byte aligned
// pointer, every other stride a whole number of 16 bytes.
inline void check_rows16(const TensorArg& t) {
    expect_last_dim_contiguous(t);
    expect_data(t, 16);
    const int64_t per_16 = 16 / dtype_size(t.dtype);
    for (int i = 0; i + 1 < t.ndim(); ++i)
        ASTRAI_CHECK(t.stride(i) % per_16 == 0 || t.size(i) <= 1, t.name, ": stride of dim ", i,
                     " must be a multiple of ", per_16, " elements (16-byte rows), got strides ",
                     shape_str(t.strides));
}

// q/k/v/o-like operands: 16-bit float, last dim contiguous, 16-byte aligned rows (cp.async).
inline void check_operand(const TensorArg& t, int ndim, DType dtype) {
    expect_ndim(t, ndim);
    ASTRAI_CHECK(is_dtype(t.dtype), t.name, ": dtype must be " ASTRAI_ATTN_DTYPES_TEXT ", got ",
                 dtype_name(t.dtype));
    ASTRAI_CHECK(t.dtype == dtype, t.name, ": dtype ", dtype_name(t.dtype), " differs from q's ",
                 dtype_name(dtype));
    check_rows16(t);
}

inline void check_index(const TensorArg& t, int64_t len, const char* what) {
    expect_ndim(t, 1);
    expect_dtype(t, DType::Int32);
    if (len >= 0) ASTRAI_CHECK(t.size(0) == len, t.name, ": expected ", what, ", got shape ", shape_str(t.shape));
    ASTRAI_CHECK(t.size(0) <= 1 || t.stride(0) == 1, t.name, ": must be contiguous");
    expect_data(t, 4);
}

inline void check_head_dim(const TensorArg& q) {
    ASTRAI_CHECK(is_head_dim(q.size(-1)), q.name, ": head_dim must be " ASTRAI_ATTN_HEAD_DIMS_TEXT ", got ", q.size(-1));
}

// The q, k, v and out arguments, first in every module; errors name k and v "k_cache" and
// "v_cache" where `paged`.
struct Operands {
    TensorArg q, k, v, out;
};

inline Operands operand_args(pybind11::handle q, pybind11::handle k, pybind11::handle v, pybind11::handle out,
                             bool paged) {
    return {bind::tensor_arg("q", q), bind::tensor_arg(paged ? "k_cache" : "k", k),
            bind::tensor_arg(paged ? "v_cache" : "v", v), bind::tensor_arg("out", out)};
}

// q [B, L, Hq, D] (ndim 4) or packed [total_q, Hq, D] (ndim 3): an operand with a kernel's head_dim.
inline void check_query(const TensorArg& q, int ndim) {
    check_operand(q, ndim, q.dtype);
    check_head_dim(q);
}

// A decode's q [B, 1, Hq, D]: one query per request.
inline void check_decode_query(const TensorArg& q) {
    check_query(q, 4);
    ASTRAI_CHECK(q.size(1) == 1, "q: decode takes one query per request, shape [B, 1, Hq, D]; got ",
                 shape_str(q.shape));
}

// Contiguous k, v [B, Lkv, Hkv, D] with q's dtype, batch and head_dim and Lkv >= 1;
// `layout` describes k's expected shape in errors.
inline void check_contiguous_kv(const TensorArg& k, const TensorArg& v, const TensorArg& q, const char* layout) {
    check_operand(k, 4, q.dtype);
    check_operand(v, 4, q.dtype);
    expect_shape(k, {q.size(0), -1, -1, q.size(-1)}, layout);
    ASTRAI_CHECK(v.shape == k.shape, "v: shape ", shape_str(v.shape), " differs from k's ", shape_str(k.shape));
    ASTRAI_CHECK(k.size(1) >= 1, "k: kv length must be >= 1, got ", k.size(1));
}

// out: q's dtype and shape.
inline void check_output(const TensorArg& out, const TensorArg& q) {
    check_operand(out, q.ndim(), q.dtype);
    ASTRAI_CHECK(out.shape == q.shape, "out: shape ", shape_str(out.shape), " differs from q's ", shape_str(q.shape));
}

inline void check_grid(int64_t x, int64_t y, int64_t z) {
    ASTRAI_CHECK(x < (int64_t(1) << 31), "q: too many query tiles for one launch (", x, ")");
    ASTRAI_CHECK(y <= 65535, "k: kv_heads x head groups (", y, ") exceeds the grid limit 65535");
    ASTRAI_CHECK(z <= 65535, "q: batch (", z, ") exceeds the grid limit 65535");
}

inline void check_heads(int64_t q_heads, int64_t kv_heads) {
    ASTRAI_CHECK(kv_heads >= 1, "k: kv_heads must be >= 1, got ", kv_heads);
    ASTRAI_CHECK(q_heads >= 1 && q_heads % kv_heads == 0, "q: q_heads (", q_heads,
                 ") must be a positive multiple of kv_heads (", kv_heads, ")");
}

inline void set_common(AttentionParams& p, const TensorArg& q, const TensorArg& o, int64_t q_heads,
                       int64_t kv_heads) {
    p.q = reinterpret_cast<const void*>(q.ptr);
    p.o = reinterpret_cast<void*>(o.ptr);
    p.q_heads = int(q_heads);
    p.kv_heads = int(kv_heads);
    p.group = int(q_heads / kv_heads);
    const double d = double(q.size(-1));
    p.scale_log2 = float(1.0 / std::sqrt(d) * 1.4426950408889634);
}

// [B, L, H, D] operand -> (b, l, h) strides.
inline void set_kv(AttentionParams& p, const TensorArg& k, const TensorArg& v) {
    p.k = reinterpret_cast<const void*>(k.ptr);
    p.v = reinterpret_cast<const void*>(v.ptr);
    p.k_stride_b = k.stride(0); p.k_stride_l = k.stride(1); p.k_stride_h = k.stride(2);
    p.v_stride_b = v.stride(0); p.v_stride_l = v.stride(1); p.v_stride_h = v.stride(2);
}

// q/out strides: (b, l, h) of [B, L, H, D], or (l, h) of packed [total_q, H, D] (no batch stride).
inline void set_qo_strides(AttentionParams& p, const TensorArg& q, const TensorArg& o) {
    const int l = q.ndim() - 3;  // the row dim: 1, or 0 when packed
    if (l == 1) {
        p.q_stride_b = q.stride(0);
        p.o_stride_b = o.stride(0);
    }
    p.q_stride_l = q.stride(l); p.q_stride_h = q.stride(l + 1);
    p.o_stride_l = o.stride(l); p.o_stride_h = o.stride(l + 1);
}

// Everything every module sets of its q, out, k and v (heads, scale, pointers, strides).
inline void set_operands(AttentionParams& p, const TensorArg& q, const TensorArg& o, const TensorArg& k,
                         const TensorArg& v, int64_t q_heads, int64_t kv_heads) {
    set_common(p, q, o, q_heads, kv_heads);
    set_kv(p, k, v);
    set_qo_strides(p, q, o);
}

// Optional bool mask over [B, kv] (2D) or [B, q_len, kv] (3D).
inline void set_mask(AttentionParams& p, const TensorArg& m, int64_t batch, int64_t q_len, int64_t kv_len) {
    expect_dtype(m, DType::Bool);
    const bool shape_ok = (m.ndim() == 2 && m.size(0) == batch && m.size(1) == kv_len) ||
                          (m.ndim() == 3 && m.size(0) == batch && m.size(1) == q_len && m.size(2) == kv_len);
    ASTRAI_CHECK(shape_ok, m.name, ": expected shape [", batch, ", ", kv_len, "] or [", batch, ", ", q_len,
                 ", ", kv_len, "], got ", shape_str(m.shape));
    expect_data(m, 1);
    p.mask = reinterpret_cast<const uint8_t*>(m.ptr);
    p.mask_stride_b = m.stride(0);
    p.mask_stride_q = m.ndim() == 3 ? m.stride(1) : 0;
    p.mask_stride_k = m.stride(-1);
}

// Split-K workspace for num_splits > 1: ws_o float32 with >= splits*B*Hq*D elements and
// ws_lse float32 with >= splits*B*Hq.
inline void set_workspace(AttentionParams& p, int64_t num_splits, const TensorArg* ws_o, const TensorArg* ws_lse,
                          int64_t batch, int64_t q_heads, int64_t head_dim) {
    ASTRAI_CHECK(num_splits >= 1 && num_splits <= kMaxDecodeSplits, "num_splits: must be in [1, ",
                 kMaxDecodeSplits, "], got ", num_splits);
    p.num_splits = int(num_splits);
    if (num_splits == 1) return;
    ASTRAI_CHECK(ws_o && ws_lse, "ws_o: num_splits > 1 needs the ws_o and ws_lse workspaces");
    expect_dtype(*ws_o, DType::Float32);
    expect_dtype(*ws_lse, DType::Float32);
    const int64_t rows = num_splits * batch * q_heads;
    ASTRAI_CHECK(ws_o->numel() >= rows * head_dim, "ws_o: needs at least ", rows * head_dim,
                 " float32 elements for ", num_splits, " splits, got ", ws_o->numel());
    ASTRAI_CHECK(ws_lse->numel() >= rows, "ws_lse: needs at least ", rows, " float32 elements, got ",
                 ws_lse->numel());
    expect_data(*ws_o, 16);
    expect_data(*ws_lse, 4);
    p.ws_o = reinterpret_cast<float*>(ws_o->ptr);
    p.ws_lse = reinterpret_cast<float*>(ws_lse->ptr);
}

// Optional decode arrival counters: int32 with >= `units` (batch x kv_heads x head groups)
// elements, all 0 (the kernel leaves them 0). Unused without a split.
inline void set_decode_counters(AttentionParams& p, const TensorArg* ws_count, int64_t units) {
    if (!ws_count || p.num_splits == 1) return;
    expect_dtype(*ws_count, DType::Int32);
    ASTRAI_CHECK(ws_count->numel() >= units, "ws_count: needs at least ", units,
                 " int32 elements (batch x kv_heads x head groups), got ", ws_count->numel());
    ASTRAI_CHECK(ws_count->ndim() <= 1 || ws_count->numel() <= 1 || ws_count->stride(-1) == 1,
                 "ws_count: must be contiguous");
    expect_data(*ws_count, 4);
    p.ws_count = reinterpret_cast<int*>(ws_count->ptr);
}

// The decode modules' optional split-K arguments (None or a tensor each): the workspaces
// of num_splits > 1 and the arrival counters of the in-kernel merge. Sets p.num_splits,
// p.batch, p.q_len, p.head_groups and checks the grid.
inline void set_decode_splits(AttentionParams& p, int64_t num_splits, pybind11::handle ws_o_a,
                              pybind11::handle ws_lse_a, pybind11::handle ws_count_a, int64_t batch, int64_t q_heads,
                              int64_t kv_heads, int64_t head_dim) {
    auto optional_arg = [](const char* name, pybind11::handle h) {
        return h.is_none() ? std::nullopt : std::optional<TensorArg>(bind::tensor_arg(name, h));
    };
    const std::optional<TensorArg> ws_o = optional_arg("ws_o", ws_o_a), ws_lse = optional_arg("ws_lse", ws_lse_a),
                                   ws_count = optional_arg("ws_count", ws_count_a);
    set_workspace(p, num_splits, ws_o ? &*ws_o : nullptr, ws_lse ? &*ws_lse : nullptr, batch, q_heads, head_dim);
    p.batch = int(batch);
    p.q_len = 1;
    p.head_groups = decode_head_groups(p.group);
    const int64_t units = batch * kv_heads * p.head_groups;
    check_grid(units, num_splits, 1);
    set_decode_counters(p, ws_count ? &*ws_count : nullptr, units);
}

// log2(page) for a power-of-two page size, else -1 (the kernels then divide).
inline int page_shift_of(int64_t page) {
    if (page <= 0 || (page & (page - 1)) != 0) return -1;
    int shift = 0;
    while ((int64_t(1) << shift) < page) ++shift;
    return shift;
}

// fp8 pages (ASTRAI_ATTN_FP8_KV_DTYPES, both caches alike): last dim contiguous, 16-byte rows.
inline void check_fp8_pages(const TensorArg& t, DType dtype) {
    expect_ndim(t, 4);
    ASTRAI_CHECK(t.dtype == dtype, t.name, ": dtype ", dtype_name(t.dtype), " differs from k_cache's ",
                 dtype_name(dtype));
    check_rows16(t);
}

// A paged K/V cache pair's storage: 16-bit pages of `dtype`, or fp8 ones (both alike) where
// `fp8_ok`; 4-D, of one shape.
inline void check_cache_pages(const TensorArg& k, const TensorArg& v, DType dtype, bool fp8_ok) {
    const bool fp8 = is_fp8_kv_dtype(k.dtype);
    ASTRAI_CHECK(!fp8 || fp8_ok, "k_cache: this kernel reads ", dtype_name(dtype), " pages, not ",
                 dtype_name(k.dtype));
    if (fp8) {
        check_fp8_pages(k, k.dtype);
        check_fp8_pages(v, k.dtype);
    } else {
        check_operand(k, 4, dtype);
        check_operand(v, 4, dtype);
    }
    ASTRAI_CHECK(v.shape == k.shape, "v_cache: shape ", shape_str(v.shape), " differs from k_cache's ",
                 shape_str(k.shape));
}

// A paged K/V cache pair [num_pages, page_size, Hkv, D] for q (head_dim D, q_heads heads), of
// q's dtype, or fp8 where `fp8_ok` (the paged decode).
inline void check_paged_cache(const TensorArg& k, const TensorArg& v, const TensorArg& q, int64_t q_heads,
                              bool fp8_ok = false) {
    check_cache_pages(k, v, q.dtype, fp8_ok);
    expect_shape(k, {-1, -1, -1, q.size(-1)}, "[num_pages, page_size, Hkv, D] with q's head_dim");
    ASTRAI_CHECK(k.size(1) >= 1, "k_cache: page_size must be >= 1");
    check_heads(q_heads, k.size(2));
}

// An fp8 cache's dequantization scales into p (nothing for 16-bit pages).
inline void set_kv_scales(AttentionParams& p, const std::optional<KvScales>& scales) {
    if (!scales) return;
    p.k_scale = scales->k;
    p.v_scale = scales->v;
    p.kv_scale_stride = scales->stride;
}

// The page table of B requests (int32 kv_indptr [B + 1], kv_indices, kv_lens [B]) and the
// cache's page size; indptr_what describes kv_indptr's expected shape in errors.
inline void set_page_table(AttentionParams& p, const TensorArg& indptr, const TensorArg& indices,
                           const TensorArg& lens, int64_t batch, int64_t page, const char* indptr_what) {
    check_index(indptr, batch + 1, indptr_what);
    check_index(indices, -1, "[nnz_pages]");
    check_index(lens, batch, "[batch]");
    p.kv_indptr = indptr.data<const int32_t>();
    p.kv_indices = indices.data<const int32_t>();
    p.kv_lens = lens.data<const int32_t>();
    p.page_size = int(page);
    p.page_shift = page_shift_of(page);
}

// A variant's per-head vector (sinks, alibi_slopes): None, or float32 [q_heads], contiguous.
inline const float* head_vector_arg(const char* name, pybind11::handle t, int64_t q_heads) {
    if (t.is_none()) return nullptr;
    const TensorArg s = bind::tensor_arg(name, t);
    expect_dtype(s, DType::Float32);
    ASTRAI_CHECK(s.ndim() == 1 && s.size(0) == q_heads, name, ": expected shape [q_heads] = [", q_heads, "], got ",
                 shape_str(s.shape));
    expect_contiguous(s);
    expect_data(s, 4);
    return s.data<const float>();
}

// The `variant` argument of the four modules (variant.cuh): None (plain attention) or the
// tuple (scale, logits_soft_cap, window_left, sinks[, alibi_slopes]): scale 0 means
// 1 / sqrt(head_dim), a soft-cap of 0 none, window_left -1 none, sinks and alibi_slopes None or
// float32 [q_heads] on q's device (four items: no ALiBi, as plugins built before it took).
inline void set_variant(AttentionParams& p, pybind11::handle variant_a, int64_t q_heads, int64_t head_dim) {
    if (variant_a.is_none()) return;
    const auto v = pybind11::reinterpret_borrow<pybind11::tuple>(variant_a);
    ASTRAI_CHECK(v.size() == 4 || v.size() == 5,
                 "variant: expected (scale, logits_soft_cap, window_left, sinks[, alibi_slopes]), got ", v.size(),
                 " items");
    const double scale = v[0].cast<double>(), cap = v[1].cast<double>();
    const int64_t window = v[2].cast<int64_t>();
    ASTRAI_CHECK(std::isfinite(scale) && scale >= 0, "scale: must be a positive finite float (0: 1/sqrt(head_dim)), got ",
                 scale);
    ASTRAI_CHECK(std::isfinite(cap) && cap >= 0, "logits_soft_cap: must be a positive finite float (0: none), got ",
                 cap);
    ASTRAI_CHECK(window >= -1 && window < (int64_t(1) << 31), "window_left: must be -1 (none) or >= 0, got ", window);
    const float* sinks = head_vector_arg("sinks", v[3], q_heads);
    const float* alibi_slopes = v.size() == 5 ? head_vector_arg("alibi_slopes", v[4], q_heads) : nullptr;
    set_variant_params(p, int(head_dim), scale, cap, int(window), sinks, alibi_slopes);
}

// kVariantFeatures as a Python tuple (every module's VARIANTS).
inline pybind11::tuple variant_features() {
    pybind11::tuple names(std::size(kVariantFeatures));
    for (size_t i = 0; i < std::size(kVariantFeatures); ++i) names[i] = kVariantFeatures[i];
    return names;
}

// A prefill's query-head packing (from p.group) and the grid check of its launch over
// `q_tiles` query tiles of `batch` requests.
inline void set_prefill_heads(AttentionParams& p, int64_t q_tiles, int64_t kv_heads, int64_t batch) {
    p.head_block = prefill_head_block(p.group);
    p.head_groups = prefill_head_groups(p.group);
    check_grid(q_tiles * p.head_block, kv_heads * p.head_groups, batch);
}

// (head_block, head_groups, warps, blocks_per_tile) of an mma prefill launch (the wgmma
// kernel on sm_90a runs the same grid).
inline pybind11::tuple prefill_plan(int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
    check_heads(q_heads, kv_heads);
    ASTRAI_CHECK(is_head_dim(head_dim), "head_dim: must be " ASTRAI_ATTN_HEAD_DIMS_TEXT ", got ", head_dim);
    const PrefillLaunch l = prefill_launch(int(q_heads / kv_heads), int(head_dim));
    return pybind11::make_tuple(l.head_block, l.head_groups, l.warps, l.blocks_per_tile);
}

}  // namespace astrai::attn
