"""The astrai-fp8 plugin on a machine without a GPU.

* Launch planning through the bound C++ planner (``_fp8_ops.plan``, no GPU needed):
  every crossover of the tile rules, the NN swap, the shared-memory fallback.
* One build (``ci/build-wheels`` for CUDA 13.0, asked for sm_86 + sm_89 + sm_90a + sm_120;
  sm_86 is skipped: ``wheel_cache.FP8_ARCHS``, the wheel tests/packaging/test_pip_install.py installs
  too) feeds the rest: the manifest against cuobjdump, the SASS of
  the GEMM (native ``QMMA.16832.F32.E4M3.E4M3`` on sm_89; on sm_90a the same ``mma.sync``
  becomes ``F2FP...UNPACK_B`` + ``HMMA.16816``, the emulation the manifest's
  ``native_sm`` documents), the ptxas register report (no spills), and the C++
  validation, which raises before any
  CUDA call; the scale update's SASS keeps IEEE multiply and reciprocal under fast math.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
from build_helpers import find_tool, load_module, plugin_manifest_of, sm90_planner
from wheel_cache import FP8_ARCHS, plugin_build

H200 = dict(sms=132, smem_per_sm=233472, smem_per_block=232448)
L20 = dict(sms=92, smem_per_sm=102400, smem_per_block=101376)


# ============================================================ planning (the bound C++ planner)
# ``_fp8_ops.plan`` runs ``canonicalize_gemm`` + ``plan_gemm`` of csrc/gemm.cuh, the code
# fp8_gemm launches with: the rules are tested there, with no mirror to keep in step.
def _plan(compiled, m, n, k=4096, *, trans_a=False, trans_b=True, dev=H200) -> dict:
    return compiled.plan(m, n, k, trans_a, trans_b, dev["sms"], dev["smem_per_sm"], dev["smem_per_block"])


def _tile(compiled, m, n, **kw) -> str:
    return _plan(compiled, m, n, **kw)["tile"]


@pytest.mark.slow
def test_small_m_takes_the_64x64_cta(compiled):
    assert _tile(compiled, 1, 8192) == "64x64"
    assert _tile(compiled, 64, 28672) == "64x64"


@pytest.mark.slow
def test_64_but_not_128_divisible_takes_64x64(compiled):
    assert _tile(compiled, 1088, 1088) == "64x64"
    assert _tile(compiled, 1216, 4096) == "64x64"
    assert _tile(compiled, 1024, 4160) == "64x64"


@pytest.mark.slow
def test_crosswise_switches_to_128x128_at_one_and_a_half_waves(compiled):
    sms = H200["sms"]
    # 128 x 128 tiles: 1.5 waves of 132 SMs = 198 tiles; 16 x 12 = 192 < 198 <= 16 x 13 = 208
    assert _tile(compiled, 2048, 1536, trans_b=False) == "64x64"
    assert _tile(compiled, 2048, 1664, trans_b=False) == "128x128"
    assert 16 * 12 < 1.5 * sms <= 16 * 13
    assert _tile(compiled, 4096, 4096, trans_a=True, trans_b=False) == "128x128"  # XX, 1024 tiles


@pytest.mark.slow
def test_congruous_sub_wave_bands(compiled):
    # fill = 128x128 tiles / 132: < 3/8 -> 64x64, < 5/8 -> 128x64, else 128x128
    assert _tile(compiled, 768, 768) == "64x64"      # 36 tiles, 0.27 of a wave
    assert _tile(compiled, 1024, 1024) == "128x64"   # 64 tiles, 0.48
    assert _tile(compiled, 1280, 1024) == "128x64"   # 80 tiles, 0.61
    assert _tile(compiled, 1408, 1024) == "128x128"  # 88 tiles, 0.67
    assert _tile(compiled, 1024, 1664) == "128x128"  # 104 tiles, 0.79


@pytest.mark.slow
def test_congruous_wave_math(compiled):
    # just past one wave: 2 big tile-times vs 3 narrow ones at 0.53 -> narrow
    assert _tile(compiled, 128 * 133, 128) == "128x64"
    # exactly two waves: 2 big vs 4 narrow * 0.53 = 2.12 -> big
    assert _tile(compiled, 128 * 264, 128) == "128x128"
    assert _tile(compiled, 8192, 8192) == "128x128"
    assert _tile(compiled, 1024, 8192) == "128x128"


@pytest.mark.slow
def test_shared_memory_budget_falls_back_to_smaller_ctas(compiled):
    tiny = dict(sms=132, smem_per_sm=60000, smem_per_block=60000)
    assert _tile(compiled, 8192, 8192, dev=tiny) == "128x64"  # 64 KiB ring does not fit
    tinier = dict(sms=132, smem_per_sm=40000, smem_per_block=40000)
    assert _tile(compiled, 8192, 8192, dev=tinier) == "64x64"
    assert _tile(compiled, 8192, 8192, trans_b=False, dev=tiny) == "64x64"  # crosswise: no 128x64 kernel
    assert _plan(compiled, 8192, 8192, 64, dev=L20)["ctas_per_sm"] == 1


@pytest.mark.slow
def test_nn_swap_and_layout_pairs(compiled):
    p = _plan(compiled, 100, 300, 64, trans_a=True, trans_b=True)
    assert p["swap_ab"] and p["layouts"] == "CX"
    assert (p["tiles_m"], p["tiles_n"]) == (5, 2)  # the kernel problem is 300 x 100
    pairs = {(ta, tb): _plan(compiled, 256, 256, 64, trans_a=ta, trans_b=tb)
             for ta, tb in itertools.product((False, True), repeat=2)}
    assert {k: (v["layouts"], v["swap_ab"]) for k, v in pairs.items()} == {
        (False, True): ("CC", False), (False, False): ("CX", False),
        (True, False): ("XX", False), (True, True): ("CX", True)}


@pytest.mark.slow
def test_grid_and_grouped_raster_size(compiled):
    for m, n in ((1000, 3000), (64, 64), (8192, 1024), (16384, 28672)):
        p = _plan(compiled, m, n, 512)
        assert p["grid"] == p["tiles_m"] * p["tiles_n"]
        assert p["tiles_m"] == -(-m // p["block_m"]) and p["tiles_n"] == -(-n // p["block_n"])
        assert p["group_m"] == min(p["tiles_m"], 8)
    with pytest.raises(ValueError, match="positive"):
        _plan(compiled, 0, 1, 1)


# ============================================================ the build (slow, once)
def _cuobjdump() -> str:
    found = find_tool("cuobjdump")
    assert found, "cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"
    return found


def _sass_bodies(so: Path, arch: str, kernel: str) -> dict[str, str]:
    """The SASS of each function of ``so`` for ``arch`` whose name holds ``kernel``: name -> body."""
    tool = _cuobjdump()
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    text = subprocess.run([tool, "--dump-sass", "-arch", arch, str(so)], capture_output=True, text=True,
                          check=True, env=env).stdout
    return {name.strip(): body for name, _, body in
            (part.partition("\n") for part in re.split(r"\n\s*Function : ", text)[1:]) if kernel in name}


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    """The ci/build-wheels output of the FP8_ARCHS build, shared with tests/packaging/test_pip_install.py
    and kept on disk per source tree (tests/helpers/wheel_cache.py; read-only). A wheelhouse
    ci/build-wheels made earlier (same archs) can be given instead while iterating."""
    reuse = os.environ.get("ASTRAI_TEST_FP8_WHEELHOUSE")
    return Path(reuse) if reuse else plugin_build("fp8", "13.0", FP8_ARCHS)


@pytest.fixture(scope="module")
def unpacked(wheelhouse, tmp_path_factory) -> Path:
    wheel = next((wheelhouse / "cu130").glob("astrai_fp8-*.whl"))
    dest = tmp_path_factory.mktemp("fp8")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(dest, [n for n in zf.namelist() if n.startswith("astrai_fp8/")])
    return dest / "astrai_fp8"


@pytest.fixture(scope="module")
def so(unpacked) -> Path:
    return next(unpacked.glob("_fp8_ops.*.so"))


@pytest.fixture(scope="module")
def compiled(so):
    return load_module("astrai_fp8._fp8_ops", so)


@pytest.fixture(scope="module")
def plugin_manifest(unpacked) -> dict:
    return plugin_manifest_of(unpacked, "_astrai_fp8_under_test")


def _sass(so: Path, arch: str) -> dict[str, str]:
    """Disassembly per fp8_gemm kernel (mangled name -> text) for one arch."""
    tool = _cuobjdump()
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    text = subprocess.run([tool, "--dump-sass", "-arch", arch, str(so)], capture_output=True, text=True,
                          check=True, env=env).stdout
    kernels: dict[str, str] = {}
    for part in re.split(r"\n\s*Function : ", text)[1:]:
        name, _, body = part.partition("\n")
        if "fp8_gemm_kernel" in name:
            kernels[name.strip()] = body
    return kernels


@pytest.mark.slow
def test_manifest_matches_the_binary(plugin_manifest, so):
    from astrai.extension.manifest import parse_manifest

    tool = _cuobjdump()
    elf = subprocess.run([tool, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", str(so)], capture_output=True, text=True, check=True).stdout
    assert set(re.findall(r"\.(sm_\d+[af]?)\.cubin", elf)) == set(plugin_manifest["sass_archs"]) == {"sm_89", "sm_90a", "sm_120"}
    assert {"compute_" + a for a in re.findall(r"\.sm_(\d+[af]?)\.ptx", ptx)} == set(plugin_manifest["ptx_archs"])
    parsed = parse_manifest(plugin_manifest)
    assert set(parsed.ops) == {"fp8_quantize", "fp8_gemm", "fp8_scale_update", "fp8_weight_gemm"}
    # mma.sync is native on 89 and 120; a build with the sm_90a wgmma kernel adds 90
    assert set(parsed.ops["fp8_gemm"].native_sm) == {89, 90, 120}
    # the sm_90a build ships the measured table (packaged with the wheel)
    from astrai.extension.backend import prefer
    assert prefer.table_for(parsed.ops["fp8_gemm"].prefer, 90).peer == "scaled_mm"
    assert parsed.ops["fp8_gemm"].min_sm == parsed.ops["fp8_quantize"].min_sm == 89
    assert parsed.ops["fp8_scale_update"].min_sm == 89
    assert plugin_manifest["ops"]["fp8_scale_update"]["dtypes"] == ["float32"]
    assert plugin_manifest["ops"]["fp8_gemm"]["module"] == "astrai_fp8._fp8_ops"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_89", "sm_120"])
def test_gemm_is_native_qmma_on_sm89_and_sm120(so, arch):
    kernels = _sass(so, arch)
    assert len(kernels) == 28  # (3 tiles for CC + 2 tiles x (CX, XX)) x 4 format pairs
    for name, body in kernels.items():
        assert re.search(r"QMMA\.16832\.F32\.E[45]M[32]\.E[45]M[32]", body), name
        assert "HMMA" not in body and "UNPACK_B" not in body, name
        assert "LDSM" in body, name  # ldmatrix fragment loads


@pytest.mark.slow
def test_sm90a_mma_sync_is_an_fp16_emulation(so):
    """What native_sm records: no QMMA on sm_90a, the fp8 fragments are unpacked to f16."""
    kernels = _sass(so, "sm_90a")
    assert len(kernels) == 28
    for name, body in kernels.items():
        assert "QMMA" not in body, name
        assert re.search(r"F2FP\.F16\.E[45]M[32]\.UNPACK_B", body), name
        assert "HMMA.16816.F32" in body, name


@pytest.mark.slow
def test_ptxas_report_has_no_spills(wheelhouse):
    """No spills in this plugin's mma.sync GEMM and quantize kernels on either arch (the
    Hopper wgmma kernels, empty stubs on sm_89, are tests/fp8/test_fp8_sm90.py's)."""
    import json

    report = json.loads((wheelhouse / "build-report-cu130.json").read_text())
    kernels = next(p for p in report["packages"] if p["name"] == "astrai-fp8")["kernels"]
    ours = [k for k in kernels if "sm90" not in k["kernel"]
            and re.search(r"fp8_(gemm|quantize|quantize_transpose)_kernel<", k["kernel"])]
    for arch in ("sm_89", "sm_90a", "sm_120"):
        # GEMM + quantize (3 inputs x 2 formats x 2 kernels)
        assert len([k for k in ours if k["arch"] == arch]) == 28 + 12, arch
    spills = [k for k in ours if k["spill_stores"] or k["spill_loads"]]
    assert not spills, spills
    assert all(k["registers"] <= 255 for k in ours)


