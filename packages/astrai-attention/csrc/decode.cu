// Module astrai_attention._attn_decode: decode over contiguous K/V (split-KV).
//
//   attn_decode(q, k, v, out, mask=None, num_splits=1, ws_o=None, ws_lse=None, stream=0,
//               ws_count=None, pdl=False)
//     q, out [B, 1, Hq, D]; k, v [B, S, Hkv, D]; mask bool [B, S] or [B, 1, S]
//     tensors are (data_ptr, shape, strides, dtype_code) tuples (ABI 1)
//   ws_count: optional int32 [>= B * Hkv * head_groups] arrival counters, all 0 (left 0):
//     with num_splits > 1 the kernel merges its own splits and no combine kernel runs
//   variant: None or (scale, logits_soft_cap, window_left, sinks) (entry_utils.h set_variant)
//   pdl: on sm_90+ also launch the split grid with programmatic dependent launch (its
//     blocks read kv_lens and the first page ids while the stream's previous kernel drains,
//     which must therefore not write them); off by default (dispatchers.cuh: faster at B=1
//     with many splits, slower at B=16 with one)
//   decode_plan(batch, q_heads, kv_heads, head_dim, kv_len_hint, num_sms) -> num_splits
#include <pybind11/pybind11.h>

#include "astrai/bind.h"
#include "dispatchers.cuh"
#include "entry_utils.h"

namespace astrai::attn {
namespace py = pybind11;

void attn_decode(py::handle q_a, py::handle k_a, py::handle v_a, py::handle out_a, py::handle mask_a,
                 int64_t num_splits, py::handle ws_o_a, py::handle ws_lse_a, py::handle stream_a,
                 py::handle ws_count_a, bool pdl, py::handle variant_a) {
    const auto [q, k, v, out] = operand_args(q_a, k_a, v_a, out_a, /*paged=*/false);
    const cudaStream_t stream = bind::stream_arg(stream_a);
    check_decode_query(q);
    const int64_t B = q.size(0), Hq = q.size(2), D = q.size(3);
    check_contiguous_kv(k, v, q, "[B, S, Hkv, D] matching q");
    const int64_t S = k.size(1), Hkv = k.size(2);
    check_heads(Hq, Hkv);
    check_output(out, q);
    ASTRAI_CHECK(S < (int64_t(1) << 31), "k: kv length ", S, " exceeds int32");

    AttentionParams p;
    set_operands(p, q, out, k, v, Hq, Hkv);
    if (!mask_a.is_none()) set_mask(p, bind::tensor_arg("mask", mask_a), B, 1, S);
    p.kv_len = int(S);
    set_decode_splits(p, num_splits, ws_o_a, ws_lse_a, ws_count_a, B, Hq, Hkv, D);
    set_variant(p, variant_a, Hq, D);
    if (B == 0) return;
    dispatch_decode<ContigKV>(p, q.dtype, int(D), stream, pdl);
}

}  // namespace astrai::attn

PYBIND11_MODULE(_attn_decode, m) {
    namespace py = pybind11;
    astrai::bind::init_module(m);
    m.def("attn_decode", &astrai::attn::attn_decode, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("mask") = py::none(), py::arg("num_splits") = 1, py::arg("ws_o") = py::none(),
          py::arg("ws_lse") = py::none(), py::arg("stream") = 0, py::arg("ws_count") = py::none(),
          py::arg("pdl") = false, py::arg("variant") = py::none(),
          "Decode attention over contiguous K/V into out (split-KV; num_splits > 1 needs ws_o/ws_lse).");
    m.def("decode_plan", &astrai::attn::decode_num_splits, py::arg("batch"), py::arg("kv_heads"), py::arg("group"),
          py::arg("head_dim"), py::arg("kv_len_hint"), py::arg("num_sms"), py::arg("kv_bytes") = 2,
          "Split count of a decode launch (pure function of shapes).");
    m.attr("MAX_SPLITS") = astrai::attn::kMaxDecodeSplits;
    m.attr("VARIANTS") = astrai::attn::variant_features();  // the `variant` argument's features
}
