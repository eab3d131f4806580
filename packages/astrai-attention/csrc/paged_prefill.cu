// Module astrai_attention._attn_paged_prefill: ragged (packed-Q) prefill over a paged KV
// cache (split-Q, O(1) tile -> request lookup).
//
//   attn_paged_prefill(q, k_cache, v_cache, out, qo_indptr, kv_indptr, kv_indices, kv_lens,
//                      q_tile_to_batch, q_tile_to_index, is_causal=True, stream=0, variant=None,
//                      kv_scales=None)
//     q, out [total_q, Hq, D]; k_cache, v_cache [P, page, Hkv, D]; int32 metadata as
//     built by BatchPlan (64-row Q tiles). Causal is bottom-right aligned per request.
//   variant: None or (scale, logits_soft_cap, window_left, sinks) (entry_utils.h set_variant)
//   kv_scales: with fp8 caches (KV_DTYPES), the layer's (k_scale, v_scale), float32 [1] or [Hkv]
//     each (as attn_paged_decode's); the kernel reads stored * scale rounded to q's dtype
//   prefill_plan(q_heads, kv_heads, head_dim) -> (head_block, head_groups, warps, blocks_per_tile)
//   gather_pages(k_cache, v_cache, source, k_out, v_out, stream, kv_scales=None)
//     k_out / v_out [n, page, Hkv, D] (bfloat16 / float16, contiguous) = the cache pages source[i]
//     (int64 [n]), fp8 ones dequantized with kv_scales (page_gather.cuh), in one launch
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "astrai/bind.h"
#include "dispatchers.cuh"
#include "entry_utils.h"
#include "page_gather.cuh"

namespace astrai::attn {
namespace py = pybind11;

void attn_paged_prefill(py::handle q_a, py::handle k_a, py::handle v_a, py::handle out_a, py::handle qo_a,
                        py::handle indptr_a, py::handle indices_a, py::handle lens_a, py::handle tb_a,
                        py::handle ti_a, bool is_causal, py::handle stream_a, py::handle variant_a,
                        py::handle kv_scales_a) {
    const auto [q, k, v, out] = operand_args(q_a, k_a, v_a, out_a, /*paged=*/true);
    const auto [qo, indptr, indices, lens, tb, ti] =
        bind::tensor_args({"qo_indptr", "kv_indptr", "kv_indices", "kv_lens", "q_tile_to_batch", "q_tile_to_index"},
                          {qo_a, indptr_a, indices_a, lens_a, tb_a, ti_a});
    const cudaStream_t stream = bind::stream_arg(stream_a);
    check_query(q, 3);
    const int64_t total_q = q.size(0), Hq = q.size(1), D = q.size(2);
    check_paged_cache(k, v, q, Hq, kPrefillReadsFp8);
    const int64_t page = k.size(1), Hkv = k.size(2);
    const std::optional<KvScales> scales = kv_scales_arg(kv_scales_a, k.dtype, Hkv);
    check_output(out, q);
    ASTRAI_CHECK(qo.ndim() == 1 && qo.size(0) >= 1, "qo_indptr: expected shape [batch + 1], got ", shape_str(qo.shape));
    const int64_t B = qo.size(0) - 1;
    check_index(qo, B + 1, "[batch + 1]");
    check_index(tb, -1, "[num_q_tiles]");
    check_index(ti, tb.size(0), "[num_q_tiles] (as q_tile_to_batch)");
    ASTRAI_CHECK(tb.size(0) <= num_q_tiles(total_q) + B, "q_tile_to_batch: ", tb.size(0),
                 " tiles cannot cover ", total_q, " query rows in ", B, " requests");

    AttentionParams p;
    set_operands(p, q, out, k, v, Hq, Hkv);
    set_page_table(p, indptr, indices, lens, B, page, "[batch + 1] (as qo_indptr)");
    p.num_pages = int(std::min<int64_t>(k.size(0), INT32_MAX));
    p.qo_indptr = qo.data<const int32_t>();
    p.q_tile_to_batch = tb.data<const int32_t>();
    p.q_tile_to_index = ti.data<const int32_t>();
    p.num_q_tiles = int(tb.size(0));
    p.q_total_rows = int(total_q);
    p.batch = int(B);
    p.causal = is_causal;
    set_variant(p, variant_a, Hq, D);
    set_kv_scales(p, scales);
    set_prefill_heads(p, tb.size(0), Hkv, 1);
    if (tb.size(0) == 0 || total_q == 0) return;
    dispatch_prefill<PackedQSchedule, PagedKV>(p, q.dtype, int(D), unsigned(tb.size(0)), 1u, stream, k.dtype);
}

void gather_pages(py::handle k_a, py::handle v_a, py::handle source_a, py::handle k_out_a, py::handle v_out_a,
                  py::handle stream_a, py::handle kv_scales_a) {
    const auto [k, v, source, k_out, v_out] = bind::tensor_args({"k_cache", "v_cache", "source", "k_out", "v_out"},
                                                                 {k_a, v_a, source_a, k_out_a, v_out_a});
    const cudaStream_t stream = bind::stream_arg(stream_a);
    const bool fp8 = is_fp8_kv_dtype(k.dtype);
    check_cache_pages(k, v, k.dtype, /*fp8_ok=*/true);
    check_head_dim(k);
    const int64_t page = k.size(1), Hkv = k.size(2), D = k.size(3);
    ASTRAI_CHECK(k.stride(2) == D && k.stride(1) == Hkv * D && v.strides == k.strides, "k_cache: each page must be "
                 "contiguous and v_cache laid out alike, got strides ", shape_str(k.strides), " and ",
                 shape_str(v.strides));
    const std::optional<KvScales> scales = kv_scales_arg(kv_scales_a, k.dtype, Hkv);
    expect_ndim(source, 1);
    expect_dtype(source, DType::Int64);
    ASTRAI_CHECK(source.size(0) <= 1 || source.stride(0) == 1, "source: must be contiguous");
    expect_data(source, 8);
    const int64_t n = source.size(0);
    for (const TensorArg* out : {&k_out, &v_out}) {
        expect_ndim(*out, 4);
        const DType want = fp8 ? k_out.dtype : k.dtype;  // fp8 pages: either 16-bit dtype, both outputs alike
        ASTRAI_CHECK(is_dtype(out->dtype), out->name, ": dtype must be " ASTRAI_ATTN_DTYPES_TEXT ", got ",
                     dtype_name(out->dtype));
        ASTRAI_CHECK(out->dtype == want, out->name, ": dtype ", dtype_name(out->dtype), " differs from ",
                     fp8 ? "k_out" : "k_cache", "'s ", dtype_name(want));
        expect_shape(*out, {n, page, Hkv, D}, "[len(source), page_size, Hkv, D] of the cache");
        expect_contiguous(*out);
        expect_data(*out, 16);
    }
    PageGatherParams p;
    p.src[0] = k.data<const void>();
    p.src[1] = v.data<const void>();
    p.dst[0] = k_out.data<void>();
    p.dst[1] = v_out.data<void>();
    p.source = source.data<const int64_t>();
    p.n = n;
    p.num_pages = k.size(0);
    p.page_stride = k.stride(0);
    ASTRAI_CHECK(page * Hkv * D / 8 <= INT32_MAX && 2 * n <= INT32_MAX, "k_cache: pages of ", page * Hkv * D,
                 " values, or ", n, " of them, are more than one launch covers");
    p.vectors_per_page = int(page * Hkv * D / 8);
    p.head_dim = int(D);
    p.kv_heads = int(Hkv);
    if (scales) {
        p.scale[0] = scales->k;
        p.scale[1] = scales->v;
        p.scale_stride = scales->stride;
    }
    const bool half = k_out.dtype == DType::Float16;
#define ASTRAI_KV(DT, FMT) \
    if (k.dtype == DType::DT)   \
        return half ? launch_page_gather<__half, FMT>(p, stream) : launch_page_gather<__nv_bfloat16, FMT>(p, stream);
    ASTRAI_ATTN_FP8_KV_DTYPES(ASTRAI_KV)
#undef ASTRAI_KV
    half ? launch_page_gather<__half, Kv16>(p, stream) : launch_page_gather<__nv_bfloat16, Kv16>(p, stream);
}

}  // namespace astrai::attn

