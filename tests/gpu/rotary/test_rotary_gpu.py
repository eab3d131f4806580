"""The astrai-elementwise kernels on the GPU against float64 references.

The compiled module is called directly with NaN-poisoned outputs framed by guard regions
(an unwritten or out-of-bounds element fails): both layouts (NeoX against transformers' own
``apply_rotary_pos_emb``, interleaved against the complex multiply), positions 1-D/2-D,
partial rotary, the three dtypes, the vector and scalar paths, q+k in one launch and in
place, the inverse rotation, the fused rope + paged KV write. On top: the public API's
dispatch (the kernel, also for training, with its backward), CUDA-graph capture and
``torch.compile(fullgraph=True)`` of every new entry point, and ``attention(rope=...)``.
Fresh seeded random inputs and real RoPE tables (positions up to 16k+) in every case.
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch
from reference import rotary_ref, rotary_tables
from rotary_reference import rope_reference, rope_tables

from astrai.extension import PagedKVCache, apply_rotary_emb, apply_rotary_emb_qk, attention, explain

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [F32, F16, BF16]
CODES = {F32: 0, F16: 1, BF16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.int32: 5, torch.int64: 6}
EPS = {F32: 2.0**-20, F16: 2.0**-10, BF16: 2.0**-7}  # above one rounding of the result
MATH = 2.0**-21  # float32 arithmetic (two products and a sum), relative to max|x|
MAX_POS = 20000


def module():
    return importlib.import_module("astrai_elementwise._rotary_emb")


def abi(t: torch.Tensor | None):
    return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), CODES[t.dtype])


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tables(rotary_dim: int):
    return tuple(t.to(DEV) for t in rope_tables(MAX_POS, rotary_dim))


def positions_of(kind: str, b: int, l: int, g: torch.Generator):
    if kind == "none":
        return None
    if kind == "1d":
        return torch.randint(0, MAX_POS, (l,), generator=g).to(DEV)
    return torch.randint(0, MAX_POS, (b, l), generator=g, dtype=torch.int32).to(DEV)


def check_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    """Element-wise within one rounding of the exact result: |got - ref| <= eps |ref| + MATH max|x|."""
    got64 = got.detach().double().cpu()
    assert not torch.isnan(got64).any(), "unwritten (NaN-poisoned) elements in the output"
    eps = EPS[got.dtype]
    bound = want.abs() * eps + x.detach().double().abs().max().item() * MATH
    excess = (got64 - want).abs() - bound
    worst = excess.flatten().argmax().item()
    assert excess.max().item() <= 0, f"error {(got64 - want).abs().flatten()[worst].item():.3g} at {worst} beyond rounding"


def framed(shape, dtype, guard=2):
    """A NaN-filled [B, L, H + 2 guard, D] buffer and the [B, L, H, D] view between its guards."""
    b, l, h, d = shape
    frame = torch.full((b, l, h + 2 * guard, d), float("nan"), device=DEV, dtype=dtype)
    return frame, frame[:, :, guard:guard + h]


def guards_untouched(frame, h, guard=2):
    outside = torch.cat((frame[:, :, :guard], frame[:, :, guard + h:]), dim=2)
    return bool(torch.isnan(outside.float()).all())


def make_x(shape, dtype, layout, g):
    b, l, h, d = shape
    if layout == "bhld":  # a permuted view
        return (torch.randn(b, h, l, d, generator=g) * 3).to(dtype).to(DEV).permute(0, 2, 1, 3)
    if layout == "offset":  # one element off 16-byte alignment: the scalar path
        return (torch.randn(b, l, h, d + 8, generator=g) * 3).to(dtype).to(DEV)[..., 1:1 + d]
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)


# -- the compiled module, one tensor ----------------------------------------------------

SHAPES = [  # (B, L, H, D, rotary_dim)
    (1, 1, 32, 128, 128),
    (8, 1, 8, 64, 64),
    (3, 2, 5, 256, 256),
    (2, 17, 3, 64, 32),   # partial rotary
    (1, 33, 7, 80, 32),   # Phi-2 style: 80 channels, 32 rotated
    (2, 9, 3, 36, 36),    # head_dim % 8 != 0: the scalar path
    (1, 16384, 32, 128, 128),
    (2, 4096, 8, 256, 64),
]


@pytest.mark.parametrize("layout", ["blhd", "bhld", "offset"])
@pytest.mark.parametrize("positions", ["none", "1d", "2d"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference_with_poisoned_output(shape, dtype, interleaved, positions, layout):
    *bhld, rotary_dim = shape
    if bhld[1] >= 4096 and (layout != "blhd" or positions != "1d" or dtype != BF16):
        pytest.skip("large shapes: bf16, positions [L], both layouts (the float64 reference is slow)")
    g = gen(zlib.crc32(repr((shape, dtype, interleaved, positions, layout)).encode()))
    x = make_x(bhld, dtype, layout, g)
    cos, sin = tables(rotary_dim)
    pos = positions_of(positions, bhld[0], bhld[1], g)
    frame, out = framed(bhld, dtype)
    module().rotary(abi(x), None, abi(cos), abi(sin), abi(pos), abi(out), None, interleaved, False, stream())
    torch.cuda.synchronize()
    want = rope_reference(x, cos, sin, pos, interleaved)
    check_close(out, want, x)
    assert guards_untouched(frame, bhld[2]), "the kernel wrote outside out"


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inverse_undoes_the_rotation(dtype, interleaved):
    g = gen(5)
    x = make_x((2, 300, 4, 128), dtype, "blhd", g)
    cos, sin = tables(96)
    pos = positions_of("2d", 2, 300, g)
    back = torch.full_like(x, float("nan"))
    module().rotary(abi(x), None, abi(cos), abi(sin), abi(pos), abi(back), None, interleaved, True, stream())
    torch.cuda.synchronize()
    check_close(back, rope_reference(x, cos, -sin, pos, interleaved), x)  # the rotation by -angle


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_and_k_in_one_launch(dtype, interleaved, in_place):
    g = gen(7)
    q = make_x((4, 129, 32, 128), dtype, "blhd", g)
    k = make_x((4, 129, 8, 128), dtype, "bhld", g)
    cos, sin = tables(128)
    pos = positions_of("2d", 4, 129, g)
    want_q, want_k = rope_reference(q, cos, sin, pos, interleaved), rope_reference(k, cos, sin, pos, interleaved)
    originals = q.clone(), k.clone()
    if in_place:
        module().rotary(abi(q), abi(k), abi(cos), abi(sin), abi(pos), abi(q), abi(k), interleaved, False, stream())
        q_out, k_out = q, k
    else:
        (q_frame, q_out), (k_frame, k_out) = framed(q.shape, dtype), framed(k.shape, dtype)
        module().rotary(abi(q), abi(k), abi(cos), abi(sin), abi(pos), abi(q_out), abi(k_out), interleaved, False,
                        stream())
    torch.cuda.synchronize()
    check_close(q_out, want_q, originals[0])
    check_close(k_out, want_k, originals[1])
    if not in_place:
        assert guards_untouched(q_frame, 32) and guards_untouched(k_frame, 8)
        assert torch.equal(q, originals[0]) and torch.equal(k, originals[1])


def test_a_position_outside_the_table_gives_nan_not_a_wild_read():
    x = make_x((1, 4, 2, 64), BF16, "blhd", gen(8))
    cos, sin = (t[:100] for t in tables(64))
    pos = torch.tensor([0, 99, 100, -1], device=DEV)
    out = torch.empty_like(x)
    module().rotary(abi(x), None, abi(cos), abi(sin), abi(pos), abi(out), None, False, False, stream())
    torch.cuda.synchronize()
    assert torch.isfinite(out[:, :2].float()).all() and torch.isnan(out[:, 2:].float()).all()


def test_the_original_entry_point_keeps_its_meaning():
    x = make_x((2, 77, 8, 128), BF16, "bhld", gen(9))
    cos, sin = (t.to(DEV) for t in rotary_tables(77, 128, offset=3000))
    frame, out = framed(x.shape, BF16)
    module().rotary_emb(abi(x), abi(cos), abi(sin), abi(out), stream())
    torch.cuda.synchronize()
    check_close(out, rotary_ref(x, cos, sin), x)
    assert guards_untouched(frame, 8)


# -- the fused rope + paged KV write ------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, rotary_dim", [(64, 128), (1, 128), (300, 64)])
def test_rope_paged_append_writes_exactly_its_slots(tokens, rotary_dim, dtype, interleaved):
    g = gen(tokens + rotary_dim)
    pages, page_size, hq, hk, d = 64, 16, 32, 8, 128
    q = make_x((1, tokens, hq, d), dtype, "blhd", g)[0]
    k, v = (make_x((1, tokens, hk, d), dtype, "blhd", g)[0] for _ in range(2))
    k_cache = torch.full((pages, page_size, hk, d), float("nan"), device=DEV, dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(pages * page_size, generator=g)[:tokens].to(DEV)
    pos = torch.randint(0, MAX_POS, (tokens,), generator=g).to(DEV)
    cos, sin = tables(rotary_dim)
    q_out = torch.full_like(q, float("nan"))
    module().rope_paged_append(abi(q), abi(k), abi(v), abi(k_cache), abi(v_cache), abi(cos), abi(sin), abi(pos),
                               abi(slots), abi(q_out), interleaved, stream())
    torch.cuda.synchronize()
    check_close(q_out, rope_reference(q[None], cos, sin, pos, interleaved)[0], q)
    k_rows, v_rows = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)
    check_close(k_rows[slots], rope_reference(k[None], cos, sin, pos, interleaved)[0], k)
    assert torch.equal(v_rows[slots], v)
    others = torch.ones(pages * page_size, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.isnan(k_rows[others].float()).all() and torch.isnan(v_rows[others].float()).all()


@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype,interleaved,rotary_dim,d", [(BF16, True, 128, 128), (F16, False, 64, 128),
                                                             (BF16, False, 128, 256), (BF16, True, 32, 66)])
def test_rope_paged_append_quantizes_into_fp8_pages(dtype, interleaved, rotary_dim, d, kv_dtype, per_head):
    """The fp8 write stores the bytes the 16-bit write's values quantize to (x / scale rounded to
    nearest, saturated, NaN kept; kv_quant.quantize), on the vector path and (d = 66) the scalar one;
    q is rotated as with 16-bit pages, rows outside the slots keep their bytes."""
    from astrai.extension.kv_quant import quantize

    g = gen(d + rotary_dim + int(per_head))
    pages, page_size, hq, hk, tokens = 48, 16, 8, 4, 77
    q = make_x((1, tokens, hq, d), dtype, "blhd", g)[0]
    k, v = (make_x((1, tokens, hk, d), dtype, "blhd", g)[0] * 40 for _ in range(2))  # some saturate
    k[3, 1, 5] = float("nan")
    slots = torch.randperm(pages * page_size, generator=g)[:tokens].to(DEV)
    pos = torch.randint(0, MAX_POS, (tokens,), generator=g).to(DEV)
    cos, sin = tables(rotary_dim)
    shape = (hk,) if per_head else (1,)
    k_scale, v_scale = (torch.rand(shape, generator=g).to(DEV) * 0.05 + 0.01 for _ in range(2))
    wide = [torch.zeros(pages, page_size, hk, d, device=DEV, dtype=dtype) for _ in range(2)]
    q16 = torch.empty_like(q)
    module().rope_paged_append(abi(q), abi(k), abi(v), abi(wide[0]), abi(wide[1]), abi(cos), abi(sin), abi(pos),
                               abi(slots), abi(q16), interleaved, stream())
    poison = 0x7B  # what the rows outside the slots hold before and after
    fp8 = [torch.full((pages, page_size, hk, d), poison, device=DEV, dtype=torch.uint8).view(kv_dtype)
           for _ in range(2)]
    q8 = torch.full_like(q, float("nan"))
    module().rope_paged_append(abi(q), abi(k), abi(v), abi(fp8[0]), abi(fp8[1]), abi(cos), abi(sin), abi(pos),
                               abi(slots), abi(q8), interleaved, stream(), kv_scales=(abi(k_scale), abi(v_scale)))
    torch.cuda.synchronize()
    assert torch.equal(q8, q16)
    others = torch.ones(pages * page_size, dtype=torch.bool, device=DEV)
    others[slots] = False
    for got, ref, scale in ((fp8[0], wide[0], k_scale), (fp8[1], wide[1], v_scale)):
        rows, want = got.view(-1, hk, d)[slots], quantize(ref.view(-1, hk, d)[slots], scale, kv_dtype)
        nan = torch.isnan(want.float())
        assert torch.equal(rows.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
        assert torch.isnan(rows.float()[nan]).all()
        assert (got.view(-1, hk, d)[others].view(torch.uint8) == poison).all()


def test_rope_paged_append_refuses_bad_fp8_arguments():
    g = gen(12)
    q, k, v = (make_x((1, 3, 2, 64), BF16, "blhd", g)[0] for _ in range(3))
    cache = torch.zeros(4, 4, 2, 64, device=DEV, dtype=torch.float8_e4m3fn)
    cos, sin = tables(64)
    args = (abi(q), abi(k), abi(v), abi(cache), abi(cache.clone()), abi(cos), abi(sin),
            abi(torch.arange(3, device=DEV)), abi(torch.arange(3, device=DEV)), abi(torch.empty_like(q)), True,
            stream())
    one = torch.ones(1, device=DEV)
    with pytest.raises(ValueError, match="kv_scales"):
        module().rope_paged_append(*args)
    with pytest.raises(ValueError, match="k_scale"):
        module().rope_paged_append(*args, kv_scales=(abi(one.half()), abi(one)))
    with pytest.raises(ValueError, match="v_scale"):
        module().rope_paged_append(*args, kv_scales=(abi(one), abi(torch.ones(3, device=DEV))))
    bf16_cache = torch.zeros(4, 4, 2, 64, device=DEV, dtype=BF16)
    with pytest.raises(ValueError, match="kv_scales"):
        module().rope_paged_append(*args[:3], abi(bf16_cache), abi(bf16_cache.clone()), *args[5:],
                                   kv_scales=(abi(one), abi(one)))


def test_rope_paged_append_skips_a_slot_outside_the_cache():
    g = gen(10)
    q, k, v = (make_x((1, 3, 2, 64), BF16, "blhd", g)[0] for _ in range(3))
    k_cache = torch.full((4, 4, 2, 64), float("nan"), device=DEV, dtype=BF16)
    v_cache = torch.full_like(k_cache, float("nan"))
    cos, sin = tables(64)
    slots = torch.tensor([0, 16, -1], device=DEV)  # 16 = one past the last row
    module().rope_paged_append(abi(q), abi(k), abi(v), abi(k_cache), abi(v_cache), abi(cos), abi(sin),
                               abi(torch.arange(3, device=DEV)), abi(slots), abi(torch.empty_like(q)), True, stream())
    torch.cuda.synchronize()
    assert torch.equal(v_cache.view(-1, 2, 64)[0], v[0])
    assert torch.isnan(v_cache.view(-1, 2, 64)[1:].float()).all()
    assert torch.isnan(k_cache.view(-1, 2, 64)[1:].float()).all()


# -- the public API ---------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_rotary_emb_takes_the_kernel(dtype, interleaved):
    g = gen(11)
    x = make_x((3, 50, 8, 128), dtype, "bhld", g)
    freqs, pos = tables(64), positions_of("2d", 3, 50, g)
    with torch.no_grad():
        out = apply_rotary_emb(x, freqs, interleaved=interleaved, positions=pos)
    check_close(out, rope_reference(x, *freqs, pos, interleaved), x)
    chosen = {d.chosen for d in explain("rotary_emb") if d.key.dtype == dtype and d.key.head_dim == 128}
    assert chosen == {"cuda"}


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_call_takes_the_kernel_and_its_backward(dtype, interleaved):
    """With a gradient the kernel still runs (the decision says so) and the gradient is the
    inverse rotation of the output gradient, element-wise, against autograd in float64."""
    g = gen(12)
    x = make_x((2, 40, 4, 64), dtype, "blhd", g).requires_grad_()
    freqs, pos = tables(48), positions_of("1d", 2, 40, g)
    grad = make_x((2, 40, 4, 64), dtype, "blhd", g)
    out = apply_rotary_emb(x, freqs, interleaved=interleaved, positions=pos)
    assert type(out.grad_fn).__name__.startswith("_RotaryFunction")  # the kernel's autograd Function
    out.backward(grad)
    x64 = x.detach().double().cpu().requires_grad_()
    rope_reference(x64, *freqs, pos, interleaved).backward(grad.double().cpu())
    check_close(x.grad, x64.grad, grad)
    decisions = [d for d in explain("rotary_emb") if d.key.needs_grad and d.key.dtype == dtype and d.key.head_dim == 64]
    assert decisions and {d.chosen for d in decisions} == {"cuda"}, [str(d) for d in decisions]


def test_float64_takes_the_autograd_path_with_the_right_gradient():
    g = gen(13)
    x = make_x((1, 8, 2, 64), torch.float64, "blhd", g).requires_grad_()
    freqs = tables(64)
    grad = torch.randn(x.shape, generator=g, dtype=torch.float64).to(DEV)
    apply_rotary_emb(x, freqs).backward(grad)
    want = rope_reference(grad.cpu(), freqs[0], -freqs[1])
    torch.testing.assert_close(x.grad.cpu(), want, atol=1e-12, rtol=1e-12)
    decisions = [d for d in explain("rotary_emb") if d.key.dtype == torch.float64]
    assert decisions and {d.chosen for d in decisions} == {"torch"}
    assert "float64" in decisions[0].trace[0].reason


@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_emb_qk_with_gradients_and_in_place(inplace):
    g = gen(14)
    q, k = make_x((2, 33, 16, 128), BF16, "blhd", g), make_x((2, 33, 4, 128), BF16, "blhd", g)
    freqs, pos = tables(128), positions_of("2d", 2, 33, g)
    want_q, want_k = (rope_reference(t, *freqs, pos, False) for t in (q, k))
    if inplace:
        with torch.no_grad():
            qo, ko = apply_rotary_emb_qk(q, k, freqs, positions=pos, interleaved=False, inplace=True)
        assert qo is q and ko is k
        check_close(q, want_q, q)
        check_close(k, want_k, k)
        return
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = apply_rotary_emb_qk(qg, kg, freqs, positions=pos, interleaved=False)
    check_close(qo, want_q, q)
    check_close(ko, want_k, k)
    gq, gk = make_x(q.shape, BF16, "blhd", g), make_x(k.shape, BF16, "blhd", g)
    torch.autograd.backward((qo, ko), (gq, gk))
    check_close(qg.grad, rope_reference(gq, freqs[0], -freqs[1], pos, False), gq)
    check_close(kg.grad, rope_reference(gk, freqs[0], -freqs[1], pos, False), gk)


def test_validation_on_cuda_tensors():
    x = make_x((1, 4, 2, 64), BF16, "blhd", gen(15))
    cos, sin = tables(64)
    with pytest.raises(ValueError, match="^cos is on cpu"):
        apply_rotary_emb(x, (cos.cpu(), sin))
    with pytest.raises(ValueError, match="^positions is on cpu"):
        apply_rotary_emb(x, (cos, sin), positions=torch.arange(4))
    with pytest.raises(ValueError, match=r"^k's leading dims"):
        apply_rotary_emb_qk(x, x[:, :3], (cos, sin))


def test_out_of_range_positions_raise_on_the_gpu_in_debug_mode(monkeypatch):
    x = make_x((1, 4, 2, 64), BF16, "blhd", gen(16))
    monkeypatch.setenv("ASTRAI_DEBUG", "1")
    with pytest.raises(ValueError, match=r"^positions must lie in \[0, 20000\)"):
        apply_rotary_emb(x, tables(64), positions=torch.tensor([0, 1, 2, 20000], device=DEV))


# -- CUDA graphs and torch.compile --------------------------------------------------------


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up: resolves, loads the module
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_entry_points_capture_in_a_graph():
    g = gen(17)
    x = make_x((4, 1, 32, 128), BF16, "blhd", g)
    q, k = make_x((4, 1, 32, 128), BF16, "blhd", g), make_x((4, 1, 8, 128), BF16, "blhd", g)
    freqs = tables(128)
    pos = torch.zeros(4, 1, dtype=torch.int64, device=DEV)
    with torch.inference_mode():
        g1, out = capture(lambda: apply_rotary_emb(x, freqs, interleaved=False, positions=pos))
        g2, _ = capture(lambda: apply_rotary_emb_qk(q, k, freqs, positions=pos, inplace=True))
        for step in range(3):
            fresh_x, fresh_q, fresh_k = (torch.randn_like(t) for t in (x, q, k))
            x.copy_(fresh_x)
            q.copy_(fresh_q)
            k.copy_(fresh_k)
            pos.fill_(1000 * step + 7)
            out.fill_(float("nan"))
            g1.replay()
            g2.replay()
            torch.cuda.synchronize()
            check_close(out, rope_reference(fresh_x, *freqs, pos, False), fresh_x)
            check_close(q, rope_reference(fresh_q, *freqs, pos, True), fresh_q)
            check_close(k, rope_reference(fresh_k, *freqs, pos, True), fresh_k)


@pytest.mark.parametrize("entry", ["apply_rotary_emb", "apply_rotary_emb_qk", "apply_rotary_emb_qk_inplace"])
def test_entry_points_under_torch_compile_fullgraph(entry):
    g = gen(18)
    q, k = make_x((2, 9, 8, 64), BF16, "blhd", g), make_x((2, 9, 2, 64), BF16, "blhd", g)
    freqs, pos = tables(64), positions_of("2d", 2, 9, g)
    fns = {
        "apply_rotary_emb": lambda q, k: apply_rotary_emb(q, freqs, interleaved=False, positions=pos),
        "apply_rotary_emb_qk": lambda q, k: apply_rotary_emb_qk(q, k, freqs, positions=pos),
        "apply_rotary_emb_qk_inplace": lambda q, k: apply_rotary_emb_qk(q, k, freqs, positions=pos, inplace=True),
    }
    torch._dynamo.reset()
    compiled = torch.compile(fns[entry], fullgraph=True)
    with torch.no_grad():
        got = compiled(q.clone(), k.clone())
    if entry == "apply_rotary_emb":
        check_close(got, rope_reference(q, *freqs, pos, False), q)
    else:
        check_close(got[0], rope_reference(q, *freqs, pos, True), q)
        check_close(got[1], rope_reference(k, *freqs, pos, True), k)


# -- attention with rope on a paged cache ---------------------------------------------------


def paged_pair(q_lens, hk=8, d=128, dtype=BF16):
    caches = [PagedKVCache(2, 256, 16, hk, d, dtype=dtype, device=DEV, page_order=list(range(255, -1, -1)))
              for _ in range(2)]
    for cache in caches:
        for i in range(len(q_lens)):
            cache.add_sequence(i)
    return caches


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_attention_with_rope_matches_rotary_then_attention(interleaved):
    """Prefill, then decode steps, with the fused kernel; the reference rotates by hand at the
    positions the lengths imply and appends to a second cache; k pages must match."""
    g = gen(19)
    fused, by_hand = paged_pair([5, 40, 17])
    freqs = tables(128)
    done = [0, 0, 0]
    for q_lens in ([5, 40, 17], [1, 1, 1], [1, 1, 1]):
        for cache in (fused, by_hand):
            cache.plan([0, 1, 2], q_lens=q_lens)
        pos = torch.tensor([p for n0, n in zip(done, q_lens) for p in range(n0, n0 + n)], device=DEV)
        total = sum(q_lens)
        q = make_x((1, total, 32, 128), BF16, "blhd", g)
        k, v = make_x((1, total, 8, 128), BF16, "blhd", g), make_x((1, total, 8, 128), BF16, "blhd", g)
        with torch.no_grad():
            q_rot = rope_reference(q, *freqs, pos, interleaved).to(BF16).to(DEV)
            k_rot = rope_reference(k, *freqs, pos, interleaved).to(BF16).to(DEV)
            for layer in (0, 1):  # every layer writes the step (one left out would roll it back); layer 1 checked
                out = attention(q, k, v, kv_cache=fused, layer_id=layer, rope=freqs, rope_interleaved=interleaved)
                want = attention(q_rot, k_rot, v, kv_cache=by_hand, layer_id=layer)
        kf, vf = fused.gather_flat(1)
        kh, vh = by_hand.gather_flat(1)
        assert torch.equal(vf, vh)
        assert (kf.float() - kh.float()).abs().max().item() <= 2.0**-7 * kh.float().abs().max().item()
        assert (out.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()
        done = [a + b for a, b in zip(done, q_lens)]
    assert {d.chosen for d in explain("rope_paged_append")} == {"cuda"}