@pytest.mark.slow
def test_the_binary_carries_the_hopper_planner(compiled):
    """``_fp8_ops.sm90`` is planning.h as the binary runs it: the plans of the host-only build
    the CPU tests use (tests/fp8/test_fp8_sm90.py), trace included."""
    host, bound = sm90_planner(), compiled.sm90
    assert [c.name for c in bound.TILE_CONFIGS] == [c.name for c in host.TILE_CONFIGS]
    for (m, n, k), accum, sms in itertools.product(
            ((1, 8192, 8192), (64, 28672, 8192), (1000, 1000, 1024), (8192, 8192, 8192), (128, 128, 40)),
            ("promote", "fast"), (132, 114)):
        got = bound.plan(bound.ProblemShape(m, n, k), bound.DeviceLimits(9, 0, sms, 232448), accum)
        want = host.plan(host.ProblemShape(m, n, k), host.DeviceLimits(9, 0, sms, 232448), accum)
        fields = ("ok", "config", "cluster", "tiles_m", "tiles_n", "num_tiles", "grid", "k_blocks", "cost", "trace")
        assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields], (m, n, k, accum, sms)


# ------------------------------------------------------------ C++ validation, no GPU
F32, BF16, E4M3, E5M2, I32 = 0, 2, 3, 4, 5


