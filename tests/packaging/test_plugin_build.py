"""The plugin build, end to end on a machine without a GPU, with astrai-elementwise.

One build (ci/build-wheels for CUDA 13.0 with a reduced arch set that still has two
SASS archs and PTX: the `rotary_build` session fixture of tests/conftest.py, which every
rotary packaging test shares and tests/helpers/wheel_cache.py keeps on disk per source tree)
feeds every test: the wheel and its sdist, the
manifest against cuobjdump, the C++ validation of the compiled module, and an install of
``astrai[rotary]`` with pip from the per-CUDA index (ci/make-index) served on 127.0.0.1
into a fresh venv, where the entry point is discovered, ``astrai doctor`` lists the
plugin as installed but unusable (no GPU) and ``apply_rotary_emb`` runs the fallback.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from build_helpers import find_tool, load_module, plugin_manifest_of, require_nvcc
from elftools.elf.elffile import ELFFile
from wheel_cache import core_wheel

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "packages" / "cuda-common"
CUDA = "13.0"

pytestmark = pytest.mark.slow


def _cuobjdump() -> str:
    found = find_tool("cuobjdump")
    assert found, "cuobjdump not found (pip install nvidia-cuda-cuobjdump)"
    return found


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: no PYTHONPATH, no pip configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheelhouse(rotary_build, tmp_path_factory) -> Path:
    """The shared build (sm_80 + sm_90a + PTX) copied here with a fresh core wheel, indexed."""
    out = tmp_path_factory.mktemp("wheelhouse")
    shutil.copytree(rotary_build, out, dirs_exist_ok=True)
    core_wheel(out / "cu130")
    index = subprocess.run([sys.executable, str(REPO / "ci" / "make-index"), str(out)],
                           capture_output=True, text=True)
    assert index.returncode == 0, index.stdout + index.stderr
    return out


@pytest.fixture(scope="module")
def rotary_wheel(wheelhouse) -> Path:
    wheels = sorted((wheelhouse / "cu130").glob("astrai_elementwise-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def unpacked(rotary_wheel, tmp_path_factory) -> Path:
    """The wheel's package folder only (no dist-info, so no entry point leaks into this process)."""
    dest = tmp_path_factory.mktemp("unpacked")
    with zipfile.ZipFile(rotary_wheel) as zf:
        zf.extractall(dest, [n for n in zf.namelist() if n.startswith("astrai_elementwise/")])
    return dest / "astrai_elementwise"


@pytest.fixture(scope="module")
def compiled(unpacked):
    return load_module("astrai_elementwise._rotary_emb", next(unpacked.glob("_rotary_emb.*.so")))


@pytest.fixture(scope="module")
def plugin_manifest(unpacked) -> dict:
    return plugin_manifest_of(unpacked, "_astrai_elementwise_under_test")


# -- the wheel and its sdist -----------------------------------------------------------


def test_wheel_name_version_and_manylinux(wheelhouse, rotary_wheel):
    assert re.fullmatch(r"astrai_elementwise-0\.1\.0\+cu130-cp\d+-cp\d+-manylinux_2_\d+_x86_64\.whl",
                        rotary_wheel.name), rotary_wheel.name
    assert (wheelhouse / "cu130" / "astrai-0.1.0-py3-none-any.whl").is_file()
    report = json.loads((wheelhouse / "build-report-cu130.json").read_text())
    rotary = next(p for p in report["packages"] if p["name"] == "astrai-elementwise")
    assert rotary["manylinux"].startswith("manylinux_2_")
    assert rotary["wheels"][0]["size_bytes"] == rotary_wheel.stat().st_size
    assert rotary["build_s"] > 0
    # ptxas -v stayed in the log: one report per kernel per SASS arch, no spills
    archs = {k["arch"] for k in rotary["kernels"]}
    assert archs == {"sm_80", "sm_90a"}
    assert all(k["registers"] and k["spill_stores"] == 0 and k["spill_loads"] == 0 for k in rotary["kernels"])


def test_wheel_links_no_cuda_library(unpacked):
    """Static cudart: the module needs nothing from the CUDA toolkit at run time."""
    so = next(unpacked.glob("_rotary_emb.*.so"))
    with so.open("rb") as f:
        libs = [tag.needed for tag in ELFFile(f).get_section_by_name(".dynamic").iter_tags("DT_NEEDED")]
    assert libs, so
    assert not [lib for lib in libs if re.match(r"lib(cudart|cuda|torch|c10|python)", lib)], libs


