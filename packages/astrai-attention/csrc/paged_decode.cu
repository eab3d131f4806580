// Module astrai_attention._attn_paged_decode: decode over a paged KV cache (split-KV).
//
//   attn_paged_decode(q, k_cache, v_cache, out, kv_indptr, kv_indices, kv_lens,
//                     num_splits=1, ws_o=None, ws_lse=None, stream=0, ws_count=None,
//                     pdl=False, k_new=None, v_new=None, slots=None, append_last=False, variant=None)
//     q, out [B, 1, Hq, D]; k_cache, v_cache [P, page, Hkv, D]; kv_indptr int32 [B+1];
//     kv_indices int32 [nnz_pages]; kv_lens int32 [B] (tokens; the caller guarantees
//     kv_lens[b] <= (kv_indptr[b+1] - kv_indptr[b]) * page)
//   ws_count: optional int32 [>= B * Hkv * head_groups] arrival counters, all 0 (left 0):
//     with num_splits > 1 the kernel merges its own splits and no combine kernel runs
//   pdl: on sm_90+ also launch the split grid with programmatic dependent launch (its
//     blocks read kv_lens and the first page ids while the stream's previous kernel drains,
//     which must therefore not write them); off by default (dispatchers.cuh: faster at B=1
//     with many splits, slower at B=16 with one)
//   k_new, v_new, slots: optional, together: this step's keys/values are first written to
//     rows slots of the caches (kv_append's arguments; checked with the rest, before either
//     launch), so a decode step's append and attention cost one call
//   append_last: with k_new, v_new [B, 1, Hkv, D] ([1, B, Hkv, D] or [B, Hkv, D]) and no
//     slots: they are the keys/values of each request's last position kv_lens[b] - 1 (a
//     decode step's one new token each), and the decode kernel writes them to the cache
//     rows the page table gives that position itself: one launch per step (the scheme and
//     why it is race-free: decode_split_kv_mma.cuh). Where it can't (rows not 16-byte
//     aligned, a scalar-kernel build) kv_append writes them first, rows from the page table.
//   variant: None or (scale, logits_soft_cap, window_left, sinks) (entry_utils.h set_variant)
//   kv_scales: with fp8 caches (KV_DTYPES: float8_e4m3fn / float8_e5m2 pages for bfloat16 or
//     float16 q), the layer's (k_scale, v_scale) dequantization scales, float32 [1] or [Hkv]
//     each; the decode reads stored * scale, and an append quantizes (kv_append.cuh) in a
//     launch of its own before the decode (no in-kernel append over fp8 pages)
//   kv_append(k_new, v_new, k_cache, v_cache, slots, stream, kv_scales=None): the append alone
//     (kv_append.cuh)
//   decode_plan(..., kv_bytes=2) as in _attn_decode; kv_bytes=1 plans over fp8 pages
#include <pybind11/pybind11.h>

#include <optional>

#include "astrai/bind.h"
#include "dispatchers.cuh"
#include "entry_utils.h"
#include "kv_append.cuh"