def _t(shape, dtype, ptr=4096, strides=None):
    if strides is None:
        strides = (shape[1], 1) if len(shape) == 2 else tuple(1 for _ in shape)
    return (ptr, tuple(shape), tuple(strides), dtype)


M, N, K = 64, 48, 32
GEMM_OK = dict(a=_t((M, K), E4M3), b=_t((K, N), E4M3, 8192), scale=_t((), F32, 16384, ()), bias=None,
               out=_t((M, N), BF16, 32768), trans_a=False, trans_b=False, stream=0)
GEMM_BAD = {
    "a dtype": (dict(a=_t((M, K), BF16)), r"a: expected float8_e4m3fn or float8_e5m2, got bfloat16"),
    "b dtype": (dict(b=_t((K, N), F32, 8192)), r"b: expected float8_e4m3fn or float8_e5m2, got float32"),
    "a 3-D": (dict(a=(4096, (1, M, K), (M * K, K, 1), E4M3)), r"a: expected 2 dims"),
    "zero size": (dict(a=_t((0, K), E4M3)), r"a: zero-size dimension"),
    "inner dims": (dict(b=_t((K + 1, N), E4M3, 8192)), r"b: inner dimensions differ"),
    "trans_b inner": (dict(trans_b=True), r"b: inner dimensions differ"),
    "out shape": (dict(out=_t((M, N + 1), BF16, 32768)), r"out: expected shape \[M, N\]"),
    "out dtype": (dict(out=_t((M, N), F32, 32768)), r"out: expected dtype bfloat16"),
    "bias shape": (dict(bias=_t((N + 1,), BF16, 65536)), r"bias: expected shape \[N\]"),
    "bias dtype": (dict(bias=_t((N,), F32, 65536)), r"bias: expected dtype bfloat16"),
    "scale elements": (dict(scale=_t((2,), F32, 16384)), r"scale: expected one element"),
    "scale dtype": (dict(scale=_t((), BF16, 16384, ())), r"scale: expected dtype float32"),
    "strided last dim": (dict(a=_t((M, K), E4M3, strides=(2 * K, 2))), r"a: the last dim must be contiguous"),
    "overlapping rows": (dict(a=_t((M, K), E4M3, strides=(K - 1, 1))), r"a: rows overlap"),
    "null a": (dict(a=_t((M, K), E4M3, ptr=0)), r"a: null data pointer"),
    "misaligned out": (dict(out=_t((M, N), BF16, 32769)), r"out: data pointer .* not 2-byte aligned"),
    "bad stream": (dict(stream=-1), r"stream: expected the stream handle"),
    "bad mainloop": (dict(mainloop="wgmma"), r"mainloop: expected 'auto' or 'mma_sync', got 'wgmma'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(GEMM_BAD))
def test_cpp_gemm_validation(compiled, case):
    _refused(compiled.gemm, GEMM_OK, *GEMM_BAD[case])


def _refused(entry, ok: dict, override: dict, message: str, located: bool = True) -> None:
    """``entry`` with ``ok``'s arguments changed by ``override`` raises ``ValueError`` matching
    ``message`` before any CUDA call; ``located``: the message names the check's source line."""
    with pytest.raises(ValueError, match=message) as err:
        entry(**dict(ok, **override))
    if located:
        assert re.search(r"\[check `.+` at [\w.]+:\d+\]", str(err.value)), str(err.value)


Q_OK = dict(x=_t((M, K), BF16), scale=_t((), F32, 16384, ()), q=_t((M, K), E4M3, 8192),
            q_t=(0, (0,), (1,), E4M3), amax=_t((), F32, 20480, ()), out_layout=0, stream=0)
Q_BAD = {
    "x dtype": (dict(x=_t((M, K), I32)), r"x: expected float32, float16 or bfloat16, got int32"),
    "layout": (dict(out_layout=3), r"out_layout: expected 0 \(q\), 1 \(q_t\) or 2 \(both\), got 3"),
    "q shape": (dict(q=_t((M, K + 1), E4M3, 8192)), r"q: expected shape \[M, K\] like x"),
    "q dtype": (dict(q=_t((M, K), BF16, 8192)), r"q, q_t: expected float8"),
    "q_t missing": (dict(out_layout=2), r"q_t: expected shape \[K, M\]"),
    "q not empty": (dict(out_layout=1, q_t=_t((K, M), E4M3, 12288)), r"q: must be empty when out_layout is 1"),
    "formats differ": (dict(out_layout=2, q_t=_t((K, M), E5M2, 12288)), r"q_t: dtype float8_e5m2 differs"),
    "amax": (dict(amax=_t((2,), F32, 20480)), r"amax: expected one element"),
    "x zero": (dict(x=_t((0, K), BF16)), r"x: zero-size dimension"),
    "x misaligned": (dict(x=_t((M, K), BF16, ptr=4097)), r"x: data pointer .*not .*aligned"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(Q_BAD))
def test_cpp_quantize_validation(compiled, case):
    _refused(compiled.quantize, Q_OK, *Q_BAD[case], located=False)


WM, WN, WK, F16 = 8, 48, 512, 1
WG_OK = dict(x=_t((WM, WK), BF16), w=_t((WN, WK), E4M3, 65536), w_scale=_t((WN,), F32, 131072),
             y=_t((WM, WN), BF16, 135168), ws=None, k_per_split=WK, stream=0)
WG_BAD = {
    "x dtype": (dict(x=_t((WM, WK), F32)), r"x: expected bfloat16 or float16, got float32"),
    "x rows": (dict(x=_t((65, WK), BF16)), r"x: at most 64 rows \(tokens\)"),
    "x K": (dict(x=_t((WM, 320), BF16), w=_t((WN, 320), E4M3, 65536)), r"x: K must be a multiple of 256"),
    "x misaligned rows": (dict(x=_t((WM, WK), BF16, strides=(WK + 4, 1))), r"x: rows must start 16 bytes apart"),
    "x misaligned": (dict(x=_t((WM, WK), BF16, ptr=4104)), r"x: data pointer .* not 16-byte aligned"),
    "w dtype": (dict(w=_t((WN, WK), BF16, 65536)), r"w: expected float8_e4m3fn or float8_e5m2, got bfloat16"),
    "w K": (dict(w=_t((WN, WK + 256), E4M3, 65536)), r"w: expected \[N, 512\]"),
    "w_scale shape": (dict(w_scale=_t((WN + 1,), F32, 131072)), r"w_scale: expected shape \[N\]"),
    "w_scale dtype": (dict(w_scale=_t((WN,), BF16, 131072)), r"w_scale: expected dtype float32"),
    "y dtype": (dict(y=_t((WM, WN), F16, 135168)), r"y: expected dtype bfloat16"),
    "y shape": (dict(y=_t((WM, WN + 1), BF16, 135168)), r"y: expected shape \[M, N\]"),
    "k_per_split": (dict(k_per_split=100), r"k_per_split: expected a positive multiple of 256"),
    "ws missing": (dict(k_per_split=256), r"ws: K splits .* need the float32 \[M, N\] workspace"),
    "ws shape": (dict(k_per_split=256, ws=_t((WM, WN + 1), F32, 262144)), r"ws: expected shape \[M, N\]"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(WG_BAD))
def test_cpp_weight_gemm_validation(compiled, case):
    _refused(compiled.weight_gemm, WG_OK, *WG_BAD[case])


QR_OK = dict(x=_t((WM, WK), BF16), q=_t((WM, WK), E4M3, 65536), scale=_t((WM,), F32, 131072), stream=0)
QR_BAD = {
    "x dtype": (dict(x=_t((WM, WK), F32)), r"x: expected bfloat16 or float16, got float32"),
    "x K": (dict(x=_t((WM, 36), BF16), q=_t((WM, 36), E4M3, 65536)), r"x: rows must start 16 bytes apart"),
    "x K multiple": (dict(x=_t((WM, 36), BF16, strides=(40, 1)), q=_t((WM, 36), E4M3, 65536, strides=(48, 1))),
                     r"x: K must be a multiple of 8, got 36"),
    "x misaligned": (dict(x=_t((WM, WK), BF16, ptr=4104)), r"x: data pointer .* not 16-byte aligned"),
    "q dtype": (dict(q=_t((WM, WK), E5M2, 65536)), r"q: expected dtype float8_e4m3fn"),
    "q shape": (dict(q=_t((WM + 1, WK), E4M3, 65536)), r"q: expected shape \[M, K\] like x"),
    "q rows": (dict(q=_t((WM, WK), E4M3, 65536, strides=(WK + 4, 1))), r"q: rows must start 8 bytes apart"),
    "scale shape": (dict(scale=_t((WM, 1), F32, 131072)), r"scale: expected shape \[M\]"),
    "scale dtype": (dict(scale=_t((WM,), BF16, 131072)), r"scale: expected dtype float32"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(QR_BAD))
def test_cpp_quantize_rows_validation(compiled, case):
    _refused(compiled.quantize_rows, QR_OK, *QR_BAD[case])


RM, RN, RK = 40, 4096, 512  # a W8A8 call of a decode step: per-token x, per-channel weights
GR_OK = dict(a=_t((RM, RK), E4M3), b=_t((RN, RK), E4M3, 1 << 20), a_scale=_t((RM,), F32, 1 << 24),
             b_scale=_t((RN,), F32, 1 << 25), out=_t((RM, RN), BF16, 1 << 26), stream=0)
GR_BAD = {
    "a dtype": (dict(a=_t((RM, RK), BF16)), r"a: expected float8_e4m3fn or float8_e5m2, got bfloat16"),
    "b K": (dict(b=_t((RN, RK + 16), E4M3, 1 << 20)), r"b: expected \[N, 512\] \(K as a's\)"),
    "b strided": (dict(b=_t((RN, RK), E4M3, 1 << 20, strides=(2 * RK, 2))), r"b: the last dim must be contiguous"),
    "a_scale [M, 1]": (dict(a_scale=_t((RM, 1), F32, 1 << 24)), r"a_scale: expected shape \[M\] \(one scale per row of a\)"),
    "b_scale shape": (dict(b_scale=_t((RN + 1,), F32, 1 << 25)), r"b_scale: expected shape \[N\]"),
    "b_scale dtype": (dict(b_scale=_t((RN,), BF16, 1 << 25)), r"b_scale: expected dtype float32"),
    "b_scale strided": (dict(b_scale=_t((RN,), F32, 1 << 25, strides=(2,))), r"b_scale: .*contiguous"),
    "out dtype": (dict(out=_t((RM, RN), F32, 1 << 26)), r"out: expected dtype bfloat16"),
    "out shape": (dict(out=_t((RM, RN - 1), BF16, 1 << 26)), r"out: expected shape \[M, N\]"),
    "out over b": (dict(out=_t((RM, RN), BF16, (1 << 20) + 64)), r"out: overlaps b"),
    "out over a_scale": (dict(out=_t((RM, RN), BF16, (1 << 24) - 64)), r"out: overlaps a_scale"),
    "null b_scale": (dict(b_scale=_t((RN,), F32, 0)), r"b_scale: null data pointer"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(GR_BAD))
def test_cpp_gemm_rowwise_validation(compiled, case):
    _refused(compiled.gemm_rowwise, GR_OK, *GR_BAD[case])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_89", "sm_90a", "sm_120"])
def test_quantize_rows_divides_like_torch_whatever_the_fast_math(so, arch):
    """The per-token quantize must give torch's bytes: an IEEE division (a refined reciprocal
    with its slow-path call, not a bare MUFU.RCP times x) and the saturating e4m3 conversion."""
    bodies = _sass_bodies(so, arch, "quantize_rows_kernel")
    assert len(bodies) == 2  # bfloat16, float16
    for body in bodies.values():
        assert "MUFU.RCP" in body and re.search(r"FFMA\.RM|FFMA\.RP|CALL", body)
        assert re.search(r"F2FP\.SATFINITE\.E4M3", body), "the saturating e4m3 conversion"


@pytest.mark.slow
def test_the_weight_gemm_plan_splits_k_until_the_sms_have_two_blocks(compiled):
    assert compiled.weight_gemm_plan(28672, 4096, 132) == 2048  # 224 blocks of 128 channels: 2 splits fill 264
    assert compiled.weight_gemm_plan(4096, 4096, 132) == 256  # 32 blocks: 16 splits (the most), a chunk each
    assert compiled.weight_gemm_plan(4096, 14336, 132) == 14336 // 8
    assert compiled.weight_gemm_plan(6144, 768, 132) == 768  # 768 = 3 chunks: no even split
    with pytest.raises(ValueError, match="k a multiple of 256"):
        compiled.weight_gemm_plan(4096, 100, 132)


ROWS, HIST = 6, 16
SU_OK = dict(hist=_t((ROWS, HIST), F32), pending=_t((ROWS,), F32, 8192), prev_scale=_t((ROWS,), F32, 12288),
             scale=_t((ROWS,), F32, 16384), scale_inv=_t((ROWS,), F32, 20480), factor=1 / 448,
             most_recent=False, stream=0)
SU_BAD = {
    "hist dtype": (dict(hist=_t((ROWS, HIST), BF16)), r"hist: expected dtype float32, got bfloat16"),
    "hist 0-d": (dict(hist=_t((), F32, 4096, ())), r"hist: expected \[\.\.\., L\]"),
    "hist no history": (dict(hist=_t((ROWS, 0), F32)), r"hist: the history length \(last dim\) must be >= 1"),
    "hist no rows": (dict(hist=_t((0, HIST), F32)), r"hist: expected at least one row"),
    "hist too many rows": (dict(hist=_t((2**31, 1), F32)), r"hist: at most 2147483647 rows"),
    "hist strided": (dict(hist=_t((ROWS, HIST), F32, strides=(2 * HIST, 1))), r"hist: must be contiguous"),
    "hist misaligned": (dict(hist=_t((ROWS, HIST), F32, 4098)), r"hist: data pointer .* not 4-byte aligned"),
    "pending numel": (dict(pending=_t((ROWS - 1,), F32, 8192)), r"pending: expected 6 elements"),
    "prev dtype": (dict(prev_scale=_t((ROWS,), BF16, 12288)), r"prev_scale: expected dtype float32"),
    "scale strided": (dict(scale=_t((ROWS,), F32, 16384, (2,))), r"scale: must be contiguous"),
    "scale_inv null": (dict(scale_inv=_t((ROWS,), F32, 0)), r"scale_inv: null data pointer"),
    "scale_inv overlaps scale": (dict(scale_inv=_t((ROWS,), F32, 16384 + 8)), r"scale_inv: overlaps scale"),
    "pending overlaps hist": (dict(pending=_t((ROWS,), F32, 4096 + 64)), r"pending: overlaps hist"),
    "prev overlaps hist": (dict(prev_scale=_t((ROWS,), F32, 4096)), r"prev_scale: overlaps hist"),
    "prev shifted into scale": (dict(prev_scale=_t((ROWS,), F32, 16384 + 4)), r"prev_scale: overlaps scale"),
    "bad stream": (dict(stream=-1), r"stream: expected the stream handle"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SU_BAD))
def test_cpp_scale_update_validation(compiled, case):
    _refused(compiled.scale_update, SU_OK, *SU_BAD[case])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_89", "sm_90a", "sm_120"])
def test_scale_update_is_ieee_whatever_the_fast_math(so, arch):
    """The plugin builds with --use_fast_math; the update's multiply and reciprocal must
    still round like torch's (no FTZ multiply, a refined reciprocal with a subnormal path,
    not a bare MUFU.RCP). Spill-free is checked from the ptxas report below."""
    bodies = _sass_bodies(so, arch, "scale_update_kernel")
    assert len(bodies) == 2, sorted(bodies)  # max and most_recent
    for name, body in bodies.items():
        assert re.search(r"\bFMUL\b(?!\.FTZ)", body) and "FMUL.FTZ" not in body, name
        assert "MUFU.RCP" in body and re.search(r"FFMA\.RM|FFMA\.RP", body), name
        assert "BAR.SYNC" in body and "SHFL.UP" in body, name


@pytest.mark.slow
def test_scale_update_kernels_do_not_spill(wheelhouse):
    import json

    report = json.loads((wheelhouse / "build-report-cu130.json").read_text())
    kernels = next(p for p in report["packages"] if p["name"] == "astrai-fp8")["kernels"]
    ours = [k for k in kernels if "scale_update_kernel" in k["kernel"]]
    assert sorted(k["arch"] for k in ours) == ["sm_120", "sm_120", "sm_89", "sm_89", "sm_90a", "sm_90a"]
    assert not [k for k in ours if k["spill_stores"] or k["spill_loads"] or k["registers"] > 64], ours


@pytest.mark.slow
def test_valid_arguments_reach_cuda_only_after_validation(compiled):
    import torch

    if torch.cuda.is_available():
        pytest.skip("valid arguments would launch on made-up pointers")
    with pytest.raises(RuntimeError, match=r"CUDA error cuda\w+"):
        compiled.gemm(**GEMM_OK)
    with pytest.raises(RuntimeError, match=r"CUDA error cuda\w+"):
        compiled.quantize(**Q_OK)
    with pytest.raises(RuntimeError, match=r"CUDA error cuda\w+"):
        compiled.quantize_rows(**QR_OK)
    with pytest.raises(ValueError, match=r"gemm_rowwise: the sm_90a kernel cannot take it: device query failed"):
        compiled.gemm_rowwise(**GR_OK)  # no device to run on: said, never launched
    # [S, R, L] histories as the core stacks them, prev_scale being scale itself
    batched = dict(SU_OK, hist=(4096, (2, 3, HIST), (3 * HIST, HIST, 1), F32),
                   pending=(8192, (2, 3), (3, 1), F32), prev_scale=SU_OK["scale"], most_recent=True)
    for args in (SU_OK, batched):
        with pytest.raises(RuntimeError, match=r"CUDA error cuda\w+"):
            compiled.scale_update(**args)
    info = compiled.build_info()
    assert info["sass_archs"] == ["sm_89", "sm_90a", "sm_120"] and info["cuda_version"] == "13.0"
