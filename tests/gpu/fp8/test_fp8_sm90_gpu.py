"""The Hopper FP8 GEMM (wgmma + TMA, sm_90a) on an H200, against a float32 reference.

Called through its C entry point (``csrc/gemm/sm90/capi.cu``, via ``sm90_capi``) with torch's
pointers and stream. Fresh random operands per case, outputs poisoned with NaN before the
call, ``||out - ref|| / ||ref||`` against ``scale * a.float() @ b.float().T + bias`` (fp8
products are exact in fp32; the fp32 sum is the reference).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))  # sm90_capi, also when run as a script

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LLM_NK = [(8192, 8192), (28672, 8192), (8192, 28672), (10240, 8192)]
BF16_TOL = 8e-3  # the bf16 rounding of the output alone gives ~1.7e-3


@pytest.fixture(scope="module")
def lib():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    import sm90_capi
    return sm90_capi.load()


def _operands(M, N, K, fa=E4M3, fb=E4M3, bias=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(M, K, device="cuda", generator=g) * 2).to(fa)
    b = (torch.randn(N, K, device="cuda", generator=g) * 2).to(fb)
    scale = torch.rand((), device="cuda", generator=g) * 0.5 + 0.1
    bb = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16) if bias else None
    return a, b, scale, bb


def _reference(a, b, scale, bias):
    ref = (a.float() @ b.float().t()) * scale
    return ref + bias.float() if bias is not None else ref


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def _run(lib, a, b, scale, bias, accum="promote", out_f32=False, ldc_pad=0):
    import sm90_capi
    M, N = a.shape[0], b.shape[0]
    dtype = torch.float32 if out_f32 else torch.bfloat16
    full = torch.full((M, N + ldc_pad), float("nan"), device="cuda", dtype=dtype)
    out = full[:, :N]
    sm90_capi.gemm(lib, a, b, scale, bias=bias, out=out, accum=accum, out_f32=out_f32)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) outputs"
    if ldc_pad:
        assert torch.isnan(full[:, N:]).all(), "wrote past N"
    return out


@pytest.mark.parametrize("N, K", LLM_NK)
@pytest.mark.parametrize("M", [1, 16, 128, 1024, 4096, 8192])
def test_llm_shapes(lib, M, N, K):  # M <= 64 runs the planner's swap-AB configs
    a, b, scale, bias = _operands(M, N, K, bias=M % 3 != 0, seed=M + N + K)
    ref = _reference(a, b, scale, bias)
    for accum in ("promote", "fast"):
        assert _rel(_run(lib, a, b, scale, bias, accum), ref) < BF16_TOL, accum


ODD = [(1088, 1088, 1088), (77, 300, 272), (129, 257, 144), (1, 1, 16), (3000, 5000, 4000),
       (1000, 999, 1008), (256, 8, 48), (64, 200, 16)]
CLUSTER_CONFIGS = (4, 5, 6, 7)  # 2-CTA clusters: run only when forced (planning.h)
SWAP_CONFIGS = (8, 9, 10, 11, 12, 13)  # swap-AB (bn 16 / 32 / 64, promote / fast)
PIPE_CONFIG = 14  # promoted sums, two wgmma chains in turn


def _odd_case(lib, M, N, K, force) -> float:
    import sm90_capi
    a, b, scale, bias = _operands(M, N, K, bias=force % 2 == 0, seed=force)
    out = torch.full((M, N + 3), float("nan"), device="cuda", dtype=torch.bfloat16)
    sm90_capi.gemm(lib, a, b, scale, bias=bias, out=out[:, :N], force_config=force)
    torch.cuda.synchronize()
    assert torch.isfinite(out[:, :N]).all() and torch.isnan(out[:, N:]).all(), (M, N, K, force)
    return _rel(out[:, :N], _reference(a, b, scale, bias))


@pytest.mark.parametrize("M, N, K", ODD)
@pytest.mark.parametrize("force", [0, 1, 2, 3, PIPE_CONFIG])
def test_odd_sizes_and_k_tails_every_config(lib, M, N, K, force):
    assert _odd_case(lib, M, N, K, force) < BF16_TOL


SMALL_M_ODD = [(1, 1, 16), (1, 300, 272), (5, 129, 144), (16, 8192, 1040), (17, 1000, 1008),
               (33, 257, 4000), (64, 200, 16), (77, 300, 272)]


@pytest.mark.parametrize("M, N, K", SMALL_M_ODD)
@pytest.mark.parametrize("force", SWAP_CONFIGS)
def test_swap_ab_configs(lib, M, N, K, force):
    """Forced swap-AB configs, also where M exceeds bn (several tile columns over M),
    with ragged N (a partial 128-row tile over N) and K tails; nothing written past N."""
    assert _odd_case(lib, M, N, K, force) < BF16_TOL


@pytest.mark.parametrize("M", [1, 7, 16, 24, 48, 64])
@pytest.mark.parametrize("fa, fb", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_small_m_planned_with_formats_and_padding(lib, M, fa, fb):
    """The planner's swap-AB choice (M <= 64) with every mixed format pairing (the kernel's
    operands swap, so their formats must too), fp32 output and a padded ldc."""
    a, b, scale, bias = _operands(M, 2304, 1024, fa, fb, seed=M)
    ref = _reference(a, b, scale, bias)
    for accum in ("promote", "fast"):
        assert _rel(_run(lib, a, b, scale, bias, accum, ldc_pad=8), ref) < BF16_TOL, accum
        assert _rel(_run(lib, a, b, scale, bias, accum, out_f32=True), ref) < 2e-3, accum


def test_cluster_configs_in_a_subprocess(lib):
    """The multicast configs on odd shapes (an odd count of tile rows leaves one CTA of a
    pair on a box fully outside A) and two LLM shapes; in a child process with a timeout,
    so a barrier protocol bug shows up as a failure, not a hung session."""
    import subprocess
    try:
        r = subprocess.run([sys.executable, __file__, "--cluster-check"], capture_output=True,
                           text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("cluster configs did not finish within 150 s (hang?)")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _cluster_check() -> None:
    lib = __import__("sm90_capi").load()
    worst = 0.0
    for force in CLUSTER_CONFIGS:
        for M, N, K in ODD + [(1024, 8192, 8192), (8192, 8192, 8192)]:
            rel = _odd_case(lib, M, N, K, force)
            print(f"config {force} {M}x{N}x{K}: rel {rel:.2e}", flush=True)
            assert rel < BF16_TOL, (force, M, N, K, rel)
            worst = max(worst, rel)
    print(f"cluster configs ok, worst rel {worst:.2e}")


@pytest.mark.parametrize("K", [128, 256, 384, 8192, 28672])
def test_pipelined_promotion_matches_the_plain_one(lib, K):
    """Config 14 (two chains in turn) adds the same 128-long chunks in the same order as
    config 2 (plain promotion): bit-identical outputs, for odd and even k-block counts."""
    import sm90_capi
    a, b, scale, bias = _operands(1024, 1024, K, seed=K)
    outs = [sm90_capi.gemm(lib, a, b, scale, bias=bias, out_f32=True, force_config=f) for f in (2, PIPE_CONFIG)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    assert _rel(outs[1], _reference(a, b, scale, bias)) < 1e-3


@pytest.mark.parametrize("fa, fb", [(E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)])
def test_format_pairs(lib, fa, fb):
    a, b, scale, bias = _operands(1000, 1000, 1024, fa, fb, seed=7)
    assert _rel(_run(lib, a, b, scale, bias, ldc_pad=8), _reference(a, b, scale, bias)) < BF16_TOL


def test_padded_operand_rows(lib):
    a, b, scale, bias = _operands(512, 768, 1040 + 48, seed=3)
    a, b = a[:, :1040], b[:, :1040]  # lda = ldb = 1088, a multiple of 16
    assert _rel(_run(lib, a, b, scale, bias), _reference(a, b, scale, bias)) < BF16_TOL


@pytest.mark.parametrize("K", [8192, 28672])
def test_promoted_sums_bound_the_error_at_long_k(lib, K):
    a, b, scale, _ = _operands(1024, 1024, K, bias=False, seed=K)
    ref = _reference(a, b, scale, None)
    promoted = _rel(_run(lib, a, b, scale, None, "promote", out_f32=True), ref)
    fast = _rel(_run(lib, a, b, scale, None, "fast", out_f32=True), ref)
    assert promoted < 5e-4  # Hopper's FP8 wgmma keeps ~2^-13 inside each 128-long chunk
    assert fast < 1e-2
    assert promoted < fast / 4


def test_rejections_before_launch(lib):
    import sm90_capi
    a, b, scale, _ = _operands(128, 128, 48, bias=False)
    with pytest.raises(sm90_capi.Sm90Error, match="multiple of 16") as e:
        sm90_capi.gemm(lib, a[:, :40], b[:, :40], scale)
    assert e.value.code == 1
    a2 = torch.empty(128 * 48 + 1, device="cuda", dtype=torch.uint8)[1:].view(E4M3).view(128, 48)
    with pytest.raises(sm90_capi.Sm90Error, match="16-byte aligned"):
        sm90_capi.gemm(lib, a2, b, scale)


def _plugin_ops():
    try:
        from astrai.extension import ops
        ops.fp8_gemm  # noqa: B018
        from astrai.extension.ops._plugin import require
        require("fp8_gemm")
    except Exception as e:  # noqa: BLE001 - reported as the failure, with the registry's reason
        pytest.fail(f"astrai-fp8 plugin not usable on this sm_90 device: {e}", pytrace=False)
    return ops


def test_plugin_fp8_gemm_runs_the_wgmma_kernel_for_k_major_operands(lib):
    """fp8_gemm(a, w, trans_b=True) on sm_90 = this kernel, bit for bit (promoted sums)."""
    ops = _plugin_ops()
    import sm90_capi
    for M, N, K in ((1024, 8192, 8192), (77, 300, 272), (4096, 1000, 1008)):
        a, w, scale, bias = _operands(M, N, K, seed=M)
        got = ops.fp8_gemm(a, w, scale, bias, trans_a=False, trans_b=True)
        want = sm90_capi.gemm(lib, a, w, scale, bias=bias, accum="promote")
        torch.cuda.synchronize()
        assert torch.equal(got, want), (M, N, K)
        y = ops.mm_fp8(a, w.t(), scale, bias)  # the linear layer's call: b = w.t()
        assert torch.equal(y, want), (M, N, K)


if __name__ == "__main__" and sys.argv[1:] == ["--cluster-check"]:
    _cluster_check()
