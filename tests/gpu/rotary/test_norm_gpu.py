"""The astrai-elementwise norm kernels on the GPU: rms_norm, fused_add_rms_norm and silu_and_mul
against float64 references (within one rounding of the result past float32 arithmetic)
and against the torch path (the unfused engine's ops), in the three dtypes, over hidden
sizes from one warp to two-pass rows (8 .. 65536 channels), on the vector and the scalar
path (odd sizes, misaligned rows), with NaN-poisoned outputs framed by guards, in place;
on top: the public functions take the kernel, CUDA-graph capture, and the engine's logits
with the fused layer against a float32 run, beside the unfused layer's.
"""

from __future__ import annotations

import pytest
import torch

from astrai.extension import explain, fused_add_rms_norm, rms_norm, silu_and_mul
from astrai.extension.backend.norm_torch import fused_add_rms_norm_torch, rms_norm_torch, silu_and_mul_torch
from astrai.extension.ops import norm as ops_norm

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [F32, F16, BF16]
ULP = {F32: 2.0**-23, F16: 2.0**-10, BF16: 2.0**-7}
TINY = {F32: 2.0**-125, F16: 2.0**-23, BF16: 2.0**-125}  # two roundings in the subnormal range (float16's is wide)
EPS = 1e-5
MATH = 2.0**-16  # float32 arithmetic: the sum of squares' order, rsqrt, exp (relative)
# one warp, Llama sizes, register-resident 2/4/8 accesses a thread, two passes
HIDDEN = [8, 128, 4096, 5120, 8192, 16384, 32768, 65536]
ODD = [7, 100, 4095, 12289]  # the scalar path


def rand(shape, dtype, seed, scale=1.0, offset=0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale + offset).to(dtype)


def framed(rows, hidden, dtype, guard=16):
    """A NaN-filled [rows, hidden + 2 guard] buffer and the [rows, hidden] view between its guards."""
    frame = torch.full((rows, hidden + 2 * guard), float("nan"), device=DEV, dtype=dtype)
    return frame, frame[:, guard:guard + hidden]


def guards_intact(frame, guard=16):
    return bool(torch.isnan(frame[:, :guard]).all() and torch.isnan(frame[:, -guard:]).all())


