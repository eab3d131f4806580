"""Small rotary launches for compute-sanitizer (memcheck): every dtype, both layouts, both
kernel paths, ragged tails, strided views, positions, q+k in place, the backward, and the
fused paged write with a slot outside the cache (never written).
Run: compute-sanitizer --tool memcheck python3 bench/sanitize/sanitize_rotary.py
"""

from __future__ import annotations

import importlib

import torch

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 5, torch.int64: 6}


def abi(t: torch.Tensor | None):
    return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), CODES[t.dtype])


def main() -> None:
    module = importlib.import_module("astrai_elementwise._rotary_emb")
    stream = torch.cuda.current_stream().cuda_stream
    cos = torch.rand(64, 32, device="cuda")
    sin = torch.rand(64, 32, device="cuda")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for interleaved in (True, False):
            for B, L, H, D, rot, offset in [(1, 1, 3, 64, 64, 0), (2, 7, 5, 128, 64, 0), (1, 5, 3, 36, 36, 0),
                                            (3, 9, 2, 64, 32, 1)]:
                c, s = cos[:, :rot // 2], sin[:, :rot // 2]
                x = torch.randn(B, L, H, D + 8, device="cuda", dtype=dtype)[..., offset:offset + D]
                k = torch.randn(B, L, 1, D, device="cuda", dtype=dtype)
                pos = torch.randint(0, 64, (B, L), device="cuda", dtype=torch.int32)
                out, k_out = torch.empty(B, L, H, D, device="cuda", dtype=dtype), torch.empty_like(k)
                module.rotary(abi(x), None, abi(c), abi(s), None, abi(out), None, interleaved, False, stream)
                module.rotary(abi(x), abi(k), abi(c), abi(s), abi(pos), abi(out), abi(k_out), interleaved, True, stream)
                module.rotary(abi(x), abi(k), abi(c), abi(s), abi(pos[0]), abi(x), abi(k), interleaved, False, stream)
            q = torch.randn(5, 4, 64, device="cuda", dtype=dtype)
            kv = torch.randn(5, 2, 64, device="cuda", dtype=dtype)
            k_cache = torch.empty(3, 4, 2, 64, device="cuda", dtype=dtype)
            v_cache = torch.empty_like(k_cache)
            slots = torch.tensor([0, 11, 5, 12, -3], device="cuda")  # 12 and -3 lie outside the cache
            module.rope_paged_append(abi(q), abi(kv), abi(kv), abi(k_cache), abi(v_cache), abi(cos), abi(sin),
                                     abi(torch.arange(5, device="cuda")), abi(slots), abi(torch.empty_like(q)),
                                     interleaved, stream)
    torch.cuda.synchronize()
    print("sanitize_rotary: done")


if __name__ == "__main__":
    main()
