"""The norm and SiLU-and-mul kernels with per-token e4m3 rows (rms_norm_fp8, silu_and_mul_fp8) on
the GPU: the bytes and scales of the 16-bit kernel followed by the per-token quantize, exactly, in
both 16-bit dtypes, on one-warp rows, register-resident rows, two-pass rows and the scalar path,
into NaN-poisoned outputs framed by guards (the e4m3 SiLU-and-mul's rows also split over clusters of
blocks on sm_90); the residual updated in place; zero and NaN rows; the
public functions taking the kernel and recording into a CUDA graph; and an FP8-weights engine at
W8A8 batch sizes giving the logits of the engine whose linears quantize their own input, to the bit.
"""

from __future__ import annotations

import pytest
import torch

from astrai.extension import explain
from astrai.extension.abi import launch, tensor_arg
from astrai.extension.backend import norm_fp8
from astrai.extension.backend.fp8_weights import quantize_per_token
from astrai.extension.ops import _plugin
from astrai.extension.ops import norm as ops_norm

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, F16 = torch.bfloat16, torch.float16
EPS = 1e-5
POISON = 0x7F  # e4m3's NaN byte
# one warp, Llama sizes, 2/4/8 accesses a thread, two passes; the scalar path
HIDDEN = [8, 128, 4096, 8192, 16384, 32768, 65536, 7, 100, 4095]
INTER = [8, 128, 4096, 14336, 28672, 65536, 7, 100]


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)


def framed_q(rows, channels, guard=16):
    frame = torch.full((rows, channels + 2 * guard), POISON, device=DEV, dtype=torch.uint8)
    return frame, frame[:, guard:guard + channels].view(torch.float8_e4m3fn)


def guards_intact(frame, guard=16):
    return bool((frame[:, :guard] == POISON).all() and (frame[:, -guard:] == POISON).all())


def nan_as_one(q):
    """e4m3 bytes with both NaN codes (0x7f, 0xff) as one: the cast's NaN keeps the sign in torch."""
    b = q.view(torch.uint8)
    return torch.where(b == 0xFF, torch.full_like(b, POISON), b)


def assert_bytes(q, scale, want_q, want_scale, what):
    assert torch.equal(scale.view(-1), want_scale.view(-1)), f"{what}: scales differ"
    diff = (nan_as_one(q) != nan_as_one(want_q)).sum().item()
    assert diff == 0, f"{what}: {diff} bytes differ from the 16-bit op then the quantize"