PYBIND11_MODULE(_attn_paged_prefill, m) {
    namespace py = pybind11;
    astrai::bind::init_module(m);
    m.def("attn_paged_prefill", &astrai::attn::attn_paged_prefill, py::arg("q"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("out"), py::arg("qo_indptr"), py::arg("kv_indptr"), py::arg("kv_indices"),
          py::arg("kv_lens"), py::arg("q_tile_to_batch"), py::arg("q_tile_to_index"), py::arg("is_causal") = true,
          py::arg("stream") = 0, py::arg("variant") = py::none(), py::arg("kv_scales") = py::none(),
          "Ragged prefill attention over a paged KV cache into out (fp8 pages with kv_scales).");
    m.def("prefill_plan", &astrai::attn::prefill_plan, py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"),
          "(head_block, head_groups, warps, blocks_per_tile) of an mma prefill launch.");
    m.def("gather_pages", &astrai::attn::gather_pages, py::arg("k_cache"), py::arg("v_cache"), py::arg("source"),
          py::arg("k_out"), py::arg("v_out"), py::arg("stream"), py::arg("kv_scales") = py::none(),
          "Copy the cache pages source[i] into k_out / v_out [n, page, Hkv, D] in one launch (fp8 pages\n"
          "dequantized with kv_scales into the outputs' 16-bit dtype).");
    m.attr("Q_TILE_ROWS") = astrai::attn::kQTileRows;
    m.attr("VARIANTS") = astrai::attn::variant_features();  // the `variant` argument's features
    // page dtypes read besides q's (with kv_scales)
    m.attr("KV_DTYPES") = astrai::attn::kPrefillReadsFp8 ? py::make_tuple(ASTRAI_ATTN_FP8_KV_DTYPE_NAMES) : py::tuple();
}
