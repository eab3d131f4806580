"""AstrAI's vLLM backend against vLLM's own CPU attention (CPU_ATTN) on one hand-built batch.

Both backends get the metadata their own builder makes from the same vLLM
``CommonAttentionMetadata``: a fresh prefill, two decodes and a chunked prefill (70 tokens
cached, 20 new) over a shuffled block table, GQA 4/2, head dim 64, pages of 32. Each backend
writes the same keys/values into its own cache through ``do_kv_cache_update`` (CPU_ATTN's cache
format is private to its op; AstrAI's pages view a slot-major cache filled with NaN first, so a
read of a slot nobody wrote poisons the result), then attends; the outputs must agree.

An FP8 cache is checked on keys/values that it stores exactly (rounded through FP8 at the
layer's scale first) against CPU_ATTN over a 16-bit cache of the same values: the write's
quantization, the scales and the dequantizing read must then lose nothing.
"""

from __future__ import annotations

import types

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: ci/vllm-env makes .venv-vllm, "
                                          "which runs these tests (.venv-vllm/bin/python -m pytest tests/vllm_backend)")

from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, _get_attn_isa)  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from astrai.integrations.vllm.backend import AstraiAttentionBackend  # noqa: E402
from astrai.integrations.vllm.pages import FP8_CACHE_DTYPES  # noqa: E402
from tiny_llama import save_tiny  # noqa: E402

HEADS, KV_HEADS, HEAD = 4, 2, 64
PAGE, NUM_BLOCKS = 32, 24
# (new tokens, tokens in the cache after the step) per request
BATCH = [(37, 37), (1, 50), (1, 65), (20, 90)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"))


def _config(model_dir, dtype, kv_cache_dtype):
    model = ModelConfig(model=str(model_dir), dtype=dtype, skip_tokenizer_init=True, max_model_len=512)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=PAGE, cache_dtype=kv_cache_dtype))


def _common(block_table: torch.Tensor, slots: list[list[int]]) -> CommonAttentionMetadata:
    q_lens = [q for q, _ in BATCH]
    kv_lens = [kv for _, kv in BATCH]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    slot_mapping = torch.tensor([s for req, (q, kv) in zip(slots, BATCH) for s in req[kv - q: kv]])
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        num_reqs=len(BATCH), num_actual_tokens=sum(q_lens), max_query_len=max(q_lens), max_seq_len=max(kv_lens),
        block_table_tensor=block_table, slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=torch.tensor(kv_lens, dtype=torch.int32))


def _layer(dtype, block_size, kv_cache_dtype, scale=1.0):
    s = torch.tensor(scale, dtype=torch.float32)
    return types.SimpleNamespace(_k_scale=s, _v_scale=s.clone(), _k_scale_float=scale, _v_scale_float=scale,
                                 _q_scale=torch.tensor(1.0), isa=_get_attn_isa(dtype, block_size, HEAD, kv_cache_dtype))


def _run(backend, vllm_config, spec, cache, layer, kv_cache_dtype, impl_kwargs, history, new, q,
         common):  # noqa: PLR0913
    """Write the requests' history, then the step's keys/values, then attend."""
    builder = backend.get_builder_cls()(spec, [], vllm_config, torch.device("cpu"))
    kwargs = {"sliding_window": None, "kv_cache_dtype": kv_cache_dtype, **impl_kwargs}
    alibi = kwargs.pop("alibi_slopes", None)  # vLLM passes it in place (the fifth argument)
    impl = backend.get_impl_cls()(HEADS, HEAD, HEAD ** -0.5, KV_HEADS, alibi, **kwargs)
    for k, v, slots in (history, new):
        impl.do_kv_cache_update(layer, k, v, cache, slots)
    meta = builder.build(0, common)
    out = torch.full((q.shape[0] + 3, HEADS, HEAD), float("nan"), dtype=q.dtype)  # 3 padded rows
    impl.forward(layer, q, new[0], new[1], cache, meta, out)
    return out


