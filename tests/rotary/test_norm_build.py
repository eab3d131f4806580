"""The norm kernels of the astrai-elementwise build, on a machine without a GPU: the build report
(every instantiation for both SASS archs, no spills), the block shapes the module launches,
and the C++ validation of rms_norm, fused_add_rms_norm and silu_and_mul (and of their e4m3-row
forms, rms_norm_fp8 and silu_and_mul_fp8) before any CUDA call.

The wheel is the shared rotary build (tests/conftest.py's ``rotary_build``, sm_80 + sm_90a).
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
from build_helpers import load_module

pytestmark = pytest.mark.slow

BF16, F32, F16, I32 = 2, 0, 1, 5
ROWS, HIDDEN = 3, 64


@pytest.fixture(scope="module")
def compiled(rotary_build, tmp_path_factory):
    wheel = next((rotary_build / "cu130").glob("astrai_elementwise-*.whl"))
    dest = tmp_path_factory.mktemp("norm-unpacked")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(dest, [n for n in zf.namelist() if n.startswith("astrai_elementwise/")])
    return load_module("astrai_elementwise._rotary_emb", next((dest / "astrai_elementwise").glob("_rotary_emb.*.so")))


def test_every_norm_kernel_is_built_for_both_archs_without_spills(rotary_build):
    report = json.loads((Path(rotary_build) / "build-report-cu130.json").read_text())
    kernels = next(p for p in report["packages"] if p["name"] == "astrai-elementwise")["kernels"]
    names = {(k["arch"], k["kernel"]) for k in kernels}
    for arch in ("sm_80", "sm_90a"):
        norm = {n for a, n in names if a == arch and "rms_norm_kernel" in n}
        silu = {n for a, n in names if a == arch and "silu_and_mul_kernel" in n}
        silu_fp8 = {n for a, n in names if a == arch and "silu_and_mul_fp8_kernel" in n}
        # 3 dtypes x (registers 1, 2, 4, 8 + two passes, + scalar), 16-bit and e4m3 rows
        assert len({n for n in norm if n.endswith("false>(astrai::norm::NormParams)")}) == 18, norm
        assert len({n for n in norm if n.endswith("true>(astrai::norm::NormParams)")}) == 12, norm  # 16-bit only
        assert len(silu) == 6, silu  # 3 dtypes x (vector, scalar)
        # one block a row, as the norm, or (sm_90 code, a trap stub on sm_80) a cluster a row; 16-bit only
        assert len([n for n in silu_fp8 if n.endswith("false>(astrai::norm::SiluMulParams)")]) == 12, silu_fp8
        assert len([n for n in silu_fp8 if n.endswith("true>(astrai::norm::SiluMulParams)")]) == 12, silu_fp8
    for k in kernels:
        if "norm" in k["kernel"] or "silu" in k["kernel"]:
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0, k


@pytest.mark.parametrize("hidden, dtype, vector, want", [
    (128, BF16, True, (32, 1, 8)),  # 16 accesses: one warp
    (4096, BF16, True, (512, 1, 8)),  # Llama-3-8B
    (5120, F16, True, (320, 2, 8)),
    (8192, BF16, True, (512, 2, 8)),
    (16384, BF16, True, (512, 4, 8)),
    (16384, F32, True, (512, 8, 4)),
    (32768, BF16, True, (512, 8, 8)),
    (65536, BF16, True, (512, 0, 8)),  # wider than the registers hold: two passes
    (4095, BF16, False, (512, 0, 1)),  # the scalar path: two passes
    (100, F32, False, (128, 0, 1)),
])
def test_block_shape(compiled, hidden, dtype, vector, want):
    assert compiled.norm_launch(hidden, dtype, vector) == want


def _t(ptr=4096, shape=(ROWS, HIDDEN), strides=None, dtype=BF16):
    """A [rows, channels] operand as the module takes it (contiguous unless ``strides``)."""
    return (ptr, shape, strides or (shape[1], 1), dtype)


def _w(ptr=65536, hidden=HIDDEN, dtype=BF16):
    return (ptr, (hidden,), (1,), dtype)


NORM_BAD = {
    "x 3-D": (dict(x=(4096, (1, ROWS, HIDDEN), (ROWS * HIDDEN, HIDDEN, 1), BF16)), r"x: expected 2 dims"),
    "x int32": (dict(x=_t(dtype=I32)), r"x: expected float16, bfloat16 or float32, got int32"),
    "x strided last dim": (dict(x=_t(strides=(2 * HIDDEN, 2))), r"x: the last dim must be contiguous"),
    "x null": (dict(x=_t(ptr=0)), r"x: null data pointer"),
    "x misaligned": (dict(x=_t(ptr=4097)), r"x: data pointer 0x1001 is not 2-byte aligned"),
    "no channels": (dict(x=_t(shape=(ROWS, 0), strides=(1, 1)), out=_t(shape=(ROWS, 0), strides=(1, 1))),
                    r"x: hidden size \(last dim\) must be in \[1, 2\^31 - 1\]"),
    "weight size": (dict(weight=_w(hidden=HIDDEN + 1)), r"weight: expected bfloat16 \[64\] like x's last dim"),
    "weight dtype": (dict(weight=_w(dtype=F32)), r"weight: expected bfloat16 \[64\] .* got float32"),
    "weight 2-D": (dict(weight=(65536, (1, HIDDEN), (HIDDEN, 1), BF16)), r"weight: expected 1 dims"),
    "out shape": (dict(out=_t(ptr=131072, shape=(ROWS + 1, HIDDEN))), r"out: shape \[4, 64\] must equal x's shape"),
    "out dtype": (dict(out=_t(ptr=131072, dtype=F16)), r"out: dtype float16 must equal x's bfloat16"),
    "out overlaps x": (dict(out=_t(ptr=4096 + 2 * HIDDEN)), r"out: overlaps x \(it may only be the same tensor"),
    "negative eps": (dict(eps=-1e-6), r"eps: expected a finite value >= 0"),
    "nan eps": (dict(eps=float("nan")), r"eps: expected a finite value >= 0"),
    "negative stream": (dict(stream=-1), r"stream: expected the stream handle"),
}

FUSED_BAD = {
    "residual shape": (dict(residual=_t(ptr=262144, shape=(ROWS, HIDDEN + 8))),
                       r"residual: shape \[3, 72\] must equal x's shape \[3, 64\]"),
    "residual dtype": (dict(residual=_t(ptr=262144, dtype=F32)), r"residual: dtype float32 must equal x's bfloat16"),
    "residual is x": (dict(residual=_t()), r"residual: overlaps x \[check"),
    "out is residual": (dict(out=_t(ptr=262144)), r"out: overlaps residual"),
}


def _norm_args(**override):
    args = dict(x=_t(), weight=_w(), out=_t(ptr=131072), eps=1e-5, stream=0)
    args.update(override)
    return args


@pytest.mark.parametrize("case", sorted(NORM_BAD))
def test_rms_norm_validation_names_the_argument(compiled, case):
    override, message = NORM_BAD[case]
    with pytest.raises(ValueError, match=message) as err:
        compiled.rms_norm(**_norm_args(**override))
    assert re.search(r"\[check `.+` at [\w.]+:\d+\]", str(err.value)), str(err.value)  # where it failed


@pytest.mark.parametrize("case", sorted(NORM_BAD) + sorted(FUSED_BAD))
def test_fused_add_rms_norm_validation_names_the_argument(compiled, case):
    override, message = {**NORM_BAD, **FUSED_BAD}[case]
    args = _norm_args(residual=_t(ptr=262144))
    args.update(override)
    with pytest.raises(ValueError, match=message):
        compiled.fused_add_rms_norm(**args)


SILU_BAD = {
    "odd channels": (dict(gate_up=_t(shape=(ROWS, 63), strides=(63, 1)), out=_t(ptr=131072, shape=(ROWS, 31))),
                     r"gate_up: the last dim \(gate and up, 2 \* intermediate\) must be even"),
    "out shape": (dict(out=_t(ptr=131072, shape=(ROWS, HIDDEN))), r"out: expected bfloat16 \[3, 32\], got bfloat16 \[3, 64\]"),
    "out dtype": (dict(out=_t(ptr=131072, shape=(ROWS, HIDDEN // 2), dtype=F32)), r"out: expected bfloat16 \[3, 32\]"),
    "out inside gate_up": (dict(out=_t(ptr=4096 + 64, shape=(ROWS, HIDDEN // 2))), r"out: overlaps gate_up"),
    "gate_up 1-D": (dict(gate_up=(4096, (HIDDEN,), (1,), BF16)), r"gate_up: expected 2 dims"),
    "gate_up float8": (dict(gate_up=_t(dtype=3)), r"gate_up: expected float16, bfloat16 or float32"),
}


@pytest.mark.parametrize("case", sorted(SILU_BAD))
def test_silu_and_mul_validation_names_the_argument(compiled, case):
    override, message = SILU_BAD[case]
    args = dict(gate_up=_t(), out=_t(ptr=131072, shape=(ROWS, HIDDEN // 2)), stream=0)
    args.update(override)
    with pytest.raises(ValueError, match=message):
        compiled.silu_and_mul(**args)


E4M3 = 3


def _q(ptr=524288, shape=(ROWS, HIDDEN), strides=None):
    return (ptr, shape, strides or (shape[1], 1), E4M3)


def _scale(ptr=786432, rows=ROWS, dtype=F32):
    return (ptr, (rows,), (1,), dtype)


FP8_ROWS_BAD = {
    "q dtype": (dict(q=(524288, (ROWS, HIDDEN), (HIDDEN, 1), BF16)), r"q: expected float8_e4m3fn \[3, 64\], got bfloat16"),
    "q shape": (dict(q=_q(shape=(ROWS, HIDDEN + 8))), r"q: expected float8_e4m3fn \[3, 64\], got float8_e4m3fn \[3, 72\]"),
    "q strided": (dict(q=_q(strides=(2 * HIDDEN, 2))), r"q: the last dim must be contiguous"),
    "q overlaps x": (dict(q=_q(ptr=4096)), r"q: overlaps x"),
    "scale rows": (dict(scale=_scale(rows=ROWS + 1)), r"scale: expected float32 \[3\] \(one scale a row\), got float32 \[4\]"),
    "scale dtype": (dict(scale=_scale(dtype=BF16)), r"scale: expected float32 \[3\]"),
    "scale inside q": (dict(scale=_scale(ptr=524288 + 8)), r"scale: overlaps q"),
}


NORM_FP8_BAD = {
    **{case: bad for case, bad in NORM_BAD.items() if "out" not in bad[0]},  # no 16-bit out here
    **FP8_ROWS_BAD,
    "residual dtype": (dict(residual=_t(ptr=262144, dtype=F32)), r"residual: dtype float32 must equal x's bfloat16"),
    "q overlaps residual": (dict(residual=_t(ptr=262144), q=_q(ptr=262144)), r"q: overlaps residual"),
    "x float32": (dict(x=_t(dtype=F32), weight=_w(dtype=F32)), r"x: expected float16 or bfloat16 for e4m3 rows"),
}


@pytest.mark.parametrize("case", sorted(NORM_FP8_BAD))
def test_rms_norm_fp8_validation_names_the_argument(compiled, case):
    override, message = NORM_FP8_BAD[case]
    args = dict(x=_t(), residual=None, weight=_w(), q=_q(), scale=_scale(), eps=1e-5, stream=0)
    args.update(override)
    with pytest.raises(ValueError, match=message):
        compiled.rms_norm_fp8(**args)


INTER = HIDDEN // 2
SILU_FP8_BAD = {
    "odd channels": (dict(gate_up=_t(shape=(ROWS, 63), strides=(63, 1))), r"gate_up: the last dim \(gate and up"),
    "q shape": (dict(q=_q(shape=(ROWS, HIDDEN))), r"q: expected float8_e4m3fn \[3, 32\], got float8_e4m3fn \[3, 64\]"),
    "q dtype": (dict(q=(524288, (ROWS, INTER), (INTER, 1), BF16)), r"q: expected float8_e4m3fn \[3, 32\], got bfloat16"),
    "q inside gate_up": (dict(q=_q(ptr=4096 + 64, shape=(ROWS, INTER))), r"q: overlaps gate_up"),
    "scale rows": (dict(scale=_scale(rows=ROWS - 1)), r"scale: expected float32 \[3\] \(one scale a row\)"),
    "gate_up float32": (dict(gate_up=_t(dtype=F32)), r"gate_up: expected float16 or bfloat16 for e4m3 rows"),
}


@pytest.mark.parametrize("case", sorted(SILU_FP8_BAD))
def test_silu_and_mul_fp8_validation_names_the_argument(compiled, case):
    override, message = SILU_FP8_BAD[case]
    args = dict(gate_up=_t(), q=_q(shape=(ROWS, INTER)), scale=_scale(), stream=0)
    args.update(override)
    with pytest.raises(ValueError, match=message):
        compiled.silu_and_mul_fp8(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="valid arguments would launch on made-up pointers")
def test_valid_arguments_reach_cuda_only_after_validation(compiled):
    """Valid arguments pass validation and fail at the launch (no GPU here) with the CUDA
    error; in place (out = x) is valid; no rows need no CUDA at all."""
    for call in (lambda: compiled.rms_norm(**_norm_args()),
                 lambda: compiled.rms_norm(**_norm_args(out=_t())),
                 lambda: compiled.fused_add_rms_norm(**_norm_args(residual=_t(ptr=262144), out=_t())),
                 lambda: compiled.silu_and_mul(_t(), _t(ptr=131072, shape=(ROWS, HIDDEN // 2)), 0),
                 lambda: compiled.rms_norm_fp8(_t(), None, _w(), _q(), _scale(), 1e-5, 0),
                 lambda: compiled.rms_norm_fp8(_t(), _t(ptr=262144), _w(), _q(), _scale(), 1e-5, 0),
                 lambda: compiled.silu_and_mul_fp8(_t(), _q(shape=(ROWS, HIDDEN // 2)), _scale(), 0)):
        with pytest.raises(RuntimeError, match=r"CUDA error cuda\w+"):
            call()
    empty = _t(shape=(0, HIDDEN))
    assert compiled.rms_norm(empty, _w(), empty, 1e-5, 0) is None
    assert compiled.fused_add_rms_norm(empty, empty, _w(), empty, 1e-5, 0) is None
    assert compiled.silu_and_mul(empty, _t(shape=(0, HIDDEN // 2)), 0) is None
    assert compiled.rms_norm_fp8(empty, None, _w(), _q(shape=(0, HIDDEN)), _scale(rows=0), 1e-5, 0) is None
    assert compiled.silu_and_mul_fp8(empty, _q(shape=(0, HIDDEN // 2)), _scale(rows=0), 0) is None
