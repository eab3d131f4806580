"""The Hopper (sm_90a) FP8 GEMM on a machine without a GPU.

* Planning (``csrc/gemm/sm90/planning.h``, the C++ the binary runs, bound for Python by
  ``planning_bind.h`` and built here with the host compiler): which shapes the path takes,
  the reasons it gives when it cannot, the tile choice by wave math, the shared-memory
  fallback.
* The device code compiled for ``sm_90a``: the SASS holds ``QGMMA`` (FP8 wgmma) and
  ``UTMALDG`` (TMA loads; ``.MULTICAST`` in the 2-CTA cluster configs), ``setmaxnreg``, no ``F2FP...UNPACK_B`` (the fp16 emulation of the
  mma.sync path); ptxas reports no spills, no stack frame, and no serialized wgmma.
* The generated wgmma wrapper header matches its generator.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from build_helpers import find_tool, load_module, sm90_planner

REPO = Path(__file__).resolve().parents[2]
SM90 = REPO / "packages" / "astrai-fp8" / "csrc" / "gemm" / "sm90"


def _load(name: str, path: Path):
    return load_module(name, path, register=True)


sp = sm90_planner()  # the same module as _fp8_ops.sm90, without nvcc
H200 = sp.H200


def _plan(M, N, K, accum="promote", **kw):
    return sp.plan(sp.ProblemShape(M, N, K, **kw), H200, accum)


# ============================================================ planning (pure, fast)
def _cfg(p):
    return sp.TILE_CONFIGS[p.config]


def test_takes_llm_shapes_with_the_wide_tiles():
    for N, K in ((8192, 8192), (28672, 8192), (8192, 28672)):
        fast, prom = _plan(8192, N, K, "fast"), _plan(8192, N, K, "promote")
        assert (_cfg(fast).bn, _cfg(fast).promote, fast.cluster) == (256, False, 1)
        # promoted: the pipelined promotion's 128-wide tiles (config 14)
        assert (prom.config, _cfg(prom).bn, prom.cluster) == (14, 128, 1)
    p = _plan(8192, 8192, 8192, "fast")
    assert (p.tiles_m, p.tiles_n, p.num_tiles, p.grid, p.k_blocks) == (64, 32, 2048, 132, 64)


def test_cluster_configs_run_only_when_forced_and_count_tile_pairs():
    assert all(not c.enabled for c in sp.TILE_CONFIGS if c.cluster == 2)
    for M in (16, 1024, 8192):
        for accum in ("promote", "fast"):
            assert _plan(M, 8192, 8192, accum).cluster == 1
    p = sp.plan(sp.ProblemShape(8192, 8192, 8192), H200, force_config=4)
    # 64 x 32 tiles of 128 x 256 in 32 x 32 pairs sharing B, 66 pairs at a time
    assert (p.cluster, p.tiles_m, p.tiles_n, p.num_tiles, p.grid) == (2, 32, 32, 1024, 132)
    p = sp.plan(sp.ProblemShape(16, 8192, 8192), H200, force_config=7)  # one CTA of each pair idle
    assert p.grid == 2 * p.num_tiles == 128 and p.tiles_m == 1
    p = sp.plan(sp.ProblemShape(1, 1, 16), H200, force_config=6)
    assert (p.grid, p.k_blocks) == (2, 1)


def test_wave_math_prefers_narrow_tiles_when_wide_ones_quantise_badly():
    # 1024 x 10240: 320 wide tiles = 2.4 waves (3 rounds) vs 640 narrow = 4.8 (5 rounds)
    p = _plan(1024, 10240, 8192, "fast")
    assert _cfg(p).bn == 128 and p.num_tiles == 640
    assert any("320 tiles, 3 rounds" in line for line in p.trace)


def test_promoted_sums_keep_192_wide_tiles_where_they_need_fewer_rounds():
    # N = 132 * 192: one round of 192-wide tiles against two of 128-wide ones
    p = _plan(128, 132 * 192, 4096, "promote")
    assert (p.config, p.num_tiles) == (1, 132)
    assert _plan(128, 8192, 4096, "promote").config == 14
    assert not sp.TILE_CONFIGS[2].enabled  # the same tile as 14 without the pipelining


def test_small_problems_use_one_cta_per_tile_or_split_k_over_a_cluster():
    p = _plan(16, 8192, 8192, "fast")  # swap-AB: 64 tiles of 128 rows over N
    assert p.grid == p.num_tiles == 64 and (p.tiles_m, p.tiles_n, p.split) == (64, 1, 1)
    p = _plan(16, 8192, 8192, "promote")  # the same tiles, K shared by two CTAs each
    assert (p.config, p.num_tiles, p.split, p.k_per_split, p.grid) == (15, 64, 2, 32, 128)
    p = _plan(1, 1, 16, "fast")
    assert (p.grid, p.k_blocks) == (1, 1)


# Llama-3-8B's decoder linears at a 64-request decode step: (N, K) -> (split, k-blocks each, CTAs)
@pytest.mark.parametrize("N, K, split, k_per_split, grid", [
    (4096, 4096, 4, 8, 128),     # o: 32 tiles, four CTAs each
    (4096, 14336, 4, 28, 128),   # down
    (6144, 4096, 2, 16, 96),     # qkv: 48 tiles, three CTAs each would need 144 SMs
    (8192, 8192, 2, 32, 128),
])
def test_split_k_where_n_leaves_sms_idle(N, K, split, k_per_split, grid):
    for M, config in ((1, 15), (17, 16), (64, 17)):
        p = _plan(M, N, K, "promote")
        assert (p.config, p.split, p.k_per_split, p.grid) == (config, split, k_per_split, grid), (M, N, K)
        assert _cfg(p).split and _cfg(p).swap and p.grid == p.num_tiles * p.split
        assert any(f"K split {split} ways" in line for line in p.trace)
    assert _plan(64, N, K, "fast").split == 1  # promoted sums only


def test_split_k_ranks_cover_k_once_with_no_idle_rank():
    """What the kernel trusts of a split plan: rank r sums k-blocks [r * k_per_split, (r + 1) *
    k_per_split) clipped to k_blocks; every rank gets some, together all of them once, and the
    grid is one cluster of `split` CTAs a tile (split-K configs only, promoted sums)."""
    import itertools
    for m, n, k, sms in itertools.product((1, 9, 16, 17, 40, 64), (16, 200, 1000, 4096, 6144, 8192, 17000),
                                          (16, 128, 144, 640, 4096, 14336, 28688), (132, 114, 78)):
        p = sp.plan(sp.ProblemShape(m, n, k), sp.DeviceLimits(9, 0, sms, 232448), "promote")
        if not _cfg(p).split:
            assert p.split == 1
            continue
        ranges = [range(r * p.k_per_split, min(p.k_blocks, (r + 1) * p.k_per_split)) for r in range(p.split)]
        assert all(len(r) > 0 for r in ranges), (m, n, k, sms)
        assert [b for r in ranges for b in r] == list(range(p.k_blocks)), (m, n, k, sms)
        assert 2 <= p.split <= 4 and p.grid == p.num_tiles * p.split <= sms, (m, n, k, sms)


def test_the_launcher_remembers_plans_by_everything_plan_reads():
    """cached_plan (what run_gemm asks) gives plan()'s answer, trace included, whatever was asked
    before it: another M, alignment, SM count or accumulation is another plan, never the last one."""
    shapes = [sp.ProblemShape(m, 4096, 14336, a_addr=addr) for m in (1, 17, 64, 65) for addr in (0, 8)]
    devices = [sp.DeviceLimits(9, 0, sms, 232448) for sms in (132, 78)] + [sp.DeviceLimits(9, 0, 132, 101376)]
    for _ in range(2):  # the second pass answers from the cache
        for s in shapes:
            for d in devices:
                for accum in ("promote", "fast"):
                    want, got = sp.plan(s, d, accum), sp.cached_plan(s, d, accum)
                    fields = ("ok", "config", "split", "k_per_split", "grid", "num_tiles", "trace")
                    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    forced = sp.cached_plan(sp.ProblemShape(64, 4096, 4096), H200, "promote", force_config=12)
    assert forced.config == 12 and sp.cached_plan(sp.ProblemShape(64, 4096, 4096), H200, "promote").config == 17


def test_split_k_needs_idle_sms_and_two_k_blocks():
    p = _plan(64, 28672, 4096, "promote")  # gate_up: 224 tiles already fill the SMs
    assert (p.config, p.split, p.grid) == (12, 1, 132)
    assert any("224 tiles leave no SMs for a second CTA per tile (needs <= 66)" in line for line in p.trace)
    assert any("one k-block: nothing to split" in line for line in _plan(64, 4096, 128, "promote").trace)
    p = _plan(64, 4096, 5 * 128, "promote")  # 5 k-blocks over 4 CTAs would leave one idle: 3 of 2
    assert (p.split, p.k_per_split) == (3, 2)
    p = _plan(64, 4096, 2 * 128, "promote")
    assert (p.split, p.k_per_split, p.grid) == (2, 1, 64)
    # forced, a split config takes any shape: a cluster owns one tile whatever the grid (here
    # 224 tiles of one CTA, or 64 x 4 tiles over M > bn two ways)
    p = sp.plan(sp.ProblemShape(64, 28672, 4096), H200, force_config=17)
    assert (p.ok, p.split, p.grid) == (True, 1, 224)
    p = sp.plan(sp.ProblemShape(64, 8192, 4096), H200, force_config=15)
    assert (p.ok, p.num_tiles, p.split, p.k_per_split, p.grid) == (True, 256, 1, 32, 256)
    p = sp.plan(sp.ProblemShape(40, 1024, 4096), H200, force_config=15)  # 8 x 3 tiles: 4 ways
    assert (p.num_tiles, p.split, p.grid) == (24, 4, 96)


@pytest.mark.parametrize("M, bn", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64)])
@pytest.mark.parametrize("accum", ["promote", "fast"])
def test_small_m_swaps_a_and_b_with_the_narrowest_tile_that_covers_m(M, bn, accum):
    for N, K in ((8192, 8192), (28672, 8192), (1000, 1008)):
        c = _cfg(_plan(M, N, K, accum))
        assert (c.swap, c.bn, c.promote) == (True, bn, accum == "promote"), (M, N, K)
    p = _plan(M, 28672, 8192, accum)
    assert (p.tiles_m, p.tiles_n, p.num_tiles, p.grid) == (224, 1, 224, 132)


def test_swap_ab_stops_above_64_rows():
    for M in (65, 128, 1024):
        p = _plan(M, 8192, 8192)
        assert not _cfg(p).swap
        assert any("only for M <= 64" in line for line in p.trace)
    p = sp.plan(sp.ProblemShape(130, 1000, 1024), H200, force_config=8)  # forced: M over bn
    assert (p.ok, p.tiles_m, p.tiles_n) == (True, 8, 9)


def test_k_tail_counts_a_partial_block():
    assert _plan(128, 128, 4000).k_blocks == 32   # 31 full blocks + 32 (zero-filled by TMA)
    assert _plan(128, 128, 16).k_blocks == 1


@pytest.mark.parametrize("shape, reason", [
    (dict(M=128, N=128, K=40), "K must be a multiple of 16"),
    (dict(M=0, N=128, K=128), "must be positive"),
    (dict(M=128, N=128, K=128, lda=136), "multiples of 16 bytes"),
    (dict(M=128, N=128, K=128, ldb=64), ">= K"),
    (dict(M=128, N=128, K=128, a_addr=8), "16-byte aligned"),
    (dict(M=2**31, N=128, K=128), "int32"),
])
def test_rejections_name_the_reason(shape, reason):
    s = sp.ProblemShape(**shape)
    assert reason in sp.can_implement(s, H200)
    p = sp.plan(s, H200)
    assert not p.ok and reason in p.trace[0]


def test_other_archs_are_refused():
    for cc in ((8, 9), (10, 0), (12, 0)):
        d = sp.DeviceLimits(cc[0], cc[1], 132, 232448)
        assert "needs sm_90" in sp.can_implement(sp.ProblemShape(128, 128, 128), d)


def test_shared_memory_limit_falls_back_then_refuses():
    small = sp.DeviceLimits(9, 0, 132, 200000)  # the 4 x 48 KiB ring of 128x256 still fits
    assert sp.TILE_CONFIGS[sp.plan(sp.ProblemShape(8192, 8192, 8192), small, "fast").config].bn == 256
    smaller = sp.DeviceLimits(9, 0, 132, 190000)
    p = sp.plan(sp.ProblemShape(8192, 8192, 8192), smaller, "fast")
    assert not p.ok and "no tile config fits" in p.trace[-1]
    assert any("needs 197696 B shared memory" in line for line in p.trace)


def test_every_config_fits_the_h200_and_forcing_picks_it():
    for c in sp.TILE_CONFIGS:
        assert sp.smem_bytes(c) <= H200.smem_optin
        p = sp.plan(sp.ProblemShape(1000, 1000, 1024), H200, force_config=c.id)
        assert p.ok and p.config == c.id
    with pytest.raises(ValueError, match="accum"):
        sp.plan(sp.ProblemShape(1, 1, 16), H200, accum="bf16")


# ============================================================ generated header
def test_wgmma_header_matches_its_generator():
    gen = _load("astrai_sm90_gen_wgmma", SM90 / "gen_wgmma.py")
    assert (SM90 / "wgmma_fp8.cuh").read_text() == gen.render(), "re-run gen_wgmma.py"


# ============================================================ SASS (nvcc, sm_90a)
PROBE = r"""
#include "config.h"
#include "kernel.cuh"
namespace astrai::fp8::sm90 {
using K4 = Fp8Kind;
void* probes[] = {
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<256, 4, false, 1, K4::E4M3, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<192, 5, true, 1, K4::E4M3, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<128, 6, true, 1, K4::E4M3, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<128, 6, false, 1, K4::E4M3, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<256, 4, false, 2, K4::E4M3, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<192, 5, true, 2, K4::E4M3, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<256, 4, false, 2, K4::E5M2, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<16, 12, true, 1, K4::E4M3, K4::E4M3, true>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<64, 9, false, 1, K4::E4M3, K4::E5M2, true>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<128, 6, 2, 1, K4::E4M3, K4::E4M3>>,
    (void*)&fp8_gemm_sm90_kernel<GemmConfig<64, 9, true, 1, K4::E4M3, K4::E4M3, true, true>>,
};
}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    nvcc, cuobjdump = shutil.which("nvcc"), find_tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    d = tmp_path_factory.mktemp("sm90")
    (d / "probe.cu").write_text(PROBE)
    obj = d / "probe.o"
    r = subprocess.run([nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        "-I", str(SM90), "-I", str(REPO / "packages" / "cuda-common" / "include"),
                        "-c", str(d / "probe.cu"), "-o", str(obj)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env_path = str(Path(cuobjdump).parent)
    sass = subprocess.run([cuobjdump, "--dump-sass", str(obj)], capture_output=True, text=True, check=True,
                          env={"PATH": env_path + ":/usr/bin:/bin"}).stdout
    return r.stderr, sass


def _kernels(sass: str) -> dict[str, str]:
    parts = re.split(r"\n\s*Function : (\S+)", sass)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_sass_is_native_hopper_fp8(built):
    _, sass = built
    kernels = _kernels(sass)
    assert len(kernels) == 11
    for name, body in kernels.items():
        assert re.search(r"QGMMA\.64x\d+x32\.F32\.E[45]M[23]\.E[45]M[23]", body), name
        assert "UTMALDG" in body, name
        if "Li2ELNS" in name:  # ClusterM = 2: B through multicast, remote empty arrivals
            assert "UTMALDG.2D.MULTICAST" in body and "UCGABAR_WAIT" in body, name
            assert "SYNCS.ARRIVE.TRANS64.RED" in body, name
        assert "USETMAXREG" in body, name
        assert "SYNCS.PHASECHK" in body, name  # mbarrier waits
        assert not re.search(r"F2FP\.[A-Z0-9]+\.E[45]M[23]\.UNPACK_B", body), name
        assert "HMMA" not in body, name
        assert not re.search(r"\b(STL|LDL)\b", body), name  # no local memory
    split = [body for name, body in kernels.items() if name.endswith("Lb1ELb1EEEEEv14CUtensorMap_stS6_NS1_10GemmParamsE")]
    assert len(split) == 1  # split-K: two cluster barriers, 16-byte stores into rank 0's shared memory
    assert split[0].count("UCGABAR_WAIT") >= 2 and "ST.E.128" in split[0]
    assert all("UCGABAR" not in body for name, body in kernels.items() if "Li1ELNS" in name and body not in split)
    widths = set(re.findall(r"QGMMA\.64x(\d+)x32", sass))
    assert widths == {"16", "64", "128", "192", "256"}  # 16 / 64: the swap-AB configs
    assert sum("MULTICAST" in body for body in kernels.values()) == 3


def test_ptxas_reports_no_spills_and_no_serialised_wgmma(built):
    log, _ = built
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) == 11 and all(f == ("0", "0", "0") for f in frames), log
    assert "C7514" not in log, log  # "wgmma serialized": the mainloop would lose its overlap
    assert "C7508" not in log, log  # setmaxnreg ignored