def _batch(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=g)  # a shuffled block table
    blocks, slots, taken = [], [], 0
    width = max(-(-kv // PAGE) for _, kv in BATCH)
    table = torch.zeros(len(BATCH), width, dtype=torch.int32)
    for b, (_, kv) in enumerate(BATCH):
        n = -(-kv // PAGE)
        mine = order[taken: taken + n]
        taken += n
        table[b, :n] = mine
        slots.append([int(mine[p // PAGE]) * PAGE + p % PAGE for p in range(kv)])
    total_q = sum(q for q, _ in BATCH)
    hist_slots = torch.tensor([s for req, (q, kv) in zip(slots, BATCH) for s in req[: kv - q]])
    randn = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    history = (randn(len(hist_slots), KV_HEADS, HEAD), randn(len(hist_slots), KV_HEADS, HEAD), hist_slots)
    common = _common(table, slots)
    new = (randn(total_q, KV_HEADS, HEAD), randn(total_q, KV_HEADS, HEAD), common.slot_mapping)
    q = randn(total_q + 3, HEADS, HEAD) * 2  # 3 padded rows past the batch, as vLLM pads
    return history, new, q, common


# name: (dtype, kv_cache_dtype, impl keywords)
CASES = {
    "fp32": (torch.float32, "auto", {}),
    "bf16": (torch.bfloat16, "auto", {}),
    "fp16": (torch.float16, "auto", {}),
    "window": (torch.float32, "auto", {"sliding_window": 24}),
    "softcap": (torch.float32, "auto", {"logits_soft_cap": 3.0}),
    "sinks": (torch.float32, "auto", {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}),
    "alibi": (torch.float32, "auto", {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}),
    "alibi_bf16": (torch.bfloat16, "auto", {"alibi_slopes": [0.3, 0.2, 0.1, 0.05]}),
    "fp8_e4m3": (torch.bfloat16, "fp8_e4m3", {}),
    "fp8_e5m2": (torch.bfloat16, "fp8_e5m2", {}),
}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
FP8_SCALE = 0.02  # k_scale = v_scale: values up to 4.5 use most of e4m3's range


def _fp8_exact(batch, kv_cache_dtype):
    """The batch with its keys/values rounded to what the FP8 cache stores at ``FP8_SCALE``, so
    the cache holds them exactly and a 16-bit reference over the same values is the answer."""
    from astrai.extension.kv_quant import dequantize, quantize

    store, scale = FP8_CACHE_DTYPES[kv_cache_dtype], torch.tensor([FP8_SCALE])
    exact = lambda x: dequantize(quantize(x, scale, store), scale, x.dtype)  # noqa: E731
    (hk, hv, hs), (nk, nv, ns), q, common = batch
    return (exact(hk), exact(hv), hs), (exact(nk), exact(nv), ns), q, common


@pytest.mark.parametrize("case", list(CASES))
def test_same_batch_as_cpu_attn(model_dir, case):
    dtype, kv_cache_dtype, impl_kwargs = CASES[case]
    fp8 = kv_cache_dtype != "auto"
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=dtype)
    history, new, q, common = _fp8_exact(_batch(dtype), kv_cache_dtype) if fp8 else _batch(dtype)
    store = torch.uint8 if fp8 else dtype  # vLLM allocates an FP8 cache as bytes
    # the reference: CPU_ATTN over a 16-bit cache (for FP8, of the values the FP8 cache holds
    # exactly: CPU_ATTN's own FP8 path computes otherwise, off by up to 0.4 on such values)
    ref_config = _config(model_dir, dtype, "auto")
    with set_current_vllm_config(ref_config):
        ref_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, PAGE, 2 * HEAD, dtype=dtype)
        ref = _run(CPUAttentionBackend, ref_config, spec, ref_cache, _layer(dtype, PAGE, "auto"), "auto",
                   impl_kwargs, history, new, q, common)
    vllm_config = _config(model_dir, dtype, kv_cache_dtype)
    layer = _layer(dtype, PAGE, kv_cache_dtype, FP8_SCALE if fp8 else 1.0)
    with set_current_vllm_config(vllm_config):
        # slot-major blocks (KVCacheLayout.LBNHC) seen through the logical [B, H, N, 2D] view
        ours_cache = torch.full((NUM_BLOCKS, PAGE, KV_HEADS, 2 * HEAD), 255 if fp8 else float("nan"),
                                dtype=store).transpose(1, 2)  # 255: NaN in e4m3 and e5m2
        out = _run(AstraiAttentionBackend, vllm_config, spec, ours_cache, layer, kv_cache_dtype, impl_kwargs,
                   history, new, q, common)
    total = common.num_actual_tokens
    assert not ref[:total].isnan().any()
    torch.testing.assert_close(out[:total].float(), ref[:total].float(), atol=TOLERANCE[dtype], rtol=0)
    assert out[total:].isnan().all()  # rows past the batch untouched


def test_alibi_needs_a_slope_per_head():
    with pytest.raises(ValueError, match=r"alibi_slopes has 3 slopes: expected one per head \(4\)"):
        AstraiAttentionBackend.get_impl_cls()(HEADS, HEAD, HEAD ** -0.5, KV_HEADS, [0.5, 0.25, 0.1])