def norm_ref(s64: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return s64 * (s64.pow(2).mean(-1, keepdim=True) + EPS).rsqrt() * w.double()


def check_close(got, want64, dtype, what, tiny_scale=1.0):
    """|got - want| <= (3 roundings + float32 arithmetic) x |want| (+ the subnormal spacing)
    element-wise: the result rounds twice in transformers' order, the statistics in float32;
    ``tiny_scale``: what multiplies a first rounding's subnormal error (SiLU-and-mul: up)."""
    got64 = got.double()
    assert not torch.isnan(got64).any(), f"{what}: unwritten (NaN-poisoned) elements"
    bound = want64.abs() * (3 * ULP[dtype] + MATH) + TINY[dtype] * tiny_scale
    excess = ((got64 - want64).abs() - bound).max().item()
    assert excess <= 0, f"{what}: beyond rounding by {excess:.3g}"


def direct(x, residual, w, out):
    """The compiled entry points themselves, on raw views (framed outputs)."""
    from astrai.extension.abi import launch, tensor_arg
    from astrai.extension.ops import _plugin

    module = _plugin.require("rms_norm", x.device)
    if residual is None:
        launch(x.device, module.rms_norm, tensor_arg(x), tensor_arg(w), tensor_arg(out), EPS)
    else:
        launch(x.device, module.fused_add_rms_norm, tensor_arg(x), tensor_arg(residual), tensor_arg(w),
               tensor_arg(out), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN + ODD)
def test_rms_norm_matches_float64_and_the_torch_path(require_plugin, hidden, dtype):
    require_plugin("rms_norm")
    rows = 5
    x, w = rand((rows, hidden), dtype, hidden, scale=3.0, offset=0.5), rand((hidden,), dtype, hidden + 1)
    frame, out = framed(rows, hidden, dtype)
    direct(x, None, w, out)
    assert guards_intact(frame)
    check_close(out, norm_ref(x.double(), w), dtype, f"rms_norm {dtype} x {hidden}")
    # the same roundings as the torch ops: they differ in the sum's order and rsqrt only
    check_close(out, rms_norm_torch(x, w, EPS).double(), dtype, f"rms_norm {dtype} x {hidden} vs torch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN + ODD)
def test_fused_add_rms_norm_writes_the_sum_and_the_norm(require_plugin, hidden, dtype):
    require_plugin("fused_add_rms_norm")
    rows = 4
    x, w = rand((rows, hidden), dtype, 2 * hidden, scale=2.0), rand((hidden,), dtype, 2 * hidden + 1)
    res_frame, residual = framed(rows, hidden, dtype)
    residual.copy_(rand((rows, hidden), dtype, 2 * hidden + 2, scale=4.0))
    r0 = residual.clone()
    want_sum = residual + x  # one rounding in the dtype, as the kernel rounds
    out_frame, out = framed(rows, hidden, dtype)
    direct(x, residual, w, out)
    assert guards_intact(res_frame) and guards_intact(out_frame)
    assert torch.equal(residual, want_sum), "residual += x differs from torch's add"
    check_close(out, norm_ref(want_sum.double(), w), dtype, f"fused {dtype} x {hidden}")
    # in place, through the public function
    xi, ri = x.clone(), r0
    got, res = fused_add_rms_norm(xi, ri, w, EPS)
    assert got is xi and res is ri
    torch.testing.assert_close(xi, out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_and_strided_rows_take_the_scalar_path(require_plugin, dtype):
    require_plugin("rms_norm")
    hidden = 4096
    base = rand((3, hidden + 1), dtype, 11)
    x = base[:, 1:]  # every row one element past 16 bytes
    w = rand((hidden,), dtype, 12)
    out = rms_norm(x, w, EPS)
    check_close(out, norm_ref(x.double(), w), dtype, "misaligned")
    assert "cuda" == explain("rms_norm")[-1].chosen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [8, 14336, 1000, 7])
def test_silu_and_mul_matches_float64_and_the_torch_path(require_plugin, inter, dtype):
    require_plugin("silu_and_mul")
    rows = 6
    gate_up = rand((rows, 2 * inter), dtype, inter, scale=4.0)
    gate_up[0, :1] = -100.0  # exp overflows: silu is -0, never NaN
    frame, out = framed(rows, inter, dtype)
    from astrai.extension.abi import launch, tensor_arg
    from astrai.extension.ops import _plugin

    launch(gate_up.device, _plugin.require("silu_and_mul", gate_up.device).silu_and_mul, tensor_arg(gate_up),
           tensor_arg(out))
    assert guards_intact(frame)
    g64, u64 = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    # the subnormal term twice: float16's products of a tiny SiLU and up round in the subnormal range
    check_close(out, g64 * torch.sigmoid(g64) * u64, dtype, f"silu_and_mul {dtype} x {inter}", 2 * (1 + u64.abs()))
    check_close(out, silu_and_mul_torch(gate_up).double(), dtype, f"silu_and_mul {dtype} x {inter} vs torch",
                2 * (1 + u64.abs()))


def test_the_public_functions_take_the_kernels(require_plugin):
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        require_plugin(op)
    x, w = rand((2, 3, 4096), BF16, 1), rand((4096,), BF16, 2)
    rms_norm(x, w, EPS)
    fused_add_rms_norm(x.clone(), x.clone(), w, EPS)
    silu_and_mul(x)
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        assert explain(op)[-1].chosen == "cuda", explain(op)[-1]


def test_cuda_graph_replays_the_three_ops(require_plugin):
    require_plugin("fused_add_rms_norm")
    x, r, w = rand((16, 4096), BF16, 3), rand((16, 4096), BF16, 4), rand((4096,), BF16, 5)
    gu = rand((16, 2 * 14336), BF16, 6)
    sx, sr = x.clone(), r.clone()

    def step():
        h, _ = ops_norm.fused_add_rms_norm(sx, sr, w, EPS)
        return ops_norm.rms_norm(h, w, EPS), ops_norm.silu_and_mul(gu)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    sx.copy_(x)
    sr.copy_(r)
    graph.replay()
    torch.cuda.synchronize()
    want_x, want_r = fused_add_rms_norm_torch(x.clone(), r.clone(), w, EPS)
    torch.testing.assert_close(sr, want_r, rtol=0, atol=0)
    torch.testing.assert_close(sx, want_x, rtol=2 * ULP[BF16], atol=0)
    torch.testing.assert_close(outs[0], rms_norm_torch(sx, w, EPS), rtol=2 * ULP[BF16], atol=1e-6)
    torch.testing.assert_close(outs[1], silu_and_mul_torch(gu), rtol=2 * ULP[BF16], atol=1e-6)


def test_engine_logits_with_the_fused_layer_are_as_accurate_as_the_torch_path(monkeypatch, require_plugin):
    """Two layers of Llama-3-8B's shape in bf16: the prefill logits with the kernels are as
    close to a float32 run of the same weights as those of the torch path (the unfused ops);
    the decode steps replay from CUDA graphs with the kernels inside."""
    from astrai.serve import LLM
    from astrai.serve import model as model_module
    from astrai.serve.model import DecoderModel

    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        require_plugin(op)
    prompts = [[128000, 791, 6864, 315, 9822, 374, 12366], [128000, 40, 1093, 311]]
    llm = LLM.from_preset("llama3-8b", num_layers=2, dtype=BF16, device=DEV, seed=0)
    reference = DecoderModel(llm.config, dtype=F32, device=DEV)
    reference.load_state_dict(llm.model.state_dict())
    _, want = LLM(reference, memory_fraction=0.1).generate(prompts, max_new_tokens=1, return_logits=True)
    del reference
    torch.cuda.empty_cache()

    def error(logits):
        return max(((a[0] - b[0]).norm() / b[0].norm()).item() for a, b in zip(logits, want))

    tokens, fused = llm.generate(prompts, max_new_tokens=8, return_logits=True)
    assert llm.graphs_off_reason is None and all(len(t) == 8 for t in tokens)
    assert all(torch.isfinite(t).all() for t in fused)
    with monkeypatch.context() as m:
        m.setattr(model_module, "rms_norm", rms_norm_torch)
        m.setattr(model_module, "fused_add_rms_norm", fused_add_rms_norm_torch)
        m.setattr(model_module, "silu_and_mul", silu_and_mul_torch)
        _, unfused = llm.generate(prompts, max_new_tokens=1, return_logits=True)
    assert error(fused) <= 1.25 * error(unfused) + 1e-3, (error(fused), error(unfused))
