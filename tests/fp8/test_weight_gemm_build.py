"""The FP8-weight decode linear (csrc/weight_gemm.cuh), built waiting for a GPU: its standalone
test program keeps compiling for sm_89 and sm_90a without spills, and the kernel is what it says
(tensor-core mma on float16, the weights' bytes converted by the hardware instruction)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from build_helpers import find_tool

REPO = Path(__file__).resolve().parents[2]
FP8 = REPO / "packages" / "astrai-fp8" / "csrc"


@pytest.mark.parametrize("arch", ["sm_89", "sm_90a"])
def test_weight_gemm_compiles_clean_to_hmma_and_hardware_conversions(arch):
    nvcc = shutil.which("nvcc")
    cuobjdump = find_tool("cuobjdump")
    if not nvcc or not cuobjdump:
        pytest.skip("nvcc / cuobjdump not found")
    compute = arch.replace("sm_", "compute_")
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "weight_gemm_test")
        built = subprocess.run([nvcc, "-std=c++17", "-O3", "--use_fast_math", "-I", str(REPO / "packages" /
                                "cuda-common" / "include"), "-I", str(FP8), f"-gencode=arch={compute},code={arch}",
                                "-Xptxas", "-v", str(FP8 / "tests" / "weight_gemm_test.cu"), "-o", binary],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-3000:]
        reports = [line for line in built.stderr.splitlines() if "spill" in line]
        assert reports and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in reports), reports
        sass = subprocess.run([cuobjdump, "-sass", binary], capture_output=True, text=True, check=True).stdout
    kernels = re.split(r"\n\s*Function : ", sass)
    gemms = [k for k in kernels if "weight_gemm_kernel" in k.split("\n")[0]]
    assert len(gemms) == 16  # bfloat16 / float16 x e4m3 / e5m2 x 1 / 2 / 4 / 8 n-tiles of tokens
    for body in gemms:
        assert "HMMA.16816.F32" in body
        assert re.search(r"F2FP\.F16\.E[45]M[23]\.UNPACK_B", body), "the weights' bytes convert in hardware"
