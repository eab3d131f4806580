"""Every plugin kernel once or twice on small shapes with tails, results checked: the
program compute-sanitizer runs.

    export PYTORCH_NO_CUDA_MEMORY_CACHING=1   # one cudaMalloc per tensor: out-of-bounds is visible
    for tool in memcheck racecheck initcheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize/sanitize.py
    done
    # the CUDA graph part, with the caching allocator (a capture needs it)
    env -u PYTORCH_NO_CUDA_MEMORY_CACHING compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 bench/sanitize/sanitize.py graph_replay

The norms' part runs the 16-bit kernels and their per-token e4m3 forms over rows in registers,
in two passes and on the scalar path. Shapes are chosen to hit partial tiles (lengths not multiples of 64, 16 or the page
size), GQA, masks, causal bottom-right alignment, paged prefill + decode (also over the pages
gathered in order first), a CUDA graph replayed over a static decode step that splits the keys, FP8
tails and both transposes. Exits non-zero on a wrong result; prints one line per kernel.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))  # the references
from fp8_reference import encode, gemm_reference  # noqa: E402
from reference import attention_ref, rotary_ref, rotary_tables, tolerance  # noqa: E402

from astrai.extension import ATTN_BACKEND, PagedKVCache, attention, attn_backend  # noqa: E402
from astrai.extension.backend.attention import ordered_pages  # noqa: E402
from astrai.extension.ops import attention as attn_ops  # noqa: E402
from astrai.extension.backend.fp8_weights import quantize_per_token, quantize_weight  # noqa: E402
from astrai.extension.backend.norm_torch import rms_norm_torch, silu_and_mul_torch  # noqa: E402
from astrai.extension.ops import fp8 as fp8_ops  # noqa: E402
from astrai.extension.ops import fp8_weights as fp8_weights_ops  # noqa: E402
from astrai.extension.ops import norm as norm_ops  # noqa: E402
from astrai.extension.ops import norm_fp8 as norm_fp8_ops  # noqa: E402
from astrai.extension.ops import rope_paged as rope_paged_ops  # noqa: E402
from astrai.extension.ops import rotary as rotary_ops  # noqa: E402

DEV = "cuda"


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV).to(dtype)


def close(name, got, ref, dtype):
    torch.testing.assert_close(got.double().cpu(), ref, **tolerance(dtype))
    print(f"ok {name}", flush=True)


def rotary() -> None:
    cos, sin = (t.to(DEV) for t in rotary_tables(37, 128, offset=1000))
    x = rand(2, 37, 4, 128)
    close("rotary_emb contiguous", rotary_ops.rotary_emb(x, cos, sin), rotary_ref(x, cos, sin), torch.bfloat16)
    xp = rand(2, 4, 37, 128).transpose(1, 2)
    close("rotary_emb permuted", rotary_ops.rotary_emb(xp, cos, sin), rotary_ref(xp, cos, sin), torch.bfloat16)
    # the fused rope + append into 16-bit and FP8 pages (one row per token, tails of 7 and 9)
    q, k, v = rand(37, 8, 128), rand(37, 4, 128), rand(37, 4, 128)
    slots = torch.randperm(4 * 16, device=DEV)[:37]
    positions = torch.arange(37, device=DEV)
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        pages = [torch.zeros(4, 16, 4, 128, device=DEV).to(kv_dtype) for _ in range(2)]
        scales = (torch.full((4,), 0.02, device=DEV),) * 2 if kv_dtype != torch.bfloat16 else ()
        out = rope_paged_ops.rope_paged_append_unchecked(q, k, v, *pages, cos, sin, positions, slots, True, *scales)
        close(f"rope_paged_append {kv_dtype}", out, rotary_ref(q[None], cos, sin)[0], torch.bfloat16)


def dense_attention() -> None:
    # every head dim of the Hopper prefill (GQA 8/2 packs 4 heads per block)
    for dtype, d in ((torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)):
        k, v = rand(2, 133, 2, d, dtype=dtype), rand(2, 133, 2, d, dtype=dtype)
        mask = torch.rand(2, 133, device=DEV) < 0.8
        q = rand(2, 1, 8, d, dtype=dtype)
        close(f"attn_decode {dtype} d{d}", attn_ops.attn_decode(q, k, v, mask), attention_ref(q, k, v, mask), dtype)
        q = rand(2, 70, 8, d, dtype=dtype)
        close(f"attn_prefill causal {dtype} d{d}", attn_ops.attn_prefill(q, k, v, None, is_causal=True),
              attention_ref(q, k, v, None, True), dtype)
        mask3 = torch.rand(2, 70, 133, device=DEV) < 0.7
        close(f"attn_prefill mask3 {dtype} d{d}", attn_ops.attn_prefill(q, k, v, mask3),
              attention_ref(q, k, v, mask3), dtype)
        # multi-head: the Hopper prefill's one-head blocks of 128 rows
        q, k, v = rand(2, 200, 4, d, dtype=dtype), rand(2, 200, 4, d, dtype=dtype), rand(2, 200, 4, d, dtype=dtype)
        close(f"attn_prefill multi-head causal {dtype} d{d}", attn_ops.attn_prefill(q, k, v, None, is_causal=True),
              attention_ref(q, k, v, None, True), dtype)


def paged_attention() -> None:
    for kv_dtype in (None, torch.float8_e4m3fn):
        paged_steps(kv_dtype)
    # the prefill over the step's pages gathered in order first (ordered_pages: the gather kernel)
    saved = ordered_pages.FP8_MIN_ROWS, ordered_pages.SCATTERED_MIN_ROWS, ordered_pages.SCATTERED_MIN_BREAKS
    ordered_pages.FP8_MIN_ROWS, ordered_pages.SCATTERED_MIN_ROWS, ordered_pages.SCATTERED_MIN_BREAKS = 1, 1, 0.0
    try:
        for kv_dtype in (None, torch.float8_e4m3fn):
            paged_steps(kv_dtype, "gathered ")
    finally:
        ordered_pages.FP8_MIN_ROWS, ordered_pages.SCATTERED_MIN_ROWS, ordered_pages.SCATTERED_MIN_BREAKS = saved


def paged_steps(kv_dtype, route: str = "") -> None:
    """Three steps (chunked prefill, then two decode steps) through attention() over one cache;
    FP8 pages are checked against the 16-bit reference with FP8's error (scales calibrated on the
    first append)."""
    dtype, hkv, hq, d = torch.bfloat16, 2, 8, 128
    cache = PagedKVCache(1, 32, 16, hkv, d, dtype=dtype, device=DEV, kv_dtype=kv_dtype)
    cache.k_pages.zero_()
    cache.v_pages.zero_()
    seqs = [0, 1, 2]
    for s in seqs:
        cache.add_sequence(s)
    history = {s: ([], []) for s in seqs}
    # FP8: e4m3 keeps 3 mantissa bits; unit-normal inputs move an output by up to ~0.15
    tol = tolerance(dtype) if kv_dtype is None else dict(rtol=0.1, atol=0.25)
    with torch.no_grad(), attn_backend(ATTN_BACKEND.CUDA):
        for q_lens in ([70, 5, 17], [1, 1, 1], [1, 1, 1]):
            cache.plan(seqs, q_lens)
            total = sum(q_lens)
            q, k, v = rand(1, total, hq, d), rand(1, total, hkv, d), rand(1, total, hkv, d)
            out = attention(q, k, v, kv_cache=cache, layer_id=0)
            start = 0
            for s, n in zip(seqs, q_lens):
                history[s][0].append(k[0, start:start + n])
                history[s][1].append(v[0, start:start + n])
                ks, vs = (torch.cat(p)[None] for p in history[s])
                torch.testing.assert_close(out[:, start:start + n].double().cpu(),
                                           attention_ref(q[:, start:start + n], ks, vs, is_causal=True), **tol)
                start += n
            print(f"ok {route}paged attention {kv_dtype or dtype} q_lens={q_lens}", flush=True)


def graph_replay() -> None:
    """A CUDA graph over a static decode step whose launch splits the keys, replayed after the
    capture's plan and requests are gone (one cudaMalloc per tensor here: a replay into freed
    workspaces is an invalid write), against eager attention over the same cache. A capture
    needs the caching allocator: with PYTORCH_NO_CUDA_MEMORY_CACHING set this part is skipped
    (ci/gpu-run runs it again without, ``sanitize.py graph_replay``)."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING"):
        print("skipped graph replay: a CUDA graph capture needs the caching allocator", flush=True)
        return
    dtype, hkv, hq, d, page, size, max_pages = torch.bfloat16, 2, 8, 128, 16, 4, 12
    cache = PagedKVCache(1, 64, page, hkv, d, dtype=dtype, device=DEV)
    cache.k_pages.copy_(rand(*cache.k_pages.shape))
    cache.v_pages.copy_(rand(*cache.v_pages.shape))
    cache.add_sequence("pad")
    cache.plan(["pad"], [1])
    static = cache.static_decode_plan(size, max_pages, "pad")
    ids = [("capture", b) for b in range(size)]
    for s in ids:
        cache.add_sequence(s)
        cache.plan([s], [max_pages * page - 2])
    q, k, v = rand(1, size, hq, d), rand(1, size, hkv, d), rand(1, size, hkv, d)
    with torch.no_grad(), attn_backend(ATTN_BACKEND.CUDA):
        plan = cache.plan(ids, [1] * size, into=static)
        cache.prepare(plan)
        attention(q, k, v, kv_cache=cache, layer_id=0)  # lazy set-up outside the capture; appends the step
        splits = plan.launches[("cuda", "decode", hq)].num_splits  # built by that first call
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attention(q, k, v, kv_cache=cache, layer_id=0)  # the same rows again on each replay
        keys, values = cache.gather_flat(0, plan)
        ends = np.cumsum((0, *plan.kv_lens_host))
        for s in ids:
            cache.release(s)
        del plan
        cache.plan(["pad"], [1])  # nothing keeps the capture's plan now
        filler = [rand(1 << 14) for _ in range(64)]  # whatever the allocator hands out next
        graph.replay()
        torch.cuda.synchronize()
        for b in range(size):
            ks, vs = keys[ends[b]:ends[b + 1]][None], values[ends[b]:ends[b + 1]][None]
            torch.testing.assert_close(out[:, b:b + 1].double().cpu(), attention_ref(q[:, b:b + 1], ks, vs),
                                       **tolerance(dtype))
        del filler
    print(f"ok graph replay over a static decode step, {splits} splits", flush=True)


