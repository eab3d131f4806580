"""ctypes access to the Hopper FP8 GEMM's C entry point (csrc/gemm/sm90/capi.cu).

Used by the sm_90 GPU tests and benchmark to call the kernel with torch's device pointers
and stream. The library is taken from $ASTRAI_SM90_LIB, else build/sm90/ in the repository,
else compiled there with nvcc (about a minute).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "packages" / "astrai-fp8" / "csrc" / "gemm" / "sm90"
DEFAULT_LIB = ROOT / "build" / "sm90" / "libastrai_fp8_sm90.so"
KINDS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
ACCUM = {"promote": 0, "fast": 1}


def build(target: Path = DEFAULT_LIB) -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler",
           "-fPIC", "-shared", "-I", str(SRC), "-I", str(ROOT / "packages" / "cuda-common" / "include"),
           str(SRC / "capi.cu"), "-o", str(target)]
    subprocess.run(cmd, check=True)
    return target


def load() -> ctypes.CDLL:
    path = Path(os.environ.get("ASTRAI_SM90_LIB", DEFAULT_LIB))
    if not path.exists():
        build(path)
    lib = ctypes.CDLL(str(path))
    f = lib.astrai_fp8_sm90_gemm
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    f.argtypes = [i64, i64, i64, vp, i64, vp, i64, vp, i64, ci, vp, vp, ci, ci, ci, ci, vp,
                  ctypes.c_char_p, ci]
    f.restype = ci
    return lib


class Sm90Error(RuntimeError):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def gemm(lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
         bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         accum: str = "promote", out_f32: bool = False, force_config: int = -1) -> torch.Tensor:
    """out = scale * a @ b.T + bias with a [M, K] and b [N, K] fp8, both K-major."""
    M, K = a.shape
    N = b.shape[0]
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.float32 if out_f32 else torch.bfloat16)
    msg = ctypes.create_string_buffer(4096)
    rc = lib.astrai_fp8_sm90_gemm(
        M, N, K, a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), out.data_ptr(),
        out.stride(0), int(out_f32), bias.data_ptr() if bias is not None else None,
        scale.data_ptr(), KINDS[a.dtype], KINDS[b.dtype], ACCUM[accum], force_config,
        torch.cuda.current_stream().cuda_stream, msg, len(msg))
    if rc != 0:
        raise Sm90Error(rc, msg.value.decode())
    return out
