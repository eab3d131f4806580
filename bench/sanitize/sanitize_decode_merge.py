"""The split decode on small shapes, for compute-sanitizer (memcheck, racecheck): the
in-kernel merge (every head dim, contiguous and paged, one merge in several chunks;
counters must be back at 0) and the combine kernel (up to 64 splits); results checked.

    compute-sanitizer --tool memcheck  python bench/sanitize/sanitize_decode_merge.py
    compute-sanitizer --tool racecheck python bench/sanitize/sanitize_decode_merge.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))  # attention_cases
from attention_cases import Paged, assert_close, direct_decode, rand, reference  # noqa: E402
from test_decode_merge_gpu import fused_decode, fused_paged_decode  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    bf = torch.bfloat16
    for D in (64, 128, 256):
        q = rand((2, 1, 32, D), bf)
        k, v = rand((2, 333, 8, D), bf), rand((2, 333, 8, D), bf)
        out, count = fused_decode(q, k, v, 7)
        assert_close(out, reference(q, k, v), bf, f"merged decode d{D}")
        cache = Paged([70, 1, 150], 16, 8, D, bf)
        q3 = rand((3, 1, 32, D), bf)
        out, count2 = fused_paged_decode(q3, cache, 5)
        for b in range(3):
            kb, vb = cache.gather(b)
            assert_close(out[b:b + 1], reference(q3[b:b + 1], kb[None], vb[None]), bf, f"merged paged d{D}")
        torch.cuda.synchronize()
        assert int(count.abs().sum()) == 0 and int(count2.abs().sum()) == 0, "counters not reset"
    # nh = 16 at D = 256: 64 splits merge in several shared-memory chunks
    q = rand((1, 1, 32, 256), torch.float16)
    k, v = rand((1, 2100, 2, 256), torch.float16), rand((1, 2100, 2, 256), torch.float16)
    out, count = fused_decode(q, k, v, 64)
    assert_close(out, reference(q, k, v), torch.float16, "merged decode in chunks")
    torch.cuda.synchronize()
    assert int(count.abs().sum()) == 0
    for D, splits in ((64, 3), (128, 40), (256, 64)):  # the combine kernel, one or two load rounds
        q = rand((2, 1, 16, D), bf)
        k, v = rand((2, 2100, 4, D), bf), rand((2, 2100, 4, D), bf)
        out, _ = fused_decode(q, k, v, splits, merged=False)
        assert_close(out, reference(q, k, v), bf, f"decode + combine d{D} s{splits}")
        out, _ = direct_decode(q, k, v)
        assert_close(out, reference(q, k, v), bf, f"decode (plan) + combine d{D}")
    print("sanitize decode merge ok")


if __name__ == "__main__":
    main()
