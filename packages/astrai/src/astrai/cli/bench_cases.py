"""``astrai bench``'s benchmarks: each a :class:`Case` (the call through the resolver, the
torch path beside it, the bytes and flops it must move), built for a device by :func:`cases`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..extension import ATTN_BACKEND, apply_rotary_emb, attention, attn_backend, fp8_autocast
from ..extension.backend import fp8 as fp8_policy
from ..extension.backend.rotary import rotary_torch
from ..extension.kv_cache import PagedKVCache
from ..extension.op_names import ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL, FP8_GEMM, ROTARY_EMB

@dataclass
class Case:
    name: str
    shape: str
    run: Callable[[], object]  # through the resolver
    run_torch: Callable[[], object]  # the torch path
    bytes: float = 0.0  # fewest bytes the op must move
    flops: float = 0.0
    op: str = ""  # resolver op name, to find the chosen backend
    plugin_op: str = field(init=False, default="")  # the op doctor lists (BENCHMARKS), to name its backend

    def __post_init__(self) -> None:
        self.plugin_op = BENCHMARKS[self.name]


# every benchmark by name, and the op doctor lists that it times
BENCHMARKS = {
    "paged decode": ATTN_PAGED_DECODE,
    "prefill causal": ATTN_PAGED_PREFILL,
    "rotary": ROTARY_EMB,
    "fp8 gemm vs bf16": FP8_GEMM,
    "fp8 linear forward": FP8_GEMM,
}


def _decode_case(device, dtype, batch, kv_len, page_size=16, hq=32, hkv=8, d=128) -> Case:
    pages_per_seq = -(-(kv_len + 1) // page_size)
    cache = PagedKVCache(num_layers=1, num_pages=batch * pages_per_seq, page_size=page_size,
                         kv_heads=hkv, head_dim=d, dtype=dtype, device=device)
    seqs = list(range(batch))
    for s in seqs:
        cache.add_sequence(s)
    cache.plan(seqs, q_lens=[kv_len] * batch)
    cache.append(0, torch.randn(batch * kv_len, hkv, d, device=device, dtype=dtype),
                 torch.randn(batch * kv_len, hkv, d, device=device, dtype=dtype))
    cache.plan(seqs, q_lens=[1] * batch)
    q = torch.randn(batch, 1, hq, d, device=device, dtype=dtype)
    k = torch.randn(batch, 1, hkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)

    def run():
        return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="decode")

    def run_torch():
        with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
            return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="decode")

    kv_bytes = 2 * batch * (kv_len + 1) * hkv * d * dtype.itemsize
    return Case("paged decode", f"B={batch} kv={kv_len} {hq}/{hkv}x{d} page={page_size}", run, run_torch,
                bytes=kv_bytes, op="attention")


def _prefill_case(device, dtype, batch, seq, page_size=16, hq=32, hkv=8, d=128) -> Case:
    """Ragged causal prefill of fresh sequences over the paged cache (the serving path)."""
    cache = PagedKVCache(num_layers=1, num_pages=batch * -(-seq // page_size), page_size=page_size,
                         kv_heads=hkv, head_dim=d, dtype=dtype, device=device)
    seqs = list(range(batch))
    for s in seqs:
        cache.add_sequence(s)
    cache.plan(seqs, q_lens=[seq] * batch)
    q = torch.randn(batch, seq, hq, d, device=device, dtype=dtype)
    k = torch.randn(batch, seq, hkv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)

    def run():
        return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="prefill")

    def run_torch():
        with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
            return attention(q, k, v, kv_cache=cache, layer_id=0, fwd="prefill")

    flops = 4 * batch * hq * seq * seq * d / 2  # causal: half of QK^T and PV
    return Case("prefill causal", f"B={batch} L={seq} {hq}/{hkv}x{d} page={page_size}", run, run_torch,
                flops=flops, op="attention")


def _rotary_case(device, dtype, tokens, heads=32, d=128, batch=1) -> Case:
    x = torch.randn(batch, tokens, heads, d, device=device, dtype=dtype)
    angles = torch.randn(tokens, d // 2, device=device)
    cos, sin = angles.cos(), angles.sin()

    def run():
        with torch.inference_mode():
            return apply_rotary_emb(x, (cos, sin))

    def run_torch():
        with torch.inference_mode():
            return rotary_torch(x, cos, sin)

    nbytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * 4
    shape = f"{tokens} tok x {heads} x {d}" if batch == 1 else f"{batch} x {tokens} tok x {heads} x {d}"
    return Case("rotary", shape, run, run_torch, bytes=nbytes, op=ROTARY_EMB)


def _fp8_case(device, m, n, k) -> Case:
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    scale = torch.tensor(0.5, device=device)
    dense_a, dense_b = a.to(torch.bfloat16), b.to(torch.bfloat16)

    def run():
        return fp8_policy.gemm(a, b, scale)

    def run_torch():  # the bf16 GEMM the FP8 path replaces
        return (dense_a @ dense_b) * scale

    return Case("fp8 gemm vs bf16", f"{m}x{n}x{k}", run, run_torch, flops=2 * m * n * k,
                op=FP8_GEMM)


def _fp8_linear_case(device, m, n=8192, k=8192) -> Case:
    """The FP8 linear's inference forward (``fp8_autocast`` around ``nn.Linear``), against
    the bf16 linear it replaces."""
    lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

    def run():
        with torch.no_grad(), fp8_autocast():
            return lin(x)

    def run_torch():
        with torch.no_grad():
            return lin(x)

    return Case("fp8 linear forward", f"M={m} N={n} K={k}", run, run_torch, flops=2 * m * n * k,
                op=FP8_GEMM)


def cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        dtype = torch.bfloat16
        out = [*(_decode_case(device, dtype, b, 4096) for b in (1, 8, 64)),
               _prefill_case(device, dtype, 1, 4096),
               _rotary_case(device, dtype, 1, batch=64), _rotary_case(device, dtype, 16384)]
        if torch.cuda.get_device_capability(device) >= (8, 9):
            out += [_fp8_case(device, 4096, 4096, 4096), _fp8_linear_case(device, 16), _fp8_linear_case(device, 1024)]
        if quick:
            out = [_decode_case(device, dtype, 4, 1024), _prefill_case(device, dtype, 1, 1024),
                   _rotary_case(device, dtype, 2048)]
        return out
    size = 1 if quick else 2
    dtype = torch.float32
    return [_decode_case(device, dtype, 2 * size, 256 * size), _prefill_case(device, dtype, 1, 128 * size),
            _rotary_case(device, torch.bfloat16, 512 * size), _fp8_case(device, 128 * size, 128 * size, 128 * size)]
