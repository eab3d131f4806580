"""Small rotary launches for compute-sanitizer (memcheck): both kernel paths, ragged tails,
strided views, in place. Run: compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_rotary.py
"""

from __future__ import annotations

import importlib

import torch


def abi(t: torch.Tensor):
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), 0 if t.dtype == torch.float32 else 2


def main() -> None:
    module = importlib.import_module("astrai_rotary._rotary_emb")
    stream = torch.cuda.current_stream().cuda_stream
    for B, L, H, D, offset in [(1, 1, 3, 64, 0), (2, 7, 5, 128, 0), (1, 5, 3, 36, 0), (3, 9, 2, 64, 2)]:
        wide = torch.randn(B, L, H, D + 8, device="cuda", dtype=torch.bfloat16)
        x = wide[..., offset:offset + D]
        cos = torch.rand(L, D // 2, device="cuda")
        sin = torch.rand(L, D // 2, device="cuda")
        out = torch.empty(B, L, H, D, device="cuda", dtype=torch.bfloat16)
        module.rotary_emb(abi(x), abi(cos), abi(sin), abi(out), stream)
        module.rotary_emb(abi(x), abi(cos), abi(sin), abi(x), stream)  # in place
    torch.cuda.synchronize()
    print("sanitize_rotary: done")


if __name__ == "__main__":
    main()