def test_sdist_is_self_contained(wheelhouse):
    """The sdist carries the shared CUDA files as plain files: it builds alone (build-wheels
    built the wheel from it)."""
    sdist = next((wheelhouse / "sdist-cu130").glob("astrai_elementwise-*.tar.gz"))
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if "/" in m.name}
    for path in ("pyproject.toml", "CMakeLists.txt", "csrc/rotary_emb.cu", "csrc/rotary_kernel.cuh",
                 "cuda-common/cmake/AstraiPlugin.cmake", "cuda-common/include/astrai/check.h",
                 "cuda-common/python/astrai_cuda_version.py", "src/astrai_elementwise/__init__.py"):
        assert path in members and members[path].isfile(), path
    assert not [m for m in members.values() if m.issym() or m.islnk()]


# -- manifest vs the binary ----------------------------------------------------------------


def test_manifest_matches_cuobjdump(plugin_manifest, unpacked):
    so = next(unpacked.glob("_rotary_emb.*.so"))
    tool = _cuobjdump()
    elf = subprocess.run([tool, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", str(so)], capture_output=True, text=True, check=True).stdout
    sass_in_binary = set(re.findall(r"\.(sm_\d+[af]?)\.cubin", elf))
    ptx_in_binary = {"compute_" + a for a in re.findall(r"\.sm_(\d+[af]?)\.ptx", ptx)}
    assert sass_in_binary == set(plugin_manifest["sass_archs"]) == {"sm_80", "sm_90a"}
    assert ptx_in_binary == set(plugin_manifest["ptx_archs"]) == {"compute_90"}
    assert plugin_manifest["cuda"] == CUDA
    assert plugin_manifest["version"] == "0.1.0+cu130"


def test_manifest_is_valid_for_the_core(plugin_manifest):
    from astrai.extension.manifest import parse_manifest

    parsed = parse_manifest(plugin_manifest)
    assert parsed.name == "astrai-elementwise"
    assert set(parsed.ops) == {"rotary_emb", "rope_paged_append", "rms_norm", "fused_add_rms_norm", "silu_and_mul"}
    for op in parsed.ops.values():
        assert op.module == "astrai_elementwise._rotary_emb" and op.dtypes == ("float16", "bfloat16", "float32")


def test_the_fused_append_writes_the_page_dtypes_the_manifest_states(compiled, plugin_manifest):
    from astrai.extension.manifest import parse_manifest

    ops = parse_manifest(plugin_manifest).ops
    assert tuple(compiled.KV_DTYPES) == ops["rope_paged_append"].kv_dtypes == ("float8_e4m3fn", "float8_e5m2")
    assert all(not spec.kv_dtypes for name, spec in ops.items() if name != "rope_paged_append")


def test_build_info_of_the_compiled_module(compiled, plugin_manifest):
    info = compiled.build_info()
    assert info["cuda_version"] == CUDA
    assert info["sass_archs"] == plugin_manifest["sass_archs"]
    assert info["ptx_archs"] == plugin_manifest["ptx_archs"]
    assert info["archs"] == ["80-real", "90a-real", "90-virtual"]
    assert info["no_mma"] is False


# -- C++ validation: before any CUDA call, so it runs here --------------------------------

B, L, H, D = 2, 5, 3, 8
BF16, F32, F16 = 2, 0, 1


def _x(ptr=4096, shape=(B, L, H, D), strides=None, dtype=BF16):
    strides = strides or (L * H * D, H * D, D, 1)
    return (ptr, shape, strides, dtype)


def _cs(ptr=8192, shape=(L, D // 2), strides=(D // 2, 1), dtype=F32):
    return (ptr, shape, strides, dtype)


BAD_ARGS = {
    "null x": (dict(x=_x(ptr=0)), r"x: null data pointer"),
    "null out": (dict(out=_x(ptr=0)), r"out: null data pointer"),
    "null cos": (dict(cos=_cs(ptr=0)), r"cos: null data pointer"),
    "odd head_dim": (dict(x=_x(shape=(B, L, H, 7), strides=(L * H * 7, H * 7, 7, 1)),
                      out=_x(shape=(B, L, H, 7), strides=(L * H * 7, H * 7, 7, 1))),
                     r"x: head_dim \(last dim\) must be even and positive, got 7"),
    "zero head_dim": (dict(x=_x(shape=(B, L, H, 0)), out=_x(shape=(B, L, H, 0))), r"head_dim .* got 0"),
    "3-D x": (dict(x=(4096, (B, L, D), (L * D, D, 1), BF16)), r"x: expected 4 dims, got shape \[2, 5, 8\]"),
    "cos rows": (dict(cos=_cs(shape=(L + 1, D // 2))), r"cos: expected shape \[seq_len, head_dim/2\] = \[5, 4\]"),
    "sin cols": (dict(sin=_cs(shape=(L, D))), r"sin: expected shape \[seq_len, head_dim/2\] = \[5, 4\]"),
    "out shape": (dict(out=_x(shape=(B, L, H + 1, D))), r"out: shape \[2, 5, 4, 8\] must equal x's shape"),
    "x dtype int32": (dict(x=_x(dtype=5)), r"x: expected float16, bfloat16 or float32, got int32"),
    "cos dtype bf16": (dict(cos=_cs(dtype=BF16)), r"cos: expected dtype float32, got bfloat16"),
    "unknown dtype code": (dict(x=_x(dtype=42)), r"x: unknown dtype code 42"),
    "strided last dim": (dict(x=_x(strides=(2 * L * H * D, 2 * H * D, 2 * D, 2))), r"x: the last dim must be contiguous"),
    "misaligned": (dict(x=_x(ptr=4097)), r"x: data pointer 0x1001 is not 2-byte aligned"),
    "negative size": (dict(x=_x(shape=(B, -1, H, D))), r"x: negative size"),
    "shape/strides length": (dict(x=(4096, (B, L, H, D), (1, 1, 1), BF16)), r"x: shape .* and strides .* differ"),
    "not a tuple": (dict(x=[4096]), r"x: expected a tuple \(data_ptr, shape, strides, dtype_code\)"),
    "negative pointer": (dict(x=_x(ptr=-16)), r"x: data_ptr must be >= 0"),
    "negative stream": (dict(stream=-1), r"stream: expected the stream handle"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_cpp_validation_rejects_bad_arguments(compiled, case):
    override, message = BAD_ARGS[case]
    args = dict(x=_x(), cos=_cs(), sin=_cs(ptr=12288), out=_x(ptr=65536), stream=0)
    args.update(override)
    with pytest.raises(ValueError, match=message) as err:
        compiled.rotary_emb(**args)
    # the message names the failed check and where it is
    assert re.search(r"\[check `.+` at [\w.]+:\d+\]", str(err.value)), str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="valid arguments would launch on made-up pointers")
def test_valid_arguments_reach_cuda_only_after_validation(compiled):
    """Valid arguments pass validation and fail at the first CUDA call (no GPU here),
    as RuntimeError carrying the CUDA error; an empty tensor needs no CUDA at all."""
    with pytest.raises(RuntimeError, match=r"CUDA error cuda\w+"):
        compiled.rotary_emb(_x(), _cs(), _cs(ptr=12288), _x(ptr=65536), 0)
    empty = _x(shape=(0, L, H, D))
    assert compiled.rotary_emb(empty, _cs(), _cs(), empty, 0) is None


# -- pip install from the local per-CUDA index -------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def index_url(wheelhouse):
    handler = functools.partial(_QuietHandler, directory=str(wheelhouse))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cu130/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def venv(index_url, tmp_path_factory) -> Path:
    """A fresh venv with ``astrai[rotary]`` installed from the index. torch & co. come from
    this interpreter's site-packages through a .pth line (a plain path: its own .pth files,
    such as the editable core's, stay inactive), so nothing is downloaded."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, env=_clean_env())
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    (site / "zz_astrai_test_deps.pth").write_text(deps + "\n")
    # Python 3.11's venv brings an old setuptools that would shadow the one torch needs
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "setuptools"],
                   check=True, capture_output=True, env=_clean_env())
    pip = [str(python), "-m", "pip", "install", "--index-url", index_url, "--no-cache-dir"]
    # the core from the index first (the outer environment has its own astrai 0.1.0) ...
    first = subprocess.run(pip + ["--no-deps", "--ignore-installed", "astrai==0.1.0"],
                           capture_output=True, text=True, env=_clean_env())
    assert first.returncode == 0, first.stdout + first.stderr
    # ... then the extra resolves astrai-elementwise==0.1.0 to the index's 0.1.0+cu130
    second = subprocess.run(pip + ["astrai[rotary]"], capture_output=True, text=True, env=_clean_env())
    assert second.returncode == 0, second.stdout + second.stderr
    assert "astrai-elementwise-0.1.0+cu130" in second.stdout.replace("astrai_elementwise", "astrai-elementwise"), second.stdout
    return root


def _in_venv(venv: Path, code: str) -> str:
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          env=_clean_env(CUDA_VISIBLE_DEVICES=""), cwd=venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_index_links_carry_sha256(wheelhouse, rotary_wheel):
    page = (wheelhouse / "cu130" / "astrai-elementwise" / "index.html").read_text()
    digest = hashlib.sha256(rotary_wheel.read_bytes()).hexdigest()
    assert f"#sha256={digest}" in page
    assert 'href="astrai-elementwise/"' in (wheelhouse / "cu130" / "index.html").read_text()


def test_installed_from_the_index_with_the_cuda_tag(venv):
    out = _in_venv(venv, "import importlib.metadata as md, astrai, astrai_elementwise, json; "
                         "print(json.dumps([md.version('astrai-elementwise'), md.version('astrai'), "
                         "astrai.__file__, astrai_elementwise.__file__]))")
    rotary_version, core_version, core_file, plugin_file = json.loads(out)
    assert rotary_version == "0.1.0+cu130"
    assert core_version == "0.1.0"
    assert core_file.startswith(str(venv)) and plugin_file.startswith(str(venv))


def test_entry_point_discovered_without_importing_the_binary(venv):
    out = _in_venv(venv, """
import json, sys
from importlib.metadata import entry_points
from astrai.extension.registry import Registry
eps = [f"{e.name} = {e.value}" for e in entry_points(group="astrai.kernels")]
plugins = {p.name: (p.manifest is not None, p.rejected) for p in Registry().plugins()}
print(json.dumps({"eps": eps, "plugins": plugins, "loaded": "astrai_elementwise._rotary_emb" in sys.modules}))
""")
    found = json.loads(out)
    assert "elementwise = astrai_elementwise:manifest" in found["eps"]
    assert found["plugins"]["astrai-elementwise"] == [True, None]
    assert found["loaded"] is False


def test_doctor_lists_the_plugin_as_unusable_without_a_gpu(venv):
    proc = subprocess.run([str(venv / "bin" / "astrai"), "doctor", "--json"], capture_output=True, text=True,
                          env=_clean_env(CUDA_VISIBLE_DEVICES=""), cwd=venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    row = next(p for p in report["plugins"] if p["name"] == "astrai-elementwise")
    assert row["version"] == "0.1.0+cu130"
    assert row["sass_archs"] == ["sm_80", "sm_90a"] and row["ptx_archs"] == ["compute_90"]
    assert row["usable"] is False
    assert "no CUDA device" in row["reason"]
    op = next(o for o in report["ops"] if o["op"] == "rotary_emb")
    assert op["backend"] == "torch complex multiply"


def test_apply_rotary_emb_falls_back_in_the_venv(venv):
    out = _in_venv(venv, """
import json, torch
from astrai.extension.backend.rotary import apply_rotary_emb
from astrai.extension.ops import _plugin
x = torch.randn(2, 7, 4, 64, dtype=torch.bfloat16)
angle = torch.rand(7, 32, dtype=torch.float64) * 6.3
cos, sin = angle.cos().float(), angle.sin().float()
got = apply_rotary_emb(x, (cos, sin))
p = x.double().unflatten(-1, (32, 2))
c, s = angle.cos()[None, :, None], angle.sin()[None, :, None]
ref = torch.stack((p[..., 0] * c - p[..., 1] * s, p[..., 0] * s + p[..., 1] * c), -1).flatten(-2)
try:
    _plugin.require("rotary_emb")
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps({"dtype": str(got.dtype), "shape": list(got.shape),
                  "err": ((got.double() - ref).norm() / ref.norm()).item(), "error": error}))
""")
    result = json.loads(out)
    assert result["dtype"] == "torch.bfloat16" and result["shape"] == [2, 7, 4, 64]
    assert result["err"] < 4e-3  # bf16 rounding of the output
    assert "astrai-elementwise" in result["error"] and "pip install" in result["error"]


# -- the arch selection and the version tag, without a build -----------------------------------


def _resolve_archs(tmp_path, version: str, min_sm: int = 0, gpu: str | None = None,
                   **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "archs.cmake"
    script.write_text(f"""
set(CMAKE_CUDA_COMPILER_VERSION "{version}")
include("{COMMON / 'cmake' / 'AstraiPlugin.cmake'}")
astrai_resolve_cuda_archs({min_sm} sass ptx)
message("SASS=${{sass}}|PTX=${{ptx}}")
""")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAI_")}
    clean["PATH"] = "/usr/bin:/bin"  # no nvidia-smi: "auto" means the release list
    if gpu is not None:  # a fake nvidia-smi reporting one GPU of this compute capability
        bindir = tmp_path / "bin"
        bindir.mkdir()
        (bindir / "nvidia-smi").write_text(f"#!/bin/sh\necho {gpu}\n")
        (bindir / "nvidia-smi").chmod(0o755)
        clean["PATH"] = f"{bindir}:{clean['PATH']}"
    return subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True, env={**clean, **env})


def _archs(proc) -> tuple[str, str]:
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"SASS=(.*)\|PTX=(.*)", proc.stderr)
    return m.group(1), m.group(2)


@pytest.mark.parametrize("version, env, min_sm, want", [
    ("13.0.88", {}, 0, ("80;86;89;90a;100a;120", "120")),
    ("12.4.131", {}, 0, ("80;86;89;90a", "90")),
    ("13.0.88", {"ASTRAI_CUDA_ARCHS": "all"}, 89, ("89;90a;100a;120", "120")),
    ("12.4.131", {}, 89, ("89;90a", "90")),
    ("13.0.88", {}, 80, ("80;86;89;90a;100a;120", "120")),  # attention's MIN_SM 80 drops none of the release archs
    ("12.4.131", {}, 80, ("80;86;89;90a", "90")),
    ("13.0.88", {"ASTRAI_CUDA_ARCHS": "90a"}, 0, ("90a", "90")),
    ("13.0.88", {"ASTRAI_CUDA_ARCHS": "80,90a", "ASTRAI_CUDA_PTX": "0"}, 0, ("80;90a", "")),
    ("13.0.88", {"ASTRAI_CUDA_ARCHS": "sm_90a 120-virtual"}, 0, ("90a", "120")),
])
def test_arch_selection(tmp_path, version, env, min_sm, want):
    assert _archs(_resolve_archs(tmp_path, version, min_sm, **env)) == want


@pytest.mark.parametrize("env, min_sm, message", [
    ({"ASTRAI_CUDA_ARCHS": "80;86"}, 89, "leaves no arch"),
    ({"ASTRAI_CUDA_ARCHS": "ninety"}, 0, "cannot read 'ninety'"),
    ({"ASTRAI_CUDA_ARCHS": "native"}, 0, "nvidia-smi reports no GPU"),
])
def test_arch_selection_errors(tmp_path, env, min_sm, message):
    proc = _resolve_archs(tmp_path, "13.0.88", min_sm, **env)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("gpu, env, want", [
    ("9.0", {}, ("90a", "90")),
    ("12.0", {}, ("120", "120")),
    ("8.9", {"ASTRAI_CUDA_ARCHS": "native"}, ("89", "89")),
    ("9.0", {"ASTRAI_CUDA_ARCHS": "all"}, ("80;86;89;90a;100a;120", "120")),
])
def test_source_build_defaults_to_the_visible_gpu(tmp_path, gpu, env, want):
    assert _archs(_resolve_archs(tmp_path, "13.0.88", gpu=gpu, **env)) == want


def test_arch_selection_needs_a_known_cuda_major(tmp_path):
    proc = _resolve_archs(tmp_path, "11.8.89")
    assert proc.returncode != 0 and "no default arch list for CUDA 11.8" in proc.stderr


def test_version_tag_follows_the_toolkit(tmp_path, monkeypatch):
    provider = load_module("astrai_cuda_version", COMMON / "python" / "astrai_cuda_version.py")
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CUDACXX", str(fake))
    assert provider.dynamic_metadata("version", {"base": "0.1.0"}) == "0.1.0+cu124"
    with pytest.raises(RuntimeError, match="base"):
        provider.dynamic_metadata("version", {})


def test_no_mma_escape_hatch_is_recorded(tmp_path):
    """ASTRAI_NO_MMA=ON reaches the compile definitions and build_info.json (a configure, no
    compile); the wheel built without it records no_mma false (test_build_info_...)."""
    require_nvcc()  # CMake's project(... CUDA) finds the compiler
    cmakedir = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True,
                              text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAI_")}
    proc = subprocess.run(["cmake", "-S", str(REPO / "packages" / "astrai-elementwise"), "-B", str(tmp_path),
                           "-G", "Ninja", f"-Dpybind11_DIR={cmakedir}", f"-DPython_EXECUTABLE={sys.executable}",
                           "-DASTRAI_NO_MMA=ON", "-DASTRAI_CUDA_ARCHS=90a"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((tmp_path / "astrai_elementwise" / "build_info.json").read_text())
    assert (info["no_mma"], info["sass_archs"], info["ptx_archs"]) == (True, ["sm_90a"], ["compute_90"])
    assert "-DASTRAI_NO_MMA=1" in (tmp_path / "build.ninja").read_text()
