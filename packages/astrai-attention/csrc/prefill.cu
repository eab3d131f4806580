// Module astrai_attention._attn_prefill: prefill over contiguous K/V (split-Q).
//
//   attn_prefill(q, k, v, out, mask=None, is_causal=False, stream=0, variant=None)
//     q, out [B, Lq, Hq, D]; k, v [B, Lkv, Hkv, D]; mask bool [B, Lkv] or [B, Lq, Lkv];
//     causal is bottom-right aligned: row i sees kv j <= i + Lkv - Lq
//   variant: None or (scale, logits_soft_cap, window_left, sinks) (entry_utils.h set_variant)
//   prefill_plan(q_heads, kv_heads, head_dim) -> (head_block, head_groups, warps, blocks_per_tile)
#include <pybind11/pybind11.h>

#include "astrai/bind.h"
#include "dispatchers.cuh"
#include "entry_utils.h"

namespace astrai::attn {
namespace py = pybind11;

void attn_prefill(py::handle q_a, py::handle k_a, py::handle v_a, py::handle out_a, py::handle mask_a,
                  bool is_causal, py::handle stream_a, py::handle variant_a) {
    const auto [q, k, v, out] = operand_args(q_a, k_a, v_a, out_a, /*paged=*/false);
    const cudaStream_t stream = bind::stream_arg(stream_a);
    check_query(q, 4);
    const int64_t B = q.size(0), Lq = q.size(1), Hq = q.size(2), D = q.size(3);
    check_contiguous_kv(k, v, q, "[B, Lkv, Hkv, D] matching q");
    const int64_t Lkv = k.size(1), Hkv = k.size(2);
    ASTRAI_CHECK(Lq < (int64_t(1) << 31) && Lkv < (int64_t(1) << 31), "q: sequence lengths must fit int32");
    check_heads(Hq, Hkv);
    check_output(out, q);

    AttentionParams p;
    set_operands(p, q, out, k, v, Hq, Hkv);
    if (!mask_a.is_none()) set_mask(p, bind::tensor_arg("mask", mask_a), B, Lq, Lkv);
    p.batch = int(B); p.q_len = int(Lq); p.kv_len = int(Lkv);
    p.causal = is_causal;
    set_variant(p, variant_a, Hq, D);
    const int64_t tiles = num_q_tiles(Lq);
    set_prefill_heads(p, tiles, Hkv, B);
    if (B == 0 || Lq == 0) return;
    dispatch_prefill<DenseQSchedule, ContigKV>(p, q.dtype, int(D), unsigned(tiles), unsigned(B), stream);
}

}  // namespace astrai::attn

PYBIND11_MODULE(_attn_prefill, m) {
    namespace py = pybind11;
    astrai::bind::init_module(m);
    m.def("attn_prefill", &astrai::attn::attn_prefill, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("mask") = py::none(), py::arg("is_causal") = false, py::arg("stream") = 0,
          py::arg("variant") = py::none(),
          "Prefill attention over contiguous K/V into out (split-Q, GQA head packing).");
    m.def("prefill_plan", &astrai::attn::prefill_plan, py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"),
          "(head_block, head_groups, warps, blocks_per_tile) of an mma prefill launch.");
    m.attr("Q_TILE_ROWS") = astrai::attn::kQTileRows;
    m.attr("VARIANTS") = astrai::attn::variant_features();  // the `variant` argument's features
}
