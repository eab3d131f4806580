"""Rotary benchmark, side by side in one run: the astrai-elementwise kernels against torch's complex
multiply, transformers' ``apply_rotary_pos_emb`` and Liger's Triton rope (forward and
backward; skipped with a message when ``liger_kernel`` is not importable).

- q+k at prefill sizes (16k tokens x 32/8 heads x 128, bf16, both layouts): forward out of
  place and in place, backward (the inverse rotation), TB/s and ratios;
- decode (B = 64): one ``apply_rotary_emb`` call eager (host time included) against the
  same kernel in a CUDA graph: the host overhead;
- the fused decode step (B = 64, one token each): ``rope_paged_append`` (one launch) against
  rotary q, rotary k and the KV append done separately.

Kernel times are medians (±IQR) of CUDA-graph replays, every candidate of a case replayed in
turn (``astrai.timing.graphs``); the decode eager time is ``astrai.timing.eager`` over 5 rounds.
A line under the tables names each timer and its rounds; the JSON keeps each figure's timing. Bandwidth counts the bytes each call must move: q and k
read and written (the cos/sin rows are read too, a few percent).

    python bench/bench_rotary.py [--json out.json] [--quick]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # rotary_reference
from graph_timing import quick_json_args  # noqa: E402
from rotary_reference import rope_tables  # noqa: E402

from astrai import timing  # noqa: E402
from astrai.extension import apply_rotary_emb  # noqa: E402
from astrai.extension.ops import rope_paged as rope_paged_ops  # noqa: E402
from astrai.extension.ops import rotary as rotary_ops  # noqa: E402

BF16 = torch.bfloat16
BARS = {"fwd_tbs": 3.5, "bwd_tbs": 3.0, "vs_liger": 2.5, "fused_speedup": 2.0, "host_us": 10.0}


def peers():
    """(transformers' apply_rotary_pos_emb or None, liger (forward fn, backward fn) or None), with messages."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001 - any import failure only drops the peer
        print(f"bench_rotary: transformers not importable ({exc}); its column is skipped")
        apply_rotary_pos_emb = None
    try:
        from liger_kernel.ops.rope import rope_backward, rope_forward
        liger = (rope_forward, rope_backward)
    except Exception as exc:  # noqa: BLE001
        print(f"bench_rotary: liger_kernel not importable ({exc}); the Liger peer is skipped "
              f"(pip install liger-kernel==0.8.5)")
        liger = None
    return apply_rotary_pos_emb, liger


def tbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def complex_freqs(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return torch.complex(cos[pos], sin[pos])[None, :, None, :]  # [1, L, 1, D/2]


def torch_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Meta's reference: view pairs as complex numbers, multiply, back to x's dtype."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)


def qk_case(tokens: int, hq: int, hk: int, d: int, interleaved: bool, hf, liger, quick: bool) -> dict:
    q = torch.randn(1, tokens, hq, d, device="cuda", dtype=BF16)
    k = torch.randn(1, tokens, hk, d, device="cuda", dtype=BF16)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = (t.cuda() for t in rope_tables(tokens + 4096, d))
    pos = torch.arange(tokens, device="cuda")
    # what transformers and Liger take: cos/sin [1, L, D] duplicated, in the model's dtype
    hf_cos = torch.cat((cos[pos], cos[pos]), -1)[None].to(BF16)
    hf_sin = torch.cat((sin[pos], sin[pos]), -1)[None].to(BF16)
    freqs = complex_freqs(cos, sin, pos)
    qw, kw = q.clone(), k.clone()  # in-place candidates rotate these, over and over
    fns = {
        "astrai fwd": lambda: rotary_ops.rotary_qk_unchecked(q, k, cos, sin, pos, interleaved, False),
        "astrai fwd in place": lambda: rotary_ops.rotary_qk_inplace_unchecked(qw, kw, cos, sin, pos, interleaved),
        "astrai bwd": lambda: rotary_ops.rotary_qk_unchecked(gq, gk, cos, sin, pos, interleaved, True),
        "torch complex": lambda: (torch_complex(q, freqs), torch_complex(k, freqs)),
    }
    if hf is not None:
        fns["transformers"] = lambda: hf(q, k, hf_cos, hf_sin, unsqueeze_dim=2)
    if liger is not None and not interleaved:  # Liger implements the NeoX layout only
        forward, backward = liger
        fns["liger fwd"] = lambda: forward(qw.transpose(1, 2), kw.transpose(1, 2), hf_cos, hf_sin)
        fns["liger bwd"] = lambda: backward(gq.transpose(1, 2), gk.transpose(1, 2), hf_cos, hf_sin)
    timings = timing.graphs(fns, calls=5 if quick else 10, rounds=5 if quick else 15)
    ms = {name: t.ms for name, t in timings.items()}
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    row = {"case": f"q+k {tokens} tok x {hq}/{hk} x {d} {'gptj' if interleaved else 'neox'}", "bytes": nbytes,
           "us": {name: t * 1e3 for name, t in ms.items()}, "tbs": {name: tbs(nbytes, t) for name, t in ms.items()},
           "timings": timings}
    if "liger fwd" in ms:
        row["vs_liger_fwd"] = ms["liger fwd"] / ms["astrai fwd in place"]
        row["vs_liger_bwd"] = ms["liger bwd"] / ms["astrai bwd"]
    row["vs_torch_complex"] = ms["torch complex"] / ms["astrai fwd"]
    if "transformers" in ms:
        row["vs_transformers"] = ms["transformers"] / ms["astrai fwd"]
    return row


def decode_host_case(quick: bool) -> dict:
    """apply_rotary_emb at decode size: eager per call (Python included) vs the kernel in a graph."""
    x = torch.randn(64, 1, 32, 128, device="cuda", dtype=BF16)
    freqs = tuple(t.cuda() for t in rope_tables(8192, 128))
    with torch.inference_mode():
        graph = timing.graph(lambda: apply_rotary_emb(x, freqs), calls=20, rounds=15)
        eager = timing.eager(lambda: apply_rotary_emb(x, freqs), 40 if quick else 400, rounds=5, warmup=10)
    return {"case": "apply_rotary_emb decode 64x1x32x128", **timing.figures(eager_us=eager, graph_us=graph),
            "host_us": eager.median_us - graph.median_us}


def fused_decode_case(interleaved: bool, quick: bool) -> dict:
    """B = 64 requests, one token each: fused rope + KV write vs rotary q, rotary k, append."""
    b, hq, hk, d, pages, page_size = 64, 32, 8, 128, 4096, 16
    q = torch.randn(b, hq, d, device="cuda", dtype=BF16)
    k, v = torch.randn(b, hk, d, device="cuda", dtype=BF16), torch.randn(b, hk, d, device="cuda", dtype=BF16)
    k_cache = torch.zeros(pages, page_size, hk, d, device="cuda", dtype=BF16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(pages * page_size, device="cuda")[:b]
    pos = torch.randint(0, 8000, (b,), device="cuda")
    cos, sin = (t.cuda() for t in rope_tables(8192, d))
    k_rows, v_rows = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)

    def separate():
        q_rot = rotary_ops.rotary_emb_unchecked(q[None], cos, sin, pos, interleaved, False)
        k_rot = rotary_ops.rotary_emb_unchecked(k[None], cos, sin, pos, interleaved, False)
        k_rows.index_copy_(0, slots, k_rot[0])
        v_rows.index_copy_(0, slots, v)
        return q_rot

    def separate_qk():  # the best unfused form: q and k in one launch, then the append
        q_rot, k_rot = rotary_ops.rotary_qk_unchecked(q[None], k[None], cos, sin, pos, interleaved, False)
        k_rows.index_copy_(0, slots, k_rot[0])
        v_rows.index_copy_(0, slots, v)
        return q_rot

    fns = {
        "fused": lambda: rope_paged_ops.rope_paged_append_unchecked(q, k, v, k_cache, v_cache, cos, sin, pos, slots,
                                                                    interleaved),
        "separate": separate,
        "separate (q+k launch)": separate_qk,
    }
    timings = timing.graphs(fns, calls=20, rounds=5 if quick else 15)
    ms = {name: t.ms for name, t in timings.items()}
    return {"case": f"decode B={b} rope + KV write {'gptj' if interleaved else 'neox'}",
            "us": {name: t * 1e3 for name, t in ms.items()}, "speedup": ms["separate"] / ms["fused"],
            "speedup_vs_qk_launch": ms["separate (q+k launch)"] / ms["fused"], "timings": timings}


def main() -> int:
    args = quick_json_args(__doc__, "bench_rotary")
    if args is None:
        return 1
    torch.manual_seed(0)
    hf, liger = peers()
    rows = [qk_case(16384, 32, 8, 128, interleaved, hf, liger, args.quick) for interleaved in (False, True)]
    rows.append(qk_case(4096, 32, 8, 128, False, hf, liger, args.quick))
    host = decode_host_case(args.quick)
    fused = [fused_decode_case(interleaved, args.quick) for interleaved in (False, True)]

    print(f"\nrotary on {torch.cuda.get_device_name()} (torch {torch.__version__}); kernel times: CUDA-graph replays")
    names = ["astrai fwd", "astrai fwd in place", "astrai bwd", "torch complex", "transformers", "liger fwd", "liger bwd"]
    for r in rows:
        print(f"\n{r['case']}  ({r['bytes'] / 1e6:.0f} MB moved per call)")
        for name in names:
            if name in r["us"]:
                print(f"  {name:<22} {r['timings'][name]:>14} us  {r['tbs'][name]:>5.2f} TB/s")
        ratios = {k: v for k, v in r.items() if k.startswith("vs_")}
        print("  " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"\n{host['case']}: eager {host['timings']['eager_us']} per call, kernel in a graph "
          f"{host['timings']['graph_us']}, host overhead {host['host_us']:.1f} us")
    for f in fused:
        times = ", ".join(f"{name} {t:>1} us" for name, t in f["timings"].items())
        print(f"{f['case']}: {times}; fused {f['speedup']:.2f}x faster than separate "
              f"({f['speedup_vs_qk_launch']:.2f}x than the q+k launch + append)")
    print(timing.legend(t for r in rows + fused for t in r["timings"].values()))

    anchor = rows[0]  # NeoX, 16k tokens
    verdicts = {
        "q+k forward >= 3.5 TB/s": max(anchor["tbs"]["astrai fwd"], anchor["tbs"]["astrai fwd in place"]) >= BARS["fwd_tbs"],
        "backward >= 3.0 TB/s": anchor["tbs"]["astrai bwd"] >= BARS["bwd_tbs"],
        "fused decode >= 2x separate": min(f["speedup"] for f in fused) >= BARS["fused_speedup"],
        "host overhead <= 10 us": host["host_us"] <= BARS["host_us"],
    }
    if "vs_liger_fwd" in anchor:
        verdicts[">= 2.5x Liger (fwd and bwd)"] = min(anchor["vs_liger_fwd"], anchor["vs_liger_bwd"]) >= BARS["vs_liger"]
    print()
    for bar, met in verdicts.items():
        print(f"  {bar}: {'MET' if met else 'NOT MET'}")
    if args.json:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "host": host,
                  "fused": fused, "bars": BARS, "verdicts": verdicts, "liger": liger is not None}
        Path(args.json).write_text(json.dumps(report, indent=2, default=timing.jsonable) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
