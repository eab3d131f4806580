"""The ops as torch citizens, on a machine without a GPU.

- every plugin op is a ``torch.library.custom_op`` under ``torch.ops.astrai`` with the
  schema the ABI documents;
- ``torch.library.opcheck`` (schema, autograd registration, fake tensor, AOT dispatch)
  passes on meta tensors, where the fake implementation is the kernel;
- the fake implementations give the kernel's output shape/dtype/device for strided
  inputs, under ``FakeTensorMode`` and under ``torch.compile(fullgraph=True)``;
- the public entry points compile, with graph breaks allowed and with ``fullgraph=True``
  (the backend decision is made once at trace time), and give the eager result.
"""

from __future__ import annotations

import pytest
import torch
from reference import rotary_tables
from torch._subclasses.fake_tensor import FakeTensorMode

from astrai.extension import apply_rotary_emb, attention
from astrai.extension.backend import fp8 as fp8_policy
from astrai.extension.ops import attention as attn_ops  # noqa: F401 - registers torch.ops.astrai.attn_*
from astrai.extension.ops import fp8 as fp8_ops  # noqa: F401 - registers torch.ops.astrai.fp8_*
from astrai.extension.ops import rotary as rotary_ops  # noqa: F401 - registers torch.ops.astrai.rotary_emb
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

META = "meta"
BF16 = torch.bfloat16
I32 = torch.int32


def m(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device=META)


def bhld(b, lq, h, d, dtype=BF16):
    """A [B, L, H, D] view of a [B, H, L, D] tensor (the permuted layout the ops accept)."""
    return m(b, h, lq, d, dtype=dtype).transpose(1, 2)


# op -> (args on the meta device, expected output shapes)
CASES = {
    "rotary_emb": ((bhld(2, 5, 4, 64), m(5, 32, dtype=torch.float32), m(5, 32, dtype=torch.float32), None, True, False),
                   [(2, 5, 4, 64)]),
    "rotary_qk": ((bhld(2, 5, 8, 64), bhld(2, 5, 2, 64), m(99, 16, dtype=torch.float32), m(99, 16, dtype=torch.float32),
                   m(2, 5, dtype=I32), False, True), [(2, 5, 8, 64), (2, 5, 2, 64)]),
    "attn_decode": ((m(3, 1, 8, 128), bhld(3, 40, 2, 128), bhld(3, 40, 2, 128), m(3, 40, dtype=torch.bool)),
                    [(3, 1, 8, 128)]),
    "attn_prefill": ((bhld(2, 9, 8, 64), m(2, 11, 2, 64), m(2, 11, 2, 64), None, True), [(2, 9, 8, 64)]),
    "attn_paged_decode": ((m(3, 1, 8, 128), m(10, 16, 2, 128), m(10, 16, 2, 128), m(4, dtype=I32),
                           m(7, dtype=I32), m(3, dtype=I32)), [(3, 1, 8, 128)]),
    "attn_paged_prefill": ((m(75, 8, 128), m(10, 16, 2, 128), m(10, 16, 2, 128), m(4, dtype=I32), m(4, dtype=I32),
                            m(7, dtype=I32), m(3, dtype=I32), m(4, dtype=I32), m(4, dtype=I32), True),
                           [(75, 8, 128)]),
    "fp8_quantize": ((m(33, 40), m((), dtype=torch.float32), "e4m3", 2), [(33, 40), (40, 33), ()]),
    "fp8_gemm": ((m(33, 64, dtype=torch.float8_e4m3fn), m(48, 64, dtype=torch.float8_e4m3fn),
                  m((), dtype=torch.float32), m(48), False, True), [(33, 48)]),
}

SCHEMAS = {
    "rotary_emb": ("astrai::rotary_emb(Tensor x, Tensor cos, Tensor sin, Tensor? positions, bool interleaved, "
                   "bool inverse) -> Tensor"),
    "rotary_qk": ("astrai::rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? positions, "
                  "bool interleaved, bool inverse) -> (Tensor, Tensor)"),
    "attn_decode": ("astrai::attn_decode(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale=None, "
                    "float? logits_soft_cap=None, SymInt window_left=-1, Tensor? sinks=None, "
                    "Tensor? alibi_slopes=None) -> Tensor"),
}


def op(name):
    return getattr(torch.ops.astrai, name).default


def shapes(out):
    return [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])]


@pytest.mark.parametrize("name", CASES)
def test_every_op_is_a_registered_custom_op(name):
    schema = str(op(name)._schema)
    assert schema.startswith(f"astrai::{name}(") and "!" not in schema  # functional: mutates nothing
    if name in SCHEMAS:
        assert schema == SCHEMAS[name]


@pytest.mark.parametrize("name", CASES)
def test_opcheck_on_meta_tensors(name):
    args, _ = CASES[name]
    result = torch.library.opcheck(op(name), args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", CASES)
def test_fake_impl_gives_the_kernel_output(name):
    args, expected = CASES[name]
    out = op(name)(*args)
    assert shapes(out) == expected
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                for a in args]
        assert shapes(op(name)(*fake)) == expected
    first = out[0] if isinstance(out, (tuple, list)) else out
    assert first.device.type == META and first.is_contiguous()


@pytest.mark.parametrize("name", CASES)
def test_op_traces_under_compile_fullgraph_on_meta(name):
    args, expected = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(name)(*a), fullgraph=True, backend="aot_eager")
    assert shapes(compiled(*args)) == expected


def test_outputs_dtypes_of_the_fake_impls():
    assert op("rotary_emb")(*CASES["rotary_emb"][0]).dtype == BF16
    q, qt, amax = op("fp8_quantize")(*CASES["fp8_quantize"][0])
    assert (q.dtype, qt.dtype, amax.dtype) == (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32)
    assert op("fp8_gemm")(*CASES["fp8_gemm"][0]).dtype == BF16


# -- the public entry points --------------------------------------------------------------


@pytest.fixture
def runtime(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    with use_runtime(Runtime(Registry(lambda: []))) as rt:
        yield rt


def _rotary():
    cos, sin = rotary_tables(7, 32)
    x = torch.randn(2, 7, 4, 32)
    return (lambda x: apply_rotary_emb(x, (cos, sin))), (x,)


def _attention():
    q, k = torch.randn(2, 5, 8, 32), torch.randn(2, 9, 2, 32)
    return (lambda q, k, v: attention(q, k, v, is_causal=True)), (q, k, torch.randn_like(k))


def _gemm():
    a = (torch.randn(16, 32) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(32, 8) * 4).to(torch.float8_e4m3fn)
    return (lambda a, b: fp8_policy.gemm(a, b, torch.tensor(0.5))), (a, b)


ENTRIES = {"apply_rotary_emb": _rotary, "attention": _attention, "fp8 gemm": _gemm}


@pytest.mark.parametrize("entry", ENTRIES)
def test_public_entry_points_compile_and_match_eager(runtime, entry):
    fn, args = ENTRIES[entry]()
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="aot_eager")(*args), fn(*args), atol=0, rtol=0)


@pytest.mark.parametrize("entry", ENTRIES)
def test_public_entry_points_under_compile_fullgraph(runtime, entry):
    fn, args = ENTRIES[entry]()
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(*args), fn(*args))
