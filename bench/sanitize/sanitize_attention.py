"""A reduced attention sweep for compute-sanitizer (memcheck, racecheck): every module,
both dtypes, every head dim, ragged + paged shapes with tails; checks results too.

    compute-sanitizer --tool memcheck  python bench/sanitize/sanitize_attention.py
    compute-sanitizer --tool racecheck python bench/sanitize/sanitize_attention.py --small
    compute-sanitizer --tool memcheck  python bench/sanitize/sanitize_attention.py --variant   (every call
        with a window, a soft-cap, sinks and a scale: the kernels' variant paths)
    compute-sanitizer --tool memcheck  python bench/sanitize/sanitize_attention.py --alibi     (the same with
        ALiBi slopes: the decode kernels' ALiBi instantiation)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))  # attention_cases
from attention_cases import reference as reference_of  # noqa: E402
from attention_cases import (Paged, assert_close, direct_decode, direct_paged_decode,  # noqa: E402
                             direct_paged_decode_appending, direct_paged_prefill, direct_prefill, rand,
                             take_new_tokens, variant_arg)


def main() -> None:
    small = "--small" in sys.argv
    torch.manual_seed(0)
    kw = dict(window_left=37, logits_soft_cap=20.0, sinks=torch.randn(16, device="cuda"), scale=0.1) \
        if "--variant" in sys.argv or "--alibi" in sys.argv else {}
    if "--alibi" in sys.argv:
        kw["alibi_slopes"] = torch.rand(16, device="cuda")
    var = variant_arg(**kw)

    def reference(*args, **more):
        return reference_of(*args, **more, **kw)

    dims = (128,) if small else (64, 128, 256)
    n = 0
    for dtype in ((torch.bfloat16,) if small else (torch.bfloat16, torch.float16)):
        for D in dims:
            q = rand((3, 1, 16, D), dtype)
            k, v = rand((3, 131, 4, D), dtype), rand((3, 131, 4, D), dtype)
            m = torch.rand(3, 131, device="cuda") < 0.8
            out, _ = direct_decode(q, k, v, m, var)
            assert_close(out, reference(q, k, v, m), dtype, "decode")
            qp = rand((2, 77, 16, D), dtype, layout="BHLD")
            k2, v2 = rand((2, 100, 4, D), dtype), rand((2, 100, 4, D), dtype)
            m3 = torch.rand(2, 77, 100, device="cuda") < 0.8
            m3[..., 0] = True
            assert_close(direct_prefill(qp, k2, v2, m3, False, var), reference(qp, k2, v2, m3), dtype, "prefill")
            assert_close(direct_prefill(qp, k2, v2, None, True, var), reference(qp, k2, v2, None, True), dtype,
                         "prefill causal")
            for page in (1, 16):
                cache = Paged([70, 1, 150], page, 4, D, dtype)
                out, _ = direct_paged_decode(q, cache, var)
                for b in range(3):
                    kb, vb = cache.gather(b)
                    assert_close(out[b:b + 1], reference(q[b:b + 1], kb[None], vb[None]), dtype, "paged decode")
                # the decode kernel appending each request's last token itself (append_last)
                k_new, v_new, full_k, full_v = take_new_tokens(cache)
                for splits, merge in ((1, False), (4, True)):
                    out, _ = direct_paged_decode_appending(q, cache, k_new, v_new, splits, merge, var)
                    assert torch.equal(cache.k_cache.isnan(), full_k.isnan()), "append_last: k rows"
                    for b in range(3):
                        kb, vb = cache.gather(b)
                        assert_close(out[b:b + 1], reference(q[b:b + 1], kb[None], vb[None]), dtype,
                                     f"paged decode append_last splits={splits}")
                q_lens = [70, 1, 130]
                # pages in order: Hopper's prefill reads a tile over consecutive pages as one box
                for order in ("shuffled", "in_order") if page == 16 else ("shuffled",):
                    cache = Paged([70, 5, 150], page, 4, D, dtype, order=order)
                    qr = rand((sum(q_lens), 16, D), dtype)
                    out = direct_paged_prefill(qr, cache, q_lens, True, var)
                    s = 0
                    for b, nq in enumerate(q_lens):
                        kb, vb = cache.gather(b)
                        ref = reference(qr[s:s + nq][None], kb[None], vb[None], None, True)
                        assert_close(out[s:s + nq][None], ref, dtype, f"paged prefill ({order} pages)")
                        s += nq
            n += 1
    torch.cuda.synchronize()
    mode = ", alibi" if "alibi_slopes" in kw else ", variant" if kw else ""
    print(f"sanitize sweep ok ({n} dtype x head_dim combinations{mode})")


if __name__ == "__main__":
    main()