def special_rows(t):
    t[1] = 0.0  # scale 1, zero bytes
    if t.shape[0] > 3:
        t[3, t.shape[1] // 2] = float("nan")  # scale 1, the row NaN (a norm spreads it)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_the_norm_kernel_then_the_quantize(require_plugin, hidden, dtype, with_residual):
    require_plugin("rms_norm")
    rows = 5
    x, w = rand((rows, hidden), dtype, hidden, scale=3.0), rand((hidden,), dtype, hidden + 1)
    special_rows(x)
    residual = rand((rows, hidden), dtype, hidden + 2, scale=2.0) if with_residual else None
    frame, q = framed_q(rows, hidden)
    scale = torch.full((rows,), float("nan"), device=DEV)
    module = _plugin.require("rms_norm", x.device)
    r = residual.clone() if with_residual else None
    launch(x.device, module.rms_norm_fp8, tensor_arg(x), tensor_arg(r) if with_residual else None, tensor_arg(w),
           tensor_arg(q), tensor_arg(scale), EPS)
    if with_residual:
        torch.testing.assert_close(r, residual + x, rtol=0, atol=0, equal_nan=True)  # torch's add, NaN row too
        sixteen = ops_norm.rms_norm_unchecked(residual + x, w, EPS)
    else:
        sixteen = ops_norm.rms_norm_unchecked(x, w, EPS)
    assert guards_intact(frame)
    assert_bytes(q, scale, *quantize_per_token(sixteen), f"rms_norm_fp8 {dtype} x {hidden}")


# rows: 5 and 64 share each row of >= 256 accesses over a cluster of 4 and 2 blocks on sm_90 (every
# row of 5 x 65536 takes 2048 accesses a block, two passes); 200 rows take a block each
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("inter, rows", [(inter, 5) for inter in INTER] + [(4096, 64), (14336, 64), (14336, 200),
                                                                         (1000, 64), (65536, 33)])
def test_silu_and_mul_fp8_is_the_kernel_then_the_quantize(require_plugin, inter, rows, dtype):
    require_plugin("silu_and_mul")
    gate_up = rand((rows, 2 * inter), dtype, inter, scale=2.0)
    special_rows(gate_up)
    frame, q = framed_q(rows, inter)
    scale = torch.full((rows,), float("nan"), device=DEV)
    launch(gate_up.device, _plugin.require("silu_and_mul", gate_up.device).silu_and_mul_fp8, tensor_arg(gate_up),
           tensor_arg(q), tensor_arg(scale))
    assert guards_intact(frame)
    want_q, want_scale = quantize_per_token(ops_norm.silu_and_mul_unchecked(gate_up))
    assert_bytes(q, scale, want_q, want_scale, f"silu_and_mul_fp8 {dtype} x {inter}")


def test_the_public_functions_take_the_kernel_and_record_into_a_graph(require_plugin):
    require_plugin("rms_norm")
    x, w = rand((64, 4096), BF16, 1), rand((4096,), BF16, 2)
    residual, gate_up = rand((64, 4096), BF16, 3), rand((64, 2 * 14336), BF16, 4)
    static = [t.clone() for t in (x, residual, gate_up)]
    results = {}

    def step():
        results["norm"] = norm_fp8.add_rms_norm_fp8(static[0], None, w, EPS)[:2]
        results["add"] = norm_fp8.add_rms_norm_fp8(static[0], static[1], w, EPS)[:2]
        results["silu"] = norm_fp8.silu_and_mul_fp8(static[2])

    step()  # eager, decided once
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        assert explain(op)[-1].chosen == "cuda", explain(op)[-1]
    static[1].copy_(residual)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    static[1].copy_(residual)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static[1], residual + x)
    assert_bytes(*results["norm"], *quantize_per_token(ops_norm.rms_norm_unchecked(x, w, EPS)), "graph norm")
    assert_bytes(*results["add"], *quantize_per_token(ops_norm.rms_norm_unchecked(residual + x, w, EPS)), "graph add")
    assert_bytes(*results["silu"], *quantize_per_token(ops_norm.silu_and_mul_unchecked(gate_up)), "graph silu")


def test_an_fp8_weights_engine_at_w8a8_sizes_gives_the_unfused_logits(require_plugin, monkeypatch):
    """40 requests (W8A8 rows): the layers' fused quantize against the same engine with the
    quantize inside each linear (quantize_rows on the 16-bit norm output): the same bytes into
    the same GEMMs, so the same logits, to the bit, eager and under CUDA graphs."""
    require_plugin("rms_norm")
    require_plugin("fp8_weight_gemm")
    from astrai.serve import LLM, ModelConfig
    from astrai.serve import model as model_module
    from astrai.serve.model import DecoderModel

    config = ModelConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                         num_kv_heads=2, head_dim=64, rope_theta=10000.0, eos_token_ids=())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (40,), generator=gen)]
    runs = {}
    made = []
    real = model_module.add_rms_norm_fp8
    for fused in (False, True):
        if not fused:
            monkeypatch.setattr(model_module, "fp8_weight_route", lambda *args, **kwargs: "weight")
        else:
            monkeypatch.undo()
            monkeypatch.setattr(model_module, "add_rms_norm_fp8", lambda *args: made.append(1) or real(*args))
        llm = LLM(DecoderModel.random(config, dtype=BF16, device=DEV, seed=1), fp8_weights=True, memory_fraction=0.1)
        runs[fused] = llm.generate(prompts, max_new_tokens=4, return_logits=True)
        del llm
        torch.cuda.empty_cache()
    assert made, "the fused quantize never ran"
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a, b)