def fp8() -> None:
    x = rand(70, 136) * 30
    x[3, 5] = math.inf
    mult = torch.tensor(2.0, device=DEV)
    for fmt in ("e4m3", "e5m2"):
        q, q_t, amax = fp8_ops.fp8_quantize(x, mult, fmt, 2)
        expected = encode((x.float().cpu().numpy() * np.float32(2.0)).astype(np.float64), fmt)
        for got in (q, q_t.t()):
            np.testing.assert_array_equal(got.contiguous().view(torch.uint8).cpu().numpy(), expected)
        assert amax.item() == math.inf
        print(f"ok fp8_quantize {fmt}", flush=True)
    a = (rand(70, 128, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
    w = (rand(72, 128, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
    bias = rand(72)
    scale = torch.tensor(0.25, device=DEV)
    for b in (w.t(), w.t().contiguous()):
        out = fp8_ops.mm_fp8(a, b, scale, bias)
        ref = gemm_reference(a.cpu(), b.cpu(), 0.25, bias.cpu())
        torch.testing.assert_close(out.double().cpu(), ref.to(torch.bfloat16).double(), rtol=2**-7,
                                   atol=2**-7 * float(ref.abs().max()))
        print(f"ok fp8_gemm b {'col' if b.stride(0) == 1 else 'row'}-major", flush=True)
    # decode-sized M: the sm90 planner's swap-AB configs (the weight on the 128-row side)
    for m in (5, 40):
        a = (rand(m, 256, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
        w = (rand(200, 256, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
        out = fp8_ops.mm_fp8(a, w.t(), scale, bias=None)
        ref = gemm_reference(a.cpu(), w.t().cpu(), 0.25, None)
        torch.testing.assert_close(out.double().cpu(), ref.to(torch.bfloat16).double(), rtol=2**-7,
                                   atol=2**-7 * float(ref.abs().max()))
        print(f"ok fp8_gemm M={m} (small-M configs)", flush=True)
    rowwise()


def rowwise() -> None:
    """The row-wise GEMM (W8A8's): K split 3 ways (5 k-blocks), 4 ways, and whole (70 tiles)."""
    for m, n, k in ((5, 200, 640), (33, 300, 512), (64, 70 * 128, 256)):
        xq, x_scale = quantize_per_token(rand(m, k))
        w, w_scale = quantize_weight(rand(n, k, dtype=torch.float32))
        out = fp8_weights_ops.fp8_rowwise_gemm_unchecked(xq, x_scale, w, w_scale)
        ref = (xq.double() * x_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()
        torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=2**-7,
                                   atol=2**-7 * float(ref.abs().max()))
        print(f"ok fp8_rowwise_gemm {m}x{n}x{k}", flush=True)


def same_fp8(name, got, want):
    """Per-token e4m3 rows and scales, byte for byte."""
    (q, scale), (want_q, want_scale) = got, want
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), name
    print(f"ok {name}", flush=True)


def norms() -> None:
    # rows in registers (4096: one access a thread; 8192: two), in two passes (65536), the scalar path (4095)
    for hidden in (4096, 8192, 65536, 4095):
        x, w, residual = rand(3, hidden), rand(hidden), rand(3, hidden)
        close(f"rms_norm {hidden}", norm_ops.rms_norm_unchecked(x, w, 1e-5), rms_norm_torch(x, w, 1e-5).double().cpu(),
              torch.bfloat16)
        xi, ri = x.clone(), residual.clone()
        norm_ops.fused_add_rms_norm_unchecked(xi, ri, w, 1e-5)
        close(f"fused_add_rms_norm {hidden}", xi, rms_norm_torch(residual + x, w, 1e-5).double().cpu(), torch.bfloat16)
        same_fp8(f"rms_norm_fp8 {hidden}", norm_fp8_ops.rms_norm_fp8_unchecked(x, w, 1e-5),
                 quantize_per_token(norm_ops.rms_norm_unchecked(x, w, 1e-5)))
        ri = residual.clone()
        same_fp8(f"fused_add_rms_norm_fp8 {hidden}", norm_fp8_ops.fused_add_rms_norm_fp8_unchecked(x, ri, w, 1e-5),
                 quantize_per_token(norm_ops.rms_norm_unchecked(residual + x, w, 1e-5)))
        gate_up = rand(3, 2 * hidden)
        close(f"silu_and_mul {hidden}", norm_ops.silu_and_mul_unchecked(gate_up),
              silu_and_mul_torch(gate_up).double().cpu(), torch.bfloat16)
        same_fp8(f"silu_and_mul_fp8 {hidden}", norm_fp8_ops.silu_and_mul_fp8_unchecked(gate_up),
                 quantize_per_token(norm_ops.silu_and_mul_unchecked(gate_up)))
        if hidden % 8 == 0:
            same_fp8(f"quantize_rows {hidden}", fp8_weights_ops.fp8_quantize_rows_unchecked(x), quantize_per_token(x))


def main() -> int:
    torch.manual_seed(0)
    failed = []
    parts = (rotary, norms, dense_attention, paged_attention, graph_replay, fp8)
    chosen = sys.argv[1:]  # part names; none: every part
    unknown = set(chosen) - {p.__name__ for p in parts}
    if unknown:
        print(f"unknown parts {sorted(unknown)}: choose from {[p.__name__ for p in parts]}", flush=True)
        return 2
    for part in (p for p in parts if not chosen or p.__name__ in chosen):
        try:
            part()
        except Exception as exc:  # report every part, fail at the end
            failed.append(part.__name__)
            print(f"FAILED {part.__name__}: {type(exc).__name__}: {exc}", flush=True)
    torch.cuda.synchronize()
    print("sanitize sweep:", "FAILED " + ", ".join(failed) if failed else "all ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
