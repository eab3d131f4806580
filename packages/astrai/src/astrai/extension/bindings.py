"""The compiled modules' entry points and their arguments, each stated once.

A ``Binding`` names an entry point's arguments in the order the plugin's pybind11 ``m.def``
takes them (its ``py::arg`` list): ``required`` first, then ``optional`` (those with a
default in the binding). The ops wrappers pass them positionally, the stream where
``stream`` stands (``abi.launch`` appends it), and the optional ones after it by keyword
(``variant=``, ``kv_scales=``, ``kv_bytes=``) or positionally in this order.

``tests/core/test_bindings.py`` holds the plugins' ``m.def`` lists (``packages/*/csrc/*.cu``) and
the tests' fake modules (``tests/helpers/fakes.py``) to this table, so a renamed, added or moved
argument fails a test on the CPU. An entry point of the same name in two modules
(``decode_plan``, ``prefill_plan``) takes the same arguments in both.
"""

from __future__ import annotations

from typing import NamedTuple


class Binding(NamedTuple):
    """An entry point's arguments, in the binding's order: ``required``, then ``optional``."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()

    @property
    def args(self) -> tuple[str, ...]:
        return self.required + self.optional


# entry point -> its arguments; the compiled module and the .cu file in the comments
BINDINGS: dict[str, Binding] = {
    # astrai-attention: _attn_decode (csrc/decode.cu)
    "attn_decode": Binding(("q", "k", "v", "out"),
                           ("mask", "num_splits", "ws_o", "ws_lse", "stream", "ws_count", "pdl", "variant")),
    # _attn_decode and _attn_paged_decode
    "decode_plan": Binding(("batch", "kv_heads", "group", "head_dim", "kv_len_hint", "num_sms"), ("kv_bytes",)),
    # _attn_prefill (csrc/prefill.cu)
    "attn_prefill": Binding(("q", "k", "v", "out"), ("mask", "is_causal", "stream", "variant")),
    # _attn_prefill and _attn_paged_prefill
    "prefill_plan": Binding(("q_heads", "kv_heads", "head_dim")),
    # _attn_paged_decode (csrc/paged_decode.cu)
    "attn_paged_decode": Binding(("q", "k_cache", "v_cache", "out", "kv_indptr", "kv_indices", "kv_lens"),
                                 ("num_splits", "ws_o", "ws_lse", "stream", "ws_count", "pdl", "k_new", "v_new",
                                  "slots", "append_last", "variant", "kv_scales")),
    "kv_append": Binding(("k_new", "v_new", "k_cache", "v_cache", "slots", "stream"), ("kv_scales",)),
    # _attn_paged_prefill (csrc/paged_prefill.cu)
    "attn_paged_prefill": Binding(("q", "k_cache", "v_cache", "out", "qo_indptr", "kv_indptr", "kv_indices",
                                   "kv_lens", "q_tile_to_batch", "q_tile_to_index"),
                                  ("is_causal", "stream", "variant", "kv_scales")),
    "gather_pages": Binding(("k_cache", "v_cache", "source", "k_out", "v_out", "stream"), ("kv_scales",)),
    # astrai-elementwise: _rotary_emb (csrc/rotary_emb.cu)
    "rotary": Binding(("q", "k", "cos", "sin", "positions", "q_out", "k_out", "interleaved", "inverse", "stream")),
    "rope_paged_append": Binding(("q", "k", "v", "k_cache", "v_cache", "cos", "sin", "positions", "slots", "q_out",
                                  "interleaved", "stream"), ("kv_scales",)),
    "rotary_emb": Binding(("x", "cos", "sin", "out", "stream")),
    # _rotary_emb (csrc/norm.cu)
    "rms_norm": Binding(("x", "weight", "out", "eps", "stream")),
    "fused_add_rms_norm": Binding(("x", "residual", "weight", "out", "eps", "stream")),
    "silu_and_mul": Binding(("gate_up", "out", "stream")),
    "rms_norm_fp8": Binding(("x", "residual", "weight", "q", "scale", "eps", "stream")),
    "silu_and_mul_fp8": Binding(("gate_up", "q", "scale", "stream")),
    "norm_launch": Binding(("hidden", "dtype_code", "vector")),
    # astrai-fp8: _fp8_ops (csrc/ops.cu)
    "quantize": Binding(("x", "scale", "q", "q_t", "amax", "out_layout", "stream")),
    "gemm": Binding(("a", "b", "scale", "bias", "out", "trans_a", "trans_b", "stream"), ("mainloop",)),
    "scale_update": Binding(("hist", "pending", "prev_scale", "scale", "scale_inv", "factor", "most_recent",
                             "stream")),
    "weight_gemm": Binding(("x", "w", "w_scale", "y", "ws", "k_per_split", "stream")),
    "weight_gemm_plan": Binding(("n", "k", "sms")),
    "quantize_rows": Binding(("x", "q", "scale", "stream")),
    "gemm_rowwise": Binding(("a", "b", "a_scale", "b_scale", "out", "stream")),
    "plan": Binding(("m", "n", "k", "trans_a", "trans_b", "sms", "smem_per_sm", "smem_per_block")),
}
