"""astrai-attention on a machine without a GPU: launch heuristics, and one build of the
plugin for sm_90a whose binaries are inspected (tensor-core SASS in every mma kernel,
no spills at head_dim <= 128 in the ptxas report) and whose compiled modules are called
with bad arguments (ValueError naming the argument, before any CUDA call) and asked for
their launch plans.

The heuristics are checked through ``csrc/heuristics.h`` itself, bound by a host-only
module (``csrc/tests/planner_module.cpp``, built with the C++ compiler, no CUDA toolkit):
there is no Python copy of the rules to drift. The kernel modules' plans must equal it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from build_helpers import find_tool, host_module, load_module, local_cuda
from wheel_cache import ATTENTION_ARCHS, plugin_wheel

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "packages" / "astrai-attention"

MODULES = ("_attn_decode", "_attn_prefill", "_attn_paged_decode", "_attn_paged_prefill")

pytestmark = pytest.mark.slow  # the plugin build (tests/conftest.py starts the slow modules first)


# -- heuristics: csrc/heuristics.h through a host-only binding ---------------------------


@pytest.fixture(scope="module")
def planner():
    csrc = PLUGIN / "csrc"
    return host_module("_attn_planner", csrc / "tests" / "planner_module.cpp",
                       [csrc / "heuristics.h", csrc / "common.h", csrc / "prefill_schedule.h"],
                       include_dirs=(csrc,))


def cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("group,hb,groups", [(1, 1, 1), (2, 2, 1), (3, 2, 2), (4, 4, 1), (5, 4, 2), (8, 4, 2),
                                             (32, 4, 8)])
def test_prefill_head_block(planner, group, hb, groups):
    for d in (64, 128, 256):
        assert planner.prefill_launch(group, d)[:2] == (hb, groups)
    rows = planner.Q_TILE_ROWS
    assert rows % hb == 0 and (rows // hb) % 16 == 0  # whole warps per head slot


def test_prefill_grid_matches_spec_example(planner):
    # q lengths [70, 10, 130] -> 6 host tiles; GQA 32/8 -> HB = 4, one head group per kv head
    assert planner.Q_TILE_ROWS == 64
    assert [planner.num_q_tiles(n) for n in (70, 10, 130)] == [2, 1, 3]
    hb, groups, warps, bpt = planner.prefill_launch(4, 128)
    assert (6 * bpt, 8 * groups) == (12, 8) and warps == 8  # 8 warps: 2 blocks per tile
    assert planner.prefill_launch(1, 128)[2] == 4 and planner.prefill_launch(4, 256)[2] == 4
    assert planner.prefill_launch(2, 64)[2] == 8
    assert planner.prefill_launch(4, 256)[3] == 4  # the spec's 4-warp layout: grid.x = 24 for 6 tiles
    for group in (1, 2, 3, 4, 8):
        for d in (64, 128, 256):
            hb, _, w, bpt = planner.prefill_launch(group, d)
            rows_per_slot = planner.Q_TILE_ROWS // bpt
            assert rows_per_slot * hb == 16 * w  # every warp has 16 rows


def test_decode_splits_fill_the_machine(planner):
    # B=1, GQA 32/8, kv 4096, 132 SMs: 8 blocks alone would idle the chip
    s = planner.decode_plan(1, 8, 4, 128, 4096, 132)
    assert 16 <= s <= planner.MAX_SPLITS
    assert 8 * s <= 2 * 132  # one wave
    # a batch that fills the machine needs no split (no combine pass)
    assert planner.decode_plan(64, 8, 4, 128, 4096, 132) == 1
    assert planner.decode_plan(16, 8, 4, 128, 4096, 132) == 2
    # one tile: nothing to split
    assert planner.decode_plan(1, 8, 4, 128, 64, 132) == 1
    assert planner.decode_plan(1, 8, 4, 256, 33, 132) == 1  # 2 tiles: a split costs its combine


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 16, 33, 64, 200])
@pytest.mark.parametrize("kv", [1, 63, 64, 65, 1000, 4096, 32768])
def test_decode_split_bounds(planner, batch, kv):
    for d in (64, 128, 256):
        s = planner.decode_plan(batch, 8, 4, d, kv, 132)
        tiles = cdiv(kv, planner.decode_kv_tile(d))
        assert 1 <= s <= min(planner.MAX_SPLITS, tiles)
        units = batch * 8 * planner.decode_head_groups(4)
        assert s == 1 or units < 2 * 132  # a launch that fills a wave is never split


# -- one plugin build for sm_90a ---------------------------------------------------------


def _tool(name: str) -> str:
    found = find_tool(name)
    if not found:
        pytest.skip(f"{name} not found")
    return found


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """(the compiled modules' folder, full build log) of the plugin wheel for sm_90a without
    PTX, from the toolkit on PATH: the ci/build-wheels build tests/packaging/test_pip_install.py
    installs, made once per source tree (tests/helpers/wheel_cache.py)."""
    cuda = local_cuda()
    if cuda is None:
        pytest.skip("nvcc is not on PATH")
    wheel = plugin_wheel("attention", cuda, ATTENTION_ARCHS, ptx=False)
    log = (wheel.parents[1] / f"logs-{wheel.parent.name}" / "astrai-attention.log").read_text()
    out = tmp_path_factory.mktemp("attn_build")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(out, [n for n in zf.namelist() if n.startswith("astrai_attention/")])
    return out / "astrai_attention", log


def _load(build_dir: Path, name: str):
    return load_module(name, next(build_dir.glob(f"{name}.*.so")))


def _ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """kernel -> {registers, stack, spill_stores, spill_loads} from ``-Xptxas -v``."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            out.setdefault(current, {}).update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                               spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            out.setdefault(current, {})["registers"] = int(m.group(1))
    return out


def test_no_spills_at_head_dim_up_to_128(build):
    _, log = build
    report = _ptxas_report(log)
    mma = {k: v for k, v in report.items() if re.search(r"(decode|prefill)_mma_kernel", k)}
    assert len(mma) >= 4 * 6, sorted(report)  # 4 ops x 2 dtypes x 3 head dims
    for name, r in mma.items():
        dim = int(re.search(r"Li(\d+)E", name).group(1))
        assert r["registers"] <= 255, (name, r)
        if dim <= 128:
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (name, r)


def test_alibi_decode_kernels_do_not_spill(build):
    """The decode kernel's ALiBi instantiation (AlibiVariant = RuntimeVariant: Variant<kRuntime, true,
    true>), one per dtype, head dim and page format of the decode ops, adds its bias in the masking
    pass: added before the logits, or with the steps held across the loop, the paged 16-bit d256
    body spilled."""
    _, log = build
    alibi = {k: v for k, v in _ptxas_report(log).items()
             if "decode_mma_kernel" in k and "VariantILNS0_7CapModeE1ELb1ELb1EE" in k}
    assert len(alibi) == 2 * 3 * 4, sorted(alibi)  # dtypes x head dims x (contiguous, paged 16-bit, e4m3, e5m2)
    for name, r in alibi.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (name, r)


# prefill + paged prefill, bf16 + fp16, d 64 / 128 / 256, plain + variant (window, soft-cap, sinks, ALiBi);
# and the wide K/V tiles of dense prefill at d128 (176 rows) and d256 (80), bf16 + fp16, plain + variant
HOPPER_PREFILL_KERNELS = 2 * 2 * 3 * 2 + 2 * 2 * 2


def test_hopper_prefill_has_no_spills(build):
    _, log = build
    ws = {k: v for k, v in _ptxas_report(log).items() if "prefill_ws_kernel" in k}
    assert len(ws) == HOPPER_PREFILL_KERNELS, sorted(ws)
    for name, r in ws.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (name, r)


def test_hopper_prefill_wgmma_is_not_serialized(build):
    # ptxas serializes every wgmma of a kernel where a branch joins with one in flight (C7518)
    _, log = build
    assert "C7518" not in log and "instructions are serialized" not in log, \
        [line for line in log.splitlines() if "serialized" in line][:3]


def test_wgmma_header_matches_its_generator():
    gen = load_module("astrai_attn_gen_wgmma", PLUGIN / "csrc" / "gen_wgmma.py")
    assert (PLUGIN / "csrc" / "wgmma_ops.cuh").read_text() == gen.render(), "re-run gen_wgmma.py"


@functools.cache  # two tests read it: one disassembly
def _sass_bodies(build_dir) -> dict[str, str]:
    cuobjdump = _tool("cuobjdump")
    env = dict(os.environ, PATH=str(Path(_tool("nvdisasm")).parent) + os.pathsep + os.environ.get("PATH", ""))
    bodies: dict[str, str] = {}
    for name in MODULES:
        so = next(build_dir.glob(f"{name}.*.so"))
        sass = subprocess.run([cuobjdump, "--dump-sass", str(so)], env=env, capture_output=True, text=True,
                              check=True).stdout
        assert "arch = sm_90a" in sass
        parts = re.split(r"Function : (\S+)", sass)
        for func, body in zip(parts[1::2], parts[2::2]):
            bodies[func] = bodies.get(func, "") + body
    return bodies


def test_hopper_prefill_is_warp_specialized_wgmma(build):
    build_dir, _ = build
    ws = {f: b for f, b in _sass_bodies(build_dir).items() if "prefill_ws_kernel" in f}
    assert len(ws) == HOPPER_PREFILL_KERNELS, sorted(ws)
    for func, body in ws.items():
        d = int(re.search(r"Li(\d+)E", func).group(1))
        wide = int(re.search(r"KVELi(\d+)ENS0_7Variant", func).group(1))  # kWideTileRows, 0: the default tiles
        bn = wide or (128 if d <= 128 else 64)  # K/V rows per tile
        # S = Q K^T reads both operands from shared memory: the destination, then one descriptor
        assert re.search(rf"HGMMA\.64x{bn}x16\.F32\S* R\d+, gdesc\[", body), f"{func}: no S = Q K^T wgmma"
        assert re.search(rf"HGMMA\.64x{d}x16\.F32.*tnspB", body), f"{func}: no P V wgmma with V transposed"
        assert "HMMA" not in body, f"{func}: mma.sync left in the wgmma kernel"
        assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, f"{func}: no register hand-over"
        if wide:  # a TMA-only producer
            assert "LDGSTS" not in body, f"{func}: cp.async in the wide tiles' TMA-only producer"
        else:
            assert "LDGSTS" in body and "ARRIVES.LDGSTSBAR" in body, f"{func}: no cp.async completing on an mbarrier"
        assert "UTMALDG.4D" in body, f"{func}: no TMA load of K/V tiles"
        assert "UTMASTG.4D" in body, f"{func}: no TMA store of O"
        assert not re.search(r"\b(STL|LDL)\b", body), f"{func}: local-memory traffic"


def test_mma_kernels_use_tensor_cores(build):
    build_dir, _ = build
    bodies = _sass_bodies(build_dir)
    mma = {f: b for f, b in bodies.items() if re.search(r"(decode|prefill)_mma_kernel", f)}
    assert len(mma) >= 24, sorted(bodies)
    for func, body in mma.items():
        assert re.search(r"HMMA\.16816\.F32", body), f"{func}: no HMMA.16816"
        fp8 = re.search(r"KvE(4M3|5M2)", func)
        if fp8 and "decode" in func:  # fp8 pages: bytes permuted straight into fragments (kv_fp8.cuh)
            assert "PRMT" in body and "F2FP" in body, f"{func}: no byte permutes or fp8 conversions"
            assert re.search(r"HMMA\.16816\.F32 ", body), f"{func}: no float16 P.V"
        else:  # the prefill widens fp8 tiles in shared memory, then reads them as 16-bit ones
            assert "LDSM" in body, f"{func}: no ldmatrix"
            assert not fp8 or "F2FP" in body, f"{func}: no fp8 conversions"
        assert "LDGSTS" in body, f"{func}: no cp.async"


def test_kernel_modules_bind_the_same_plans(build, planner):
    build_dir, _ = build
    dec, pdec = _load(build_dir, "_attn_decode"), _load(build_dir, "_attn_paged_decode")
    pre, ppre = _load(build_dir, "_attn_prefill"), _load(build_dir, "_attn_paged_prefill")
    assert dec.MAX_SPLITS == pdec.MAX_SPLITS == planner.MAX_SPLITS
    assert pre.Q_TILE_ROWS == ppre.Q_TILE_ROWS == planner.Q_TILE_ROWS
    for batch in (1, 3, 16, 64, 257):
        for kv in (1, 64, 65, 4096, 32768):
            for group in (1, 4, 8, 32):
                for d in (64, 128, 256):
                    want = planner.decode_plan(batch, 8, group, d, kv, 132)
                    assert dec.decode_plan(batch, 8, group, d, kv, 132) == want
                    assert pdec.decode_plan(batch, 8, group, d, kv, 132) == want
    for hq, hkv in ((8, 8), (32, 8), (24, 8), (64, 2)):
        for d in (64, 128, 256):
            assert pre.prefill_plan(hq, hkv, d) == planner.prefill_launch(hq // hkv, d)
    info = dec.build_info()
    assert info["sass_archs"] == ["sm_90a"] and info["no_mma"] is False


def _t(ptr, shape, dtype=2, strides=None):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return ptr, tuple(shape), tuple(strides), dtype


def _plugin_package():
    """The plugin's Python package from the source tree (its manifest code, nothing compiled)."""
    import importlib.util

    package = PLUGIN / "src" / "astrai_attention"
    spec = importlib.util.spec_from_file_location("astrai_attention", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    plugin = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("astrai_attention", plugin)
    spec.loader.exec_module(plugin)
    return plugin


def test_modules_apply_the_variants_the_manifest_states(build):
    plugin = _plugin_package()
    build_dir, _ = build
    stated = {op: op_spec.get("variants") for op, op_spec in plugin._OPS.items()}
    for name in MODULES:
        assert tuple(_load(build_dir, name).VARIANTS) == tuple(stated[name.removeprefix("_")]), name


PAGED_OPS = ("attn_paged_decode", "attn_paged_prefill")


def test_the_paged_ops_read_the_page_dtypes_the_manifest_states(build):
    plugin = _plugin_package()
    build_dir, _ = build
    ops = plugin._ops({"sass_archs": [], "no_mma": False})
    for name in PAGED_OPS:
        assert tuple(_load(build_dir, f"_{name}").KV_DTYPES) == tuple(ops[name]["kv_dtypes"]), name
    assert all("kv_dtypes" not in spec for name, spec in ops.items() if name not in PAGED_OPS)
    scalar_build = plugin._ops({"sass_archs": [], "no_mma": True})
    assert all("kv_dtypes" not in scalar_build[name] for name in PAGED_OPS)


def test_the_variant_argument_is_checked_before_any_launch(build):
    build_dir, _ = build
    dec = _load(build_dir, "_attn_decode")
    P = 1 << 20  # an aligned fake device address: validation fails before anything touches it
    q, kv = _t(P, [2, 1, 32, 128]), _t(P, [2, 100, 8, 128])
    for variant, match in (((-1.0, 0.0, -1, None), "scale"), ((0.0, float("nan"), -1, None), "logits_soft_cap"),
                           ((0.0, -2.0, -1, None), "logits_soft_cap"), ((0.0, 0.0, -2, None), "window_left"),
                           ((0.0, 0.0, -1, _t(P, [31], dtype=0)), r"sinks: expected shape \[q_heads\] = \[32\]"),
                           ((0.0, 0.0, -1, _t(P, [32], dtype=1)), "sinks: expected dtype float32"),
                           ((0.0, 0.0, -1, None, _t(P, [31], dtype=0)),
                            r"alibi_slopes: expected shape \[q_heads\] = \[32\]"),
                           ((0.0, 0.0, -1, None, _t(P, [32], dtype=1)), "alibi_slopes: expected dtype float32"),
                           ((0.0, 0.0, -1, None, _t(P, [32], dtype=0, strides=[2])), "alibi_slopes: must be contiguous"),
                           ((0.0, 0.0, -1, _t(P, [32], dtype=0, strides=[2])), "sinks: must be contiguous"),
                           ((0.0, 0.0, -1, None, None, None), "variant: expected"),
                           ((0.0, 0.0, -1), "variant: expected")):
        with pytest.raises(ValueError, match=match):
            dec.attn_decode(q, kv, kv, q, variant=variant)


def test_validation_names_the_argument(build):
    build_dir, _ = build
    dec = _load(build_dir, "_attn_decode")
    pre = _load(build_dir, "_attn_prefill")
    pdec = _load(build_dir, "_attn_paged_decode")
    ppre = _load(build_dir, "_attn_paged_prefill")
    P = 1 << 20  # an aligned fake device address: validation fails before anything touches it
    q, kv = _t(P, [2, 1, 32, 128]), _t(P, [2, 100, 8, 128])
    cases = [
        (lambda: dec.attn_decode(_t(P, [2, 1, 32, 96]), kv, kv, _t(P, [2, 1, 32, 96])), r"q: head_dim"),
        (lambda: dec.attn_decode(q, kv, _t(P, [2, 100, 8, 128], dtype=1), q), r"v: dtype"),
        (lambda: dec.attn_decode(q, _t(P, [2, 100, 6, 128]), _t(P, [2, 100, 6, 128]), q), r"q_heads"),
        (lambda: dec.attn_decode(q, kv, kv, q, _t(P, [2, 99], dtype=7)), r"mask: expected shape"),
        (lambda: dec.attn_decode(q, kv, kv, q, None, 65), r"num_splits"),
        (lambda: dec.attn_decode(q, kv, kv, q, None, 4), r"ws_o"),
        # the optional arrival counters of the in-kernel split merge: 2 x 8 units
        (lambda: dec.attn_decode(q, kv, kv, q, None, 4, _t(P, [4 * 2 * 32 * 128], dtype=0),
                                 _t(P, [4 * 2 * 32], dtype=0), 0, _t(P, [15], dtype=5)), r"ws_count: needs at least 16"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5), 4,
                                        _t(P, [4 * 2 * 32 * 128], dtype=0), _t(P, [4 * 2 * 32], dtype=0), 0,
                                        _t(P, [16], dtype=0)), r"ws_count: expected dtype int32"),
        (lambda: dec.attn_decode(_t(P + 2, [2, 1, 32, 128]), kv, kv, q), r"q: data pointer"),
        (lambda: dec.attn_decode(q, _t(P, [2, 100, 8, 128], strides=[100 * 8 * 130, 8 * 130, 130, 1]), kv, q),
         r"k: stride"),
        (lambda: pre.attn_prefill(_t(P, [2, 5, 32, 128]), kv, kv, _t(P, [2, 6, 32, 128])), r"out: shape"),
        (lambda: pre.attn_prefill(_t(P, [2, 5, 32, 128]), _t(P, [2, 0, 8, 128]), _t(P, [2, 0, 8, 128]),
                                  _t(P, [2, 5, 32, 128])), r"k: kv length"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=6), _t(P, [10], dtype=5), _t(P, [2], dtype=5)),
         r"kv_indptr: expected dtype int32"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [3], dtype=5)),
         r"kv_lens: expected \[batch\]"),
        (lambda: ppre.attn_paged_prefill(_t(P, [10, 32, 128]), _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]),
                                         _t(P, [10, 32, 128]), _t(P, [3], dtype=5), _t(P, [2], dtype=5),
                                         _t(P, [4], dtype=5), _t(P, [2], dtype=5), _t(P, [2], dtype=5),
                                         _t(P, [2], dtype=5)), r"kv_indptr: expected \[batch \+ 1\]"),
        (lambda: ppre.attn_paged_prefill(_t(P, [10, 32, 128]), _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]),
                                         _t(P, [10, 32, 128]), _t(P, [3], dtype=5), _t(P, [3], dtype=5),
                                         _t(P, [4], dtype=5), _t(P, [2], dtype=5), _t(P, [2], dtype=5),
                                         _t(P, [3], dtype=5)), r"q_tile_to_index"),
        # the paged KV append, alone and fused into the decode launch (checked before either launch)
        (lambda: pdec.kv_append(_t(P, [2, 8, 128]), _t(P, [2, 8, 128]), _t(P, [10, 16, 8, 128]),
                                _t(P, [10, 16, 8, 128]), _t(P, [2], dtype=5), 0),
         r"slots: expected dtype int64"),
        (lambda: pdec.kv_append(_t(P, [2, 8, 128]), _t(P, [2, 8, 64]), _t(P, [10, 16, 8, 128]),
                                _t(P, [10, 16, 8, 128]), _t(P, [2], dtype=6), 0),
         r"v_new: expected bfloat16 \[2, 8, 128\]"),
        (lambda: pdec.kv_append(_t(P, [2, 8, 128]), _t(P, [2, 8, 128]), _t(P, [10, 16, 4, 128]),
                                _t(P, [10, 16, 4, 128]), _t(P, [2], dtype=6), 0),
         r"k_cache: expected bfloat16 \[num_pages"),
        (lambda: pdec.kv_append(_t(P, [2, 8, 128]), _t(P, [2, 8, 128]), _t(P, [10, 16, 8, 128]),
                                _t(P, [10, 16, 8, 128]), _t(P, [3], dtype=6), 0),
         r"slots: expected one slot per new token"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [2, 1, 8, 128])),
         r"k_new: the append needs k_new, v_new and slots"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [2, 1, 8, 128]), v_new=_t(P, [2, 1, 8, 128]),
                                        slots=_t(P, [2], dtype=5)), r"slots: expected dtype int64"),
        # append_last: the decode kernel appends each request's last position (no slots)
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [2, 1, 8, 128]), v_new=_t(P, [2, 1, 8, 128]),
                                        slots=_t(P, [2], dtype=6), append_last=True),
         r"slots: append_last derives each request's row from the page table"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [2, 1, 8, 128]), append_last=True),
         r"k_new: append_last needs k_new and v_new"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [2, 2, 8, 128]), v_new=_t(P, [2, 2, 8, 128]), append_last=True),
         r"k_new: append_last takes one new token per request, \[2, 1, 8, 128\]"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [2, 1, 4, 128]), v_new=_t(P, [2, 1, 4, 128]), append_last=True),
         r"k_new: append_last takes one new token per request.*got shape \[2, 1, 4, 128\]"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [1, 2, 8, 128], dtype=1), v_new=_t(P, [1, 2, 8, 128], dtype=1),
                                        append_last=True),
         r"k_new: dtype float16 differs from k_cache's bfloat16"),
        (lambda: pdec.attn_paged_decode(q, _t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), q,
                                        _t(P, [3], dtype=5), _t(P, [10], dtype=5), _t(P, [2], dtype=5),
                                        k_new=_t(P, [2, 8, 128]), v_new=_t(P, [2, 8, 64]), append_last=True),
         r"v_new: expected bfloat16 \[2, 8, 128\]"),
        # gather_pages: a step's pages copied in order (FP8 ones dequantized), before a long prefill
        (lambda: ppre.gather_pages(_t(P, [10, 16, 8, 128], dtype=3), _t(P, [10, 16, 8, 128], dtype=3),
                                   _t(P, [4], dtype=6), _t(P, [4, 16, 8, 128]), _t(P, [4, 16, 8, 128]), 0),
         r"kv_scales: a float8_e4m3fn cache needs the layer's \(k_scale, v_scale\)"),
        (lambda: ppre.gather_pages(_t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), _t(P, [4], dtype=5),
                                   _t(P, [4, 16, 8, 128]), _t(P, [4, 16, 8, 128]), 0), r"source: expected dtype int64"),
        (lambda: ppre.gather_pages(_t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), _t(P, [4], dtype=6),
                                   _t(P, [3, 16, 8, 128]), _t(P, [4, 16, 8, 128]), 0),
         r"k_out: expected shape \[len\(source\), page_size, Hkv, D\]"),
        (lambda: ppre.gather_pages(_t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128]), _t(P, [4], dtype=6),
                                   _t(P, [4, 16, 8, 128], dtype=1), _t(P, [4, 16, 8, 128], dtype=1), 0),
         r"k_out: dtype float16 differs"),
        (lambda: ppre.gather_pages(_t(P, [10, 16, 8, 128]), _t(P, [10, 16, 8, 128], strides=[16 * 8 * 256, 8 * 256,
                                                                                              128, 1]),
                                   _t(P, [4], dtype=6), _t(P, [4, 16, 8, 128]), _t(P, [4, 16, 8, 128]), 0),
         r"k_cache: each page must be contiguous and v_cache laid out alike"),
        (lambda: ppre.gather_pages(_t(P, [10, 16, 8, 128], dtype=4), _t(P, [10, 16, 8, 128], dtype=4),
                                   _t(P, [4], dtype=6), _t(P, [4, 16, 8, 128]), _t(P, [4, 16, 8, 128]), 0,
                                   kv_scales=(_t(P, [3], dtype=0), _t(P, [3], dtype=0))),
         r"k_scale: expected float32 \[1\] \(per tensor\) or \[kv_heads\] = \[8\]"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()


def test_cuda_failures_carry_their_code(build):
    """A CUDA failure arrives as RuntimeError with the cudaError_t attached (cuda_error,
    cuda_error_name): the fallback decides by the code. Here the first CUDA call fails
    (no GPU, no driver); on a CUDA machine the fake pointers would be launched, so skip."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("launches on fake pointers: only on a machine without a GPU")
    build_dir, _ = build
    dec = _load(build_dir, "_attn_decode")
    P = 1 << 20
    q, kv = _t(P, [2, 1, 32, 128]), _t(P, [2, 100, 8, 128])
    with pytest.raises(RuntimeError) as caught:
        dec.attn_decode(q, kv, kv, q)
    exc = caught.value
    assert isinstance(exc.cuda_error, int) and exc.cuda_error != 0
    assert exc.cuda_error_name.startswith("cudaError") and exc.cuda_error_name in str(exc)


STANDALONE = ("attn_test.cu", "attn_paged_test.cu")


def _run_together(commands: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """Runs the commands at once (the compiles take minutes each); name -> (returncode, stderr)."""
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name, cmd in commands.items()}
    return {name: (proc.wait(), proc.communicate()[1]) for name, proc in procs.items()}


def test_standalone_tests_compile():
    """csrc/tests/*.cu keep building with the command in their header (host code and PTX;
    the plugin build above already runs ptxas over the same kernels)."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc is not on PATH")
    commands = {}
    for name in STANDALONE:
        header = (PLUGIN / "csrc" / "tests" / name).read_text().splitlines()[:10]
        assert any(line.lstrip("/ ").startswith("nvcc") for line in header), f"{name}: no build command"
        commands[name] = [nvcc, "-std=c++17", "-I", str(PLUGIN / "csrc"), "-I", str(REPO / "packages" /
                          "cuda-common" / "include"), "-gencode=arch=compute_90a,code=compute_90a", "-O1",
                          "--expt-relaxed-constexpr", "-Xcompiler", "-fopenmp", "-c",
                          "-o", os.devnull, str(PLUGIN / "csrc" / "tests" / name)]
    for name, (rc, stderr) in _run_together(commands).items():
        assert rc == 0, f"{name}: {stderr[-3000:]}"


# Every build knob is decided (docs/kernels/attention.md, "Build knobs"): the standalone units
# compile the kernels as shipped, to sm_90a code without spills or serialized wgmma.
def test_standalone_units_compile_clean():
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc is not on PATH")
    commands = {name: [nvcc, "-std=c++17", "-I", str(PLUGIN / "csrc"), "-I", str(REPO / "packages" / "cuda-common" /
                       "include"), "-gencode=arch=compute_90a,code=sm_90a", "-O3", "--use_fast_math",
                       "--expt-relaxed-constexpr", "-Xcompiler", "-fopenmp", "-Xptxas", "-v", "-c",
                       "-o", os.devnull, str(PLUGIN / "csrc" / "tests" / name)] for name in STANDALONE}
    for name, (rc, stderr) in _run_together(commands).items():
        assert rc == 0, f"{name}: {stderr[-3000:]}"
        assert "C7518" not in stderr, f"{name}: ptxas serialized wgmma"
        reports = [line for line in stderr.splitlines() if "spill" in line]
        assert reports, f"{name}: no ptxas report"
        spills = [line for line in reports if " 0 bytes spill stores, 0 bytes spill loads" not in line]
        assert not spills, (name, spills[:5])


def test_custom_ops_have_fake_impls():
    """The four ops trace without the plugin: their fake implementations give the shapes."""
    import torch

    import astrai.extension.ops.attention  # noqa: F401  (registers torch.ops.astrai.attn_*)

    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 1, 32, 128, **meta), torch.empty(2, 100, 8, 128, **meta)
    assert torch.ops.astrai.attn_decode(q, k, k, None).shape == q.shape
    qp = torch.empty(2, 70, 32, 128, **meta)
    assert torch.ops.astrai.attn_prefill(qp, k, k, None, True).shape == qp.shape
    cache = torch.empty(10, 16, 8, 128, **meta)
    idx = torch.empty(3, device="meta", dtype=torch.int32)
    assert torch.ops.astrai.attn_paged_decode(q, cache, cache, idx, idx, idx[:2]).shape == q.shape
    packed = torch.empty(140, 32, 128, **meta)
    assert torch.ops.astrai.attn_paged_prefill(packed, cache, cache, idx, idx, idx, idx[:2], idx, idx,
                                               True).shape == packed.shape
