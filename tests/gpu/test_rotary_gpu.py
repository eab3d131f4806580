"""The astrai-rotary kernel on the GPU against a float64 reference and the torch path.

The compiled module is called directly (ABI 1) with NaN-poisoned outputs framed by
guard regions, so an unwritten or out-of-bounds element fails; the public op, the
``apply_rotary_emb`` dispatch and CUDA-graph capture are checked on top. Fresh random
inputs and real RoPE tables (positions up to 16k+) in every case.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from reference import rotary_ref, rotary_tables

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _module():
    return importlib.import_module("astrai_rotary._rotary_emb")


def _abi(t: torch.Tensor):
    code = {torch.float32: 0, torch.bfloat16: 2}[t.dtype]
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), code


def _tables(seq: int, head_dim: int, offset: int = 0):
    cos, sin = rotary_tables(seq, head_dim, offset=offset)
    return cos.cuda(), sin.cuda()


def _check_close(got: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> float:
    """Within bf16 rounding of the exact result: |got - ref| <= 2^-8 |ref| + 2^-16 max|x|."""
    ref = rotary_ref(x, cos, sin)
    got64 = got.detach().double().cpu()
    assert not torch.isnan(got64).any(), "unwritten (NaN-poisoned) elements in the output"
    bound = ref.abs() * 2.0**-8 + x.detach().abs().max().item() * 2.0**-16
    excess = (got64 - ref).abs() - bound
    assert excess.max().item() <= 0, f"max error {(got64 - ref).abs().max().item():.3g} beyond bf16 rounding"
    return (got64 - ref).abs().max().item()


SHAPES = [  # (B, L, H, D): decode, odd sizes, prefill at 16k+ tokens, head dims 64/128/256
    (1, 1, 32, 128),
    (8, 1, 8, 64),
    (3, 2, 5, 256),
    (2, 17, 3, 64),
    (1, 33, 7, 96),
    (2, 9, 3, 36),  # head_dim % 8 != 0: the one-pair-per-thread path
    (1, 16384, 32, 128),
    (1, 16400, 8, 64),
    (2, 4096, 8, 256),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference_with_poisoned_output(shape):
    B, L, H, D = shape
    x = torch.randn(shape, device="cuda", dtype=BF16) * 3
    cos, sin = _tables(L, D, offset=int(torch.randint(0, 4096, ())))
    # out is a view into a NaN-filled buffer with 2 guard heads before and after each token
    frame = torch.full((B, L, H + 4, D), float("nan"), device="cuda", dtype=BF16)
    out = frame[:, :, 2:H + 2]
    _module().rotary_emb(_abi(x), _abi(cos), _abi(sin), _abi(out), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    _check_close(out, x, cos, sin)
    guards = torch.cat((frame[:, :, :2], frame[:, :, H + 2:]), dim=2)
    assert torch.isnan(guards.float()).all(), "the kernel wrote outside out"


@pytest.mark.parametrize("shape", [(1, 4, 32, 128), (1, 16384, 32, 128), (4, 300, 8, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_op_agrees_with_the_torch_path(shape):
    from astrai.extension.backend.rotary import rotary_torch
    from astrai.extension.ops.rotary import rotary_emb

    x = torch.randn(shape, device="cuda", dtype=BF16)
    cos, sin = _tables(shape[1], shape[3], offset=100)
    got = rotary_emb(x, cos, sin)
    want = rotary_torch(x, cos, sin)
    _check_close(got, x, cos, sin)
    # both round an f32 result once: at most one bf16 ulp apart (FMA contraction differs)
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs() * 2.0**-7 + x.float().abs().max() * 2.0**-20
    assert (diff <= ulp).all(), f"kernel vs torch path: max diff {diff.max().item():.3g}"


def test_bhld_permuted_and_strided_inputs():
    from astrai.extension.ops.rotary import rotary_emb

    B, L, H, D = 2, 1000, 8, 128
    bhld = torch.randn(B, H, L, D, device="cuda", dtype=BF16)
    x = bhld.permute(0, 2, 1, 3)  # [B, L, H, D] view of a BHLD tensor
    table_cos, table_sin = _tables(L + 50, D)
    cos, sin = table_cos[50:], table_sin[50:]  # offset views (decode/chunked prefill position)
    _check_close(rotary_emb(x, cos, sin), x, cos, sin)
    wide = torch.randn(B, L, H, D + 64, device="cuda", dtype=BF16)
    x2 = wide[..., 32:32 + D]  # rows not contiguous with each other
    _check_close(rotary_emb(x2, cos, sin), x2, cos, sin)
    x3 = wide[..., 2:2 + D]  # 4-byte but not 16-byte aligned: the one-pair-per-thread path
    _check_close(rotary_emb(x3, cos, sin), x3, cos, sin)


def test_in_place_and_side_stream():
    B, L, H, D = 2, 64, 4, 64
    x = torch.randn(B, L, H, D, device="cuda", dtype=BF16)
    cos, sin = _tables(L, D, offset=7)
    original = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _module().rotary_emb(_abi(x), _abi(cos), _abi(sin), _abi(x), stream.cuda_stream)
    stream.synchronize()
    _check_close(x, original, cos, sin)


def test_apply_rotary_emb_dispatches_to_the_kernel_and_captures_in_a_graph():
    from astrai.extension.backend.rotary import apply_rotary_emb
    from astrai.extension.runtime import current_runtime

    B, L, H, D = 4, 1, 32, 128
    x = torch.randn(B, L, H, D, device="cuda", dtype=BF16)
    cos, sin = _tables(L, D, offset=321)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            apply_rotary_emb(x, (cos, sin))  # warm-up: resolves, loads the module
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = apply_rotary_emb(x, (cos, sin))
        for _ in range(3):
            fresh = torch.randn_like(x)
            x.copy_(fresh)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _check_close(out, fresh, cos, sin)
    decisions = [d for d in current_runtime().explain("rotary_emb")
                 if d.key.head_dim == D and d.key.dtype == BF16 and not d.key.needs_grad]
    assert decisions and {d.chosen for d in decisions} == {"cuda"}, [str(d) for d in decisions]


def test_training_call_takes_the_autograd_path():
    from astrai.extension.backend.rotary import apply_rotary_emb

    x = torch.randn(1, 8, 2, 64, device="cuda", dtype=BF16, requires_grad=True)
    cos, sin = _tables(8, 64)
    apply_rotary_emb(x, (cos, sin)).float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_python_validation_on_cuda_tensors():
    from astrai.extension.ops.rotary import rotary_emb

    x = torch.randn(1, 4, 2, 64, device="cuda", dtype=BF16)
    cos, sin = _tables(4, 64)
    with pytest.raises(ValueError, match="cos is on cpu"):
        rotary_emb(x, cos.cpu(), sin)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        rotary_emb(x.half(), cos, sin)
    with pytest.raises(ValueError, match=r"sin must have shape \[seq, head_dim // 2\] = \[4, 32\]"):
        rotary_emb(x, cos, sin[:3])
