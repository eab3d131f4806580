"""The astrai-fp8 kernels on a CUDA device (sm_89+), against torch / float64 references.

Quantize: FP8 bytes bit-exact against torch's own saturating cast of ``x.float() * scale``
and amax exact, over input dtypes, formats, out_layouts, ragged and strided inputs.
GEMM: ``scale * op(a) @ op(b) + bias`` against a float64 reference, every element within
bf16 rounding (``checks.gemm_mismatch``), with ``scale ~ 1/sqrt(K)`` so the GEMM term
dominates the bias, over the four operand layouts, M in {1, 16, 128, 1024, 4096}, LLM
N x K shapes, odd sizes and K tails, bias on/off, e4m3 / e5m2 / mixed. Outputs are poisoned with NaN before the kernel writes them (the
compiled module is called directly for that, with ``mainloop="mma_sync"`` so the
mma.sync kernel is the one tested even on Hopper, where the public op prefers the wgmma
kernel for K-major operands) and must come back NaN-free. On sm_90 the mma.sync kernel
is the fp16 emulation: correct, slower than cuBLASLt.
Scale update (``module.scale_update``, delayed scaling's end of step): bit for bit the
torch ops it replaces, with zeros, inf, NaN and subnormals, through the ABI directly.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from checks import assert_gemm_close
from gemm_inputs import linear_operands, linear_reference

pytestmark = pytest.mark.gpu

FMT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


@pytest.fixture(scope="module")
def ops():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need sm_89+")
    from astrai.extension.ops import fp8

    return fp8


@pytest.fixture(scope="module")
def module(ops):
    from astrai.extension.ops import _plugin

    return _plugin.require("fp8_gemm", torch.device("cuda"))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


# ----------------------------------------------------------------------------- quantize
def _torch_quantize(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    lim = FP8_MAX[fmt]
    return (x.float() * torch.tensor(scale, device=x.device)).clamp(-lim, lim).to(FMT[fmt])


QUANT_SHAPES = [(1, 8), (33, 7), (257, 1000), (64, 4096), (1024, 1536), (4096, 4104)]


@pytest.mark.parametrize("shape", QUANT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", [0, 1, 2])
def test_quantize_bit_exact(ops, shape, dtype, fmt, layout):
    g = _gen(zlib.crc32(repr((shape, dtype, fmt, layout)).encode()))
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype)
    amax_ref = x.float().abs().amax()
    scale = float(FP8_MAX[fmt] / amax_ref * 1.3)  # some values saturate
    s = torch.tensor(scale, device="cuda", dtype=torch.float32)
    q, q_t, amax = ops.fp8_quantize(x, s, fmt, layout)
    ref = _torch_quantize(x, scale, fmt).view(torch.uint8)
    assert amax.item() == amax_ref.item()
    if layout != 1:
        assert q.dtype == FMT[fmt] and q.shape == shape
        assert torch.equal(q.view(torch.uint8), ref)
    else:
        assert q.numel() == 0
    if layout != 0:
        assert q_t.dtype == FMT[fmt] and q_t.shape == (shape[1], shape[0]) and q_t.is_contiguous()
        assert torch.equal(q_t.view(torch.uint8), ref.t())
    else:
        assert q_t.numel() == 0


@pytest.mark.parametrize("layout", [0, 2])
def test_quantize_strided_rows_and_specials(ops, layout):
    g = _gen(7)
    wide = torch.randn(300, 1030, device="cuda", generator=g).to(torch.bfloat16)
    x = wide[:, 3:1003]  # row stride 1030, unaligned start
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), -float("inf"), 0.0
    s = torch.tensor(100.0, device="cuda")
    q, q_t, amax = ops.fp8_quantize(x, s, "e4m3", layout)
    ref = _torch_quantize(x, 100.0, "e4m3").view(torch.uint8)
    assert torch.equal(q.view(torch.uint8), ref)
    if layout == 2:
        assert torch.equal(q_t.view(torch.uint8), ref.t())
    assert amax.item() == float("inf")


def test_quantize_wrapper(ops):
    x = torch.randn(128, 256, device="cuda", generator=_gen(3), dtype=torch.bfloat16)
    q, amax = ops.quantize(x, torch.tensor(2.0, device="cuda"), "e5m2")
    assert torch.equal(q.view(torch.uint8), _torch_quantize(x, 2.0, "e5m2").view(torch.uint8))
    assert amax.item() == x.float().abs().max().item()


# ----------------------------------------------------------------------------- gemm
def _operands(m, n, k, fa, fb, seed):
    g = _gen(seed)
    a = (torch.randn(m, k, device="cuda", generator=g) * 2).to(FMT[fa])
    b = (torch.randn(k, n, device="cuda", generator=g) * 2).to(FMT[fb])
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    return a, b, bias


def _reference(a, b, scale, bias):
    out = (a.double() @ b.double()) * scale
    return out + bias.double() if bias is not None else out


def _abi(t):
    from astrai.extension.abi import dtype_code

    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype_code(t)


def _poisoned_gemm(module, a_st, b_st, scale, bias, trans_a, trans_b, m, n, mainloop="mma_sync"):
    """The compiled op on a NaN-filled output; mainloop="mma_sync" keeps the kernel under
    test even where a native Hopper kernel would take the call."""
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    module.gemm(_abi(a_st), _abi(b_st), _abi(scale), None if bias is None else _abi(bias), _abi(out),
                trans_a, trans_b, torch.cuda.current_stream().cuda_stream, mainloop=mainloop)
    torch.cuda.synchronize()
    return out


LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]
SHAPES = [(1, 64, 64), (16, 256, 512), (77, 33, 65), (128, 128, 128), (200, 136, 1000),
          (1088, 1088, 1088), (640, 384, 2056), (129, 1025, 1040)]


@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_layouts_ragged_poisoned(module, trans_a, trans_b, m, n, k):
    a, b, bias = _operands(m, n, k, "e4m3", "e4m3", m * 7 + n * 3 + k + trans_a * 2 + trans_b)
    scale = torch.tensor(0.37 / k**0.5, device="cuda")
    a_st = a.t().contiguous() if trans_a else a
    b_st = b.t().contiguous() if trans_b else b
    use_bias = bias if (m + n) % 2 == 0 else None
    out = _poisoned_gemm(module, a_st, b_st, scale, use_bias, trans_a, trans_b, m, n)
    assert_gemm_close(out, _reference(a, b, scale.item(), use_bias), f"{m}x{n}x{k} trans {trans_a}/{trans_b}")


@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2"), ("e5m2", "e4m3")])
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
def test_gemm_formats(module, fa, fb, trans_a, trans_b):
    m, n, k = 300, 200, 192
    a, b, bias = _operands(m, n, k, fa, fb, 11)
    scale = torch.tensor(0.1, device="cuda")  # ~1/sqrt(k): the GEMM term dominates the bias
    a_st = a.t().contiguous() if trans_a else a
    b_st = b.t().contiguous() if trans_b else b
    out = _poisoned_gemm(module, a_st, b_st, scale, bias, trans_a, trans_b, m, n)
    assert_gemm_close(out, _reference(a, b, scale.item(), bias), f"{fa} x {fb} trans {trans_a}/{trans_b}")


LLM_NK = [(8192, 8192), (28672, 8192), (8192, 28672), (10240, 8192)]


# M = 4096 only with the 8192 x 8192 weight (the larger ones add time, not coverage).
LLM_CASES = [(m, n, k) for m in (1, 16, 128, 1024, 4096) for n, k in LLM_NK
             if m < 4096 or (n, k) == (8192, 8192)]


@pytest.mark.parametrize("m,n,k", LLM_CASES)
def test_gemm_llm_shapes(ops, module, m, n, k):
    """x [M, K] @ w.t() with w a row-major [N, K] weight: the linear-layer call, through the
    mma.sync kernel and through the public op (whichever kernel it picks on this GPU).
    scale = 1/sqrt(K) keeps the GEMM term ~4x the bias, so a dropped K tile or a wrong
    scale moves every element by far more than bf16 rounding (tests/core/test_gpu_checks.py)."""
    x, w, bias, scale = linear_operands(m, n, k, zlib.crc32(repr(("llm", m, n, k)).encode()))
    ref = linear_reference(x, w, scale.item(), bias)
    ours = _poisoned_gemm(module, x, w, scale, bias, False, True, m, n)
    assert_gemm_close(ours, ref, f"mma.sync {m}x{n}x{k}")
    out = ops.mm_fp8(x, w.t(), scale, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_gemm_close(out, ref, f"mm_fp8 {m}x{n}x{k}")


def test_mm_fp8_reads_transposes_off_strides(ops):
    m, n, k = 96, 160, 224
    a, b, bias = _operands(m, n, k, "e4m3", "e4m3", 5)
    scale = torch.tensor(0.07, device="cuda")
    ref = _reference(a, b, scale.item(), bias)
    for aa in (a, a.t().contiguous().t()):
        for bb in (b, b.t().contiguous().t()):
            assert_gemm_close(ops.mm_fp8(aa, bb, scale, bias), ref, f"strides {aa.stride()} {bb.stride()}")
    # neither rows nor columns contiguous: copied first
    big = torch.zeros(2 * m, 2 * k, device="cuda", dtype=torch.float8_e4m3fn)
    big[::2, ::2] = a
    assert_gemm_close(ops.mm_fp8(big[::2, ::2], b, scale, bias), ref, "strided rows and columns")


def test_gemm_under_cuda_graph_and_compile(ops):
    m, n, k = 256, 512, 384
    a, b, bias = _operands(m, n, k, "e4m3", "e4m3", 9)
    scale = torch.tensor(0.05, device="cuda")
    ref = _reference(a, b, scale.item(), bias)
    ops.mm_fp8(a, b, scale, bias)  # load the module outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.mm_fp8(a, b, scale, bias)
    graph.replay()
    torch.cuda.synchronize()
    assert_gemm_close(out, ref, "graph replay")
    # aot_eager: dynamo + the fake implementation, without inductor's code generation
    compiled = torch.compile(lambda x, y: ops.fp8_gemm(x, y, scale, bias), fullgraph=True,
                             backend="aot_eager")
    assert_gemm_close(compiled(a, b), ref, "torch.compile")


def test_bad_arguments_raise_before_launch(ops):
    a = torch.randn(64, 64, device="cuda").to(torch.float8_e4m3fn)
    s = torch.tensor(1.0, device="cuda")
    with pytest.raises(TypeError, match="a must be float8"):
        ops.fp8_gemm(a.float(), a, s)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        ops.fp8_gemm(a, a[:32], s)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.fp8_gemm(a, a, s, torch.zeros(3, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="scale must be a float32"):
        ops.fp8_gemm(a, a, torch.ones(2, device="cuda"))
    with pytest.raises(ValueError, match="out_layout"):
        ops.fp8_quantize(torch.randn(4, 4, device="cuda"), s, "e4m3", 3)


# ----------------------------------------------------------------------------- scale update
# module.scale_update: delayed scaling's end of step in one kernel, bit for bit the torch ops
# the core ran before (the reference below). Rows by r % 7 as in csrc/tests/fp8_test.cu:
# 0 clean; 1 pending 0 / inf / NaN; 2 NaN or inf inside the kept window; 3 all zero; 4 a
# huge value or NaN in the slot that drops out; 5 +0.0 / -0.0 history; 6 subnormals.
POISON = 0x7FA5A5A5  # a NaN the kernel never writes


def _torch_scale_update(hist, pending, prev, factor, most_recent):
    rows, length = pending.numel(), hist.shape[-1]
    full = torch.cat((pending.view(rows, 1), hist.reshape(rows, length)[:, :-1]), 1)
    amax = pending.view(rows) if most_recent else full.amax(1)
    usable = amax.nan_to_num(0.0, 0.0)
    s = torch.where(usable > 0, usable * factor, prev.view(rows))
    return full, s, s.reciprocal()


def _bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _history_case(rows, length, seed, subnormal=True):
    g = torch.Generator().manual_seed(seed)
    hist = torch.exp2(torch.rand(rows, length, generator=g) * 40 - 20)
    pending = torch.exp2(torch.rand(rows, generator=g) * 40 - 20)
    prev = torch.exp2(torch.rand(rows, generator=g) * 10 - 5)
    inf, nan = float("inf"), float("nan")
    for r in range(rows):
        mode = r % 7
        if mode == 1:
            pending[r] = (0.0, inf, nan)[r % 3]
        elif mode == 2 and length > 1:
            hist[r, int(torch.randint(length - 1, (1,), generator=g))] = nan if r % 2 else inf
        elif mode == 3:
            hist[r], pending[r] = 0.0, 0.0
        elif mode == 4:
            hist[r, -1] = nan if r % 2 else 3.0e38
        elif mode == 5:
            hist[r] = torch.tensor([-0.0 if i % 2 else 0.0 for i in range(length)])
        elif mode == 6 and subnormal:
            if r % 2:  # nothing usable: prev, a subnormal whose reciprocal is finite
                hist[r], pending[r] = 0.0, 0.0
            else:  # subnormal amaxes: amax * factor underflows, 1 / scale overflows
                hist[r] = _bits((1 + torch.randint(length, (length,), generator=g) * 977).tolist())
                pending[r] = _bits([0x100 + r])[0]
            prev[r] = _bits([0x400000 + r * 12345])[0]
    return hist.cuda(), pending.cuda(), prev.cuda()


def _poisoned(n: int) -> torch.Tensor:
    return torch.full((n,), POISON, dtype=torch.int32, device="cuda").view(torch.float32)


def _run_scale_update(module, hist, pending, prev, scale, inv, factor, most_recent):
    module.scale_update(_abi(hist), _abi(pending), _abi(prev), _abi(scale), _abi(inv), factor, most_recent,
                        torch.cuda.current_stream().cuda_stream)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32))


FACTORS = [1.0 / 448.0, 2.0**3 / 57344.0]


@pytest.mark.parametrize("alias", [False, True], ids=["prev", "prev_is_scale"])
@pytest.mark.parametrize("most_recent", [False, True], ids=["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 2, 16, 31, 128, 129, 1024, 1500])
@pytest.mark.parametrize("rows", [1, 300])
def test_scale_update_bit_identical_to_torch(module, rows, length, most_recent, alias):
    hist, pending, prev = _history_case(rows, length, rows * 10007 + length * 3 + most_recent * 2 + alias)
    factor = FACTORS[most_recent ^ alias]
    want_hist, want_scale, want_inv = _torch_scale_update(hist, pending, prev, factor, most_recent)
    scale = prev.clone() if alias else _poisoned(rows)
    inv = _poisoned(rows)
    _run_scale_update(module, hist, pending, scale if alias else prev, scale, inv, factor, most_recent)
    torch.cuda.synchronize()
    assert _same_bits(hist, want_hist)
    assert _same_bits(pending, torch.zeros_like(pending))
    assert _same_bits(scale, want_scale)
    assert _same_bits(inv, want_inv)


def test_scale_update_batched_shape_and_consecutive_steps(module):
    """hist [S, R, L] as the core stacks role groups; four steps on the same tensors
    (prev is scale) against the reference run step by step."""
    hist, _, prev = _history_case(3 * 50, 24, 99, subnormal=False)
    hist, scale = hist.view(3, 50, 24), prev.view(3, 50)
    ref_hist, ref_scale = hist.clone(), scale.clone()
    inv = _poisoned(150).view(3, 50)
    g = _gen(5)
    for step in range(4):
        pending = torch.rand(3, 50, device="cuda", generator=g) * 10.0**step
        pending[0, step] = (0.0, float("nan"), float("inf"), 0.0)[step]
        full, ref_s, ref_inv = _torch_scale_update(ref_hist, pending, ref_scale, FACTORS[0], False)
        ref_hist, ref_scale = full.view(3, 50, 24), ref_s.view(3, 50)
        _run_scale_update(module, hist, pending, scale, scale, inv, FACTORS[0], False)
        torch.cuda.synchronize()
        assert _same_bits(hist, ref_hist) and _same_bits(scale, ref_scale) and _same_bits(inv, ref_inv), step
        assert not pending.any()


def test_scale_update_under_cuda_graph(module):
    hist, pending, prev = _history_case(40, 16, 3, subnormal=False)
    scale, inv = prev.clone(), _poisoned(40)
    _run_scale_update(module, hist, pending, scale, scale, inv, FACTORS[1], False)  # warm up
    ref_hist, ref_scale = hist.clone(), scale.clone()
    graph = torch.cuda.CUDAGraph()
    step = torch.empty(40, device="cuda")
    with torch.cuda.graph(graph):
        _run_scale_update(module, hist, step, scale, scale, inv, FACTORS[1], False)
    for i in range(3):
        amaxes = torch.rand(40, device="cuda", generator=_gen(i)) * (i + 1)
        step.copy_(amaxes)
        graph.replay()
        full, ref_s, ref_inv = _torch_scale_update(ref_hist, amaxes, ref_scale, FACTORS[1], False)
        ref_hist, ref_scale = full, ref_s
        torch.cuda.synchronize()
        assert _same_bits(hist, ref_hist) and _same_bits(scale, ref_scale) and _same_bits(inv, ref_inv), i
        assert not step.any()


def test_scale_update_bad_arguments_raise_before_launch(module):
    rows, length = 8, 16
    hist, pending, prev = _history_case(rows, length, 1, subnormal=False)
    scale, inv = _poisoned(rows), _poisoned(rows)
    ok = dict(hist=hist, pending=pending, prev=prev, scale=scale, inv=inv)
    before = {k: v.clone() for k, v in ok.items()}
    bad = {
        "hist dtype": (dict(hist=hist.half()), r"hist: expected dtype float32, got float16"),
        "hist strided": (dict(hist=hist.t()), r"hist: must be contiguous"),
        "pending numel": (dict(pending=pending[:7]), r"pending: expected 8 elements"),
        "prev dtype": (dict(prev=prev.to(torch.int32)), r"prev_scale: expected dtype float32"),
        "scale strided": (dict(scale=torch.zeros(2 * rows, device="cuda")[::2]), r"scale: must be contiguous"),
        "inv overlaps scale": (dict(inv=scale), r"scale_inv: overlaps scale"),
        "prev overlaps pending": (dict(prev=pending), r"prev_scale: overlaps pending"),
    }
    for name, (override, message) in bad.items():
        args = dict(ok, **override)
        with pytest.raises(ValueError, match=message):
            _run_scale_update(module, args["hist"], args["pending"], args["prev"], args["scale"], args["inv"],
                              FACTORS[0], False)
    torch.cuda.synchronize()
    for key, value in ok.items():
        assert _same_bits(value, before[key]), f"{key} changed: a bad call launched"