namespace astrai::attn {
namespace py = pybind11;

void attn_paged_decode(py::handle q_a, py::handle k_a, py::handle v_a, py::handle out_a, py::handle indptr_a,
                       py::handle indices_a, py::handle lens_a, int64_t num_splits, py::handle ws_o_a,
                       py::handle ws_lse_a, py::handle stream_a, py::handle ws_count_a, bool pdl,
                       py::handle k_new_a, py::handle v_new_a, py::handle slots_a, bool append_last,
                       py::handle variant_a, py::handle kv_scales_a) {
    const auto [q, k, v, out] = operand_args(q_a, k_a, v_a, out_a, /*paged=*/true);
    const auto [indptr, indices, lens] =
        bind::tensor_args({"kv_indptr", "kv_indices", "kv_lens"}, {indptr_a, indices_a, lens_a});
    const cudaStream_t stream = bind::stream_arg(stream_a);
    check_decode_query(q);
    const int64_t B = q.size(0), Hq = q.size(2), D = q.size(3);
    check_paged_cache(k, v, q, Hq, kDecodeReadsFp8);
    const int64_t page = k.size(1), Hkv = k.size(2);
    const std::optional<KvScales> scales = kv_scales_arg(kv_scales_a, k.dtype, Hkv);
    check_output(out, q);

    AttentionParams p;
    set_operands(p, q, out, k, v, Hq, Hkv);
    set_page_table(p, indptr, indices, lens, B, page, "[batch + 1]");
    set_decode_splits(p, num_splits, ws_o_a, ws_lse_a, ws_count_a, B, Hq, Hkv, D);
    set_variant(p, variant_a, Hq, D);  // checked before the append below writes anything
    set_kv_scales(p, scales);
    const KvScales* quant = scales ? &*scales : nullptr;
    if (append_last) {
        ASTRAI_CHECK(slots_a.is_none(), "slots: append_last derives each request's row from the page table; "
                     "pass slots=None");
        ASTRAI_CHECK(!k_new_a.is_none() && !v_new_a.is_none(), "k_new: append_last needs k_new and v_new, "
                     "one new token per request [B, 1, kv_heads, head_dim]");
        int unit = 0;
        const KvAppendParams ap =
            check_kv_append_last(bind::tensor_arg("k_new", k_new_a), bind::tensor_arg("v_new", v_new_a), k, v, B,
                                 p.kv_indptr, p.kv_indices, p.kv_lens, &unit, quant);
        if (kDecodeAppendsInKernel && unit == 16 && !quant) {
            const int64_t esize = dtype_size(q.dtype);
            p.k_new = ap.src[0];
            p.v_new = ap.src[1];
            p.k_new_stride_b = ap.src_stride_b[0] / esize;
            p.k_new_stride_h = ap.src_stride_h[0] / esize;
            p.v_new_stride_b = ap.src_stride_b[1] / esize;
            p.v_new_stride_h = ap.src_stride_h[1] / esize;
        } else {
            launch_kv_append(ap, unit, stream);
        }
    } else if (!k_new_a.is_none() || !v_new_a.is_none() || !slots_a.is_none()) {
        ASTRAI_CHECK(!k_new_a.is_none() && !v_new_a.is_none() && !slots_a.is_none(),
                     "k_new: the append needs k_new, v_new and slots together");
        int unit = 0;
        const KvAppendParams ap = check_kv_append(bind::tensor_arg("k_new", k_new_a),
                                                  bind::tensor_arg("v_new", v_new_a), k, v,
                                                  bind::tensor_arg("slots", slots_a), &unit, quant);
        launch_kv_append(ap, unit, stream);
    }
    if (B == 0) return;
    dispatch_decode<PagedKV>(p, q.dtype, int(D), stream, pdl, k.dtype);
}

void kv_append(py::handle k_new_a, py::handle v_new_a, py::handle k_cache_a, py::handle v_cache_a,
               py::handle slots_a, py::handle stream_a, py::handle kv_scales_a) {
    int unit = 0;
    const TensorArg k_cache = bind::tensor_arg("k_cache", k_cache_a);
    const std::optional<KvScales> scales =
        kv_scales_arg(kv_scales_a, k_cache.dtype, k_cache.ndim() == 4 ? k_cache.size(2) : 0);
    const KvAppendParams p = check_kv_append(bind::tensor_arg("k_new", k_new_a), bind::tensor_arg("v_new", v_new_a),
                                             k_cache, bind::tensor_arg("v_cache", v_cache_a),
                                             bind::tensor_arg("slots", slots_a), &unit, scales ? &*scales : nullptr);
    launch_kv_append(p, unit, bind::stream_arg(stream_a));
}

}  // namespace astrai::attn

PYBIND11_MODULE(_attn_paged_decode, m) {
    namespace py = pybind11;
    astrai::bind::init_module(m);
    m.def("attn_paged_decode", &astrai::attn::attn_paged_decode, py::arg("q"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("out"), py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("kv_lens"),
          py::arg("num_splits") = 1, py::arg("ws_o") = py::none(), py::arg("ws_lse") = py::none(),
          py::arg("stream") = 0, py::arg("ws_count") = py::none(), py::arg("pdl") = false,
          py::arg("k_new") = py::none(), py::arg("v_new") = py::none(), py::arg("slots") = py::none(),
          py::arg("append_last") = false, py::arg("variant") = py::none(), py::arg("kv_scales") = py::none(),
          "Decode attention over a paged KV cache into out (split-KV), after writing k_new / v_new\n"
          "to rows slots of the caches when given, or (append_last) to each request's last position\n"
          "in the same launch.");
    m.def("kv_append", &astrai::attn::kv_append, py::arg("k_new"), py::arg("v_new"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("slots"), py::arg("stream"), py::arg("kv_scales") = py::none(),
          "Write k_new / v_new [T, Hkv, D] or [B, L, Hkv, D] to rows slots (int64 [T]) of k_cache /\n"
          "v_cache [num_pages, page_size, Hkv, D], in one launch (quantized with kv_scales into fp8 caches).");
    m.def("decode_plan", &astrai::attn::decode_num_splits, py::arg("batch"), py::arg("kv_heads"), py::arg("group"),
          py::arg("head_dim"), py::arg("kv_len_hint"), py::arg("num_sms"), py::arg("kv_bytes") = 2,
          "Split count of a decode launch (pure function of shapes; kv_bytes 1: fp8 pages).");
    m.attr("MAX_SPLITS") = astrai::attn::kMaxDecodeSplits;
    m.attr("APPEND_LAST") = true;  // attn_paged_decode takes append_last
    m.attr("VARIANTS") = astrai::attn::variant_features();  // the `variant` argument's features
    // page dtypes read besides q's (with kv_scales)
    m.attr("KV_DTYPES") = astrai::attn::kDecodeReadsFp8 ? py::make_tuple(ASTRAI_ATTN_FP8_KV_DTYPE_NAMES) : py::tuple();
}
