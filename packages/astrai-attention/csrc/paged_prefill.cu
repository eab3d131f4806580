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
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "astrai/bind.h"
#include "dispatchers.cuh"
#include "entry_utils.h"

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
    m.attr("Q_TILE_ROWS") = astrai::attn::kQTileRows;
    m.attr("VARIANTS") = astrai::attn::variant_features();  // the `variant` argument's features
    // page dtypes read besides q's (with kv_scales)
    m.attr("KV_DTYPES") = astrai::attn::kPrefillReadsFp8 ? py::make_tuple("float8_e4m3fn", "float8_e5m2") : py::tuple();
}
