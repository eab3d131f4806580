"""Property-based sweep of every public entry point: shapes, strides, dtypes, masks, values.

Hypothesis draws the *structure* of a call (shapes, layouts, dtype, mask kind, a seed);
the values come from a seeded torch generator. Every strided layout leaves gaps in its
storage, and the gaps hold NaN ("poison"): an implementation that reads outside the
view, or reads a view as if it were contiguous, produces NaN and fails the comparison.

Valid calls must match the float64 references (``reference.py``, ``fp8_reference.py``);
invalid ones must raise ``TypeError`` / ``ValueError`` whose message starts with the
argument's name. The decided behaviour at the edges (documented in docs/reliability.md):

- attention: a query row that keeps no key (all-masked, or causal with q_len > kv_len)
  is zeros; NaN/Inf in q or in a kept key/value propagate as in the reference (what sits
  at masked-out positions is never part of the result's contract); empty batches and
  zero-length sequences are rejected (``ValueError`` naming the tensor);
- rotary: NaN/Inf in ``x`` stay within their channel pair; empty tensors are rejected;
- FP8 quantize: ``x * multiplier`` beyond the format's largest finite value (and ±inf)
  saturates to ±max, NaN stays NaN, ``amax`` is NaN when ``x`` holds a NaN;
- FP8 GEMM: a NaN operand element makes its output row/column NaN; results beyond the
  bf16 range are ±inf (the float64 reference rounded to bf16).

Examples are few (CI has two cores) and derandomized so CI runs are reproducible.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from fp8_reference import FP8, encode, gemm_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import attention_ref, rotary_ref, tolerance

from astrai.extension import apply_rotary_emb, attention
from astrai.extension.backend import fp8 as fp8_policy
from astrai.extension.fp8 import DynamicScaling, Format, fp8_autocast
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

SWEEP = settings(deadline=None, max_examples=30, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(SWEEP, max_examples=15)

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "permuted", "strided_last", "padded", "offset"]
seeds = st.integers(0, 2**31 - 1)


@pytest.fixture(autouse=True)
def fresh_runtime(monkeypatch):
    """No plugins, an empty decision cache and no ASTR_BACKEND for every test."""
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    with use_runtime(Runtime(Registry(lambda: []))):
        yield


# -- strided tensors with poisoned gaps -------------------------------------------------


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A view holding ``values`` in ``layout``; its storage gaps are NaN.

    - ``contiguous``: a plain copy;
    - ``permuted``: stored with dims 1 and 2 swapped (the BHLD layout of a [B, L, H, D]
      tensor), or transposed for 2-D tensors;
    - ``strided_last``: every other element of a last dim twice as long (stride 2);
    - ``padded``: rows of a last dim longer than needed (contiguous last dim, padded rows);
    - ``offset``: contiguous, starting one element into its storage (misaligned pointer).
    """
    poison = float("nan") if values.dtype.is_floating_point else 0
    shape = tuple(values.shape)
    if layout == "contiguous":
        return values.clone(memory_format=torch.contiguous_format)
    if layout == "permuted":
        a, b = {1: (0, 0), 2: (0, 1), 3: (0, 1)}.get(values.dim(), (1, 2))
        return values.transpose(a, b).contiguous().transpose(a, b)
    if layout == "strided_last":
        store = torch.full(shape[:-1] + (2 * shape[-1],), poison, dtype=values.dtype)
        store[..., ::2] = values
        return store[..., ::2]
    if layout == "padded":
        store = torch.full(shape[:-1] + (shape[-1] + 3,), poison, dtype=values.dtype)
        store[..., : shape[-1]] = values
        return store[..., : shape[-1]]
    if layout == "offset":
        flat = torch.full((values.numel() + 1,), poison, dtype=values.dtype)
        flat[1:] = values.reshape(-1)
        return flat[1:].view(shape)
    raise AssertionError(layout)


def fp8_laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``laid_out`` for FP8 tensors (poison: the NaN byte 0x7F)."""
    byte = values.view(torch.uint8)
    if layout == "contiguous":
        return byte.clone().view(values.dtype)
    if layout == "permuted":
        return byte.t().contiguous().t().view(values.dtype)
    rows, cols = byte.shape
    if layout == "strided_last":
        store = torch.full((rows, 2 * cols), 0x7F, dtype=torch.uint8)
        store[:, ::2] = byte
        return store.view(values.dtype)[:, ::2]
    if layout == "padded":
        store = torch.full((rows, cols + 3), 0x7F, dtype=torch.uint8)
        store[:, :cols] = byte
        return store.view(values.dtype)[:, :cols]
    flat = torch.full((byte.numel() + 1,), 0x7F, dtype=torch.uint8)
    flat[1:] = byte.reshape(-1)
    return flat.view(values.dtype)[1:].view(rows, cols)


def randn(gen: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def assert_untouched(views, copies):
    for view, copy in zip(views, copies):
        torch.testing.assert_close(view, copy, atol=0, rtol=0, equal_nan=True)


# -- attention --------------------------------------------------------------------------


def attention_ref_faithful(q, k, v, mask=None, is_causal=False):
    """``reference.attention_ref`` without its blanket ``nan_to_num``: only rows that keep
    no key are zeroed, so NaN/Inf from the inputs propagate. (``attention_ref`` turns
    *every* NaN probability into 0, which also hides NaN inputs; reported.)"""
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    b, lq, hq, d = q64.shape
    lkv, group = k64.shape[1], hq // k64.shape[2]
    keep = torch.ones(b, lq, lkv, dtype=torch.bool)
    if mask is not None:
        keep &= mask[:, None, :] if mask.dim() == 2 else mask
    if is_causal:
        keep &= torch.arange(lkv)[None, :] <= torch.arange(lq)[:, None] + (lkv - lq)
    kk = k64.repeat_interleave(group, dim=2)
    vv = v64.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q64, kk) / math.sqrt(d)
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(keep.any(-1)[:, None, :, None], probs, 0.0)
    out = torch.einsum("bhij,bjhd->bihd", probs, vv)
    return torch.where(keep.any(-1)[:, :, None, None], out, 0.0)



@st.composite
def attention_calls(draw):
    b, lq, lkv = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([8, 16, 32, 64]))
    dtype = draw(st.sampled_from(FLOATS))
    layouts = draw(st.tuples(*[st.sampled_from(LAYOUTS + ["broadcast_batch"])] * 3))
    mask_ndim = draw(st.sampled_from([0, 2, 3]))
    causal = draw(st.booleans())
    seed = draw(seeds)
    return dict(b=b, lq=lq, lkv=lkv, hq=hkv * group, hkv=hkv, d=d, dtype=dtype, layouts=layouts,
                mask_ndim=mask_ndim, causal=causal, seed=seed)


def make_attention(c):
    gen = torch.Generator().manual_seed(c["seed"])
    shapes = [(c["b"], c["lq"], c["hq"], c["d"]), (c["b"], c["lkv"], c["hkv"], c["d"]),
              (c["b"], c["lkv"], c["hkv"], c["d"])]
    tensors = []
    for shape, layout in zip(shapes, c["layouts"]):
        if layout == "broadcast_batch":  # one sequence shared by the batch: batch stride 0
            tensors.append(randn(gen, 1, *shape[1:], dtype=c["dtype"]).expand(shape))
        else:
            tensors.append(laid_out(randn(gen, *shape, dtype=c["dtype"]), layout))
    mask = None
    if c["mask_ndim"]:
        shape = (c["b"], c["lkv"]) if c["mask_ndim"] == 2 else (c["b"], c["lq"], c["lkv"])
        mask = torch.rand(shape, generator=gen) < 0.7
        mask.view(-1, c["lkv"])[0] = False  # at least one row keeps nothing
    return tensors, mask


@SWEEP
@given(attention_calls())
def test_attention_matches_reference(c):
    (q, k, v), mask = make_attention(c)
    copies = [t.clone() for t in (q, k, v)]
    out = attention(q, k, v, mask=mask, is_causal=c["causal"])
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_ref(q, k, v, mask=mask, is_causal=c["causal"])
    torch.testing.assert_close(out.double(), ref, **tolerance(c["dtype"]))
    assert_untouched((q, k, v), copies)


@FEW
@given(attention_calls(), st.sampled_from([math.nan, math.inf, -math.inf]), st.data())
def test_attention_nan_inf_in_values_propagate_as_in_reference(c, value, data):
    c = dict(c, layouts=("contiguous",) * 3)
    (q, k, v), mask = make_attention(c)
    b, s, h, d = (data.draw(st.integers(0, n - 1)) for n in v.shape)
    if mask is not None:  # poison a kept position only: masked-out K/V are never part of the result
        if mask.dim() == 2:
            mask[b, s] = True
        else:
            mask[b, :, s] = True
    v[b, s, h, d] = value
    out = attention(q, k, v, mask=mask, is_causal=c["causal"])
    ref = attention_ref_faithful(q, k, v, mask=mask, is_causal=c["causal"])
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    torch.testing.assert_close(out.double(), ref, equal_nan=True, **tolerance(c["dtype"]))


def test_attention_nan_inf_in_queries_and_keys_propagate():
    bad = []
    for where, value, lq, lkv, dtype in itertools.product("qk", [math.nan, math.inf, -math.inf], [1, 3], [1, 4],
                                                          [torch.float32, torch.float64, torch.bfloat16]):
        gen = torch.Generator().manual_seed(0)
        q, k, v = randn(gen, 1, lq, 2, 8, dtype=dtype), randn(gen, 1, lkv, 1, 8, dtype=dtype), randn(gen, 1, lkv, 1, 8, dtype=dtype)
        {"q": q, "k": k}[where][0, 0, 0, 0] = value
        out, ref = attention(q, k, v), attention_ref_faithful(q, k, v)
        if not (torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())):
            bad.append(f"{where}={value} lq={lq} lkv={lkv} {dtype}")
    assert not bad, bad


def test_attention_rows_that_keep_nothing_are_zero():
    gen = torch.Generator().manual_seed(11)
    q, k, v = randn(gen, 2, 5, 4, 16), randn(gen, 2, 3, 2, 16), randn(gen, 2, 3, 2, 16)
    # causal with q_len > kv_len: rows 0 and 1 see no key (bottom-right alignment)
    out = attention(q, k, v, is_causal=True)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2])) and out[:, 2:].abs().sum() > 0
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert torch.equal(attention(q, k, v, mask=mask), torch.zeros_like(q))


def test_attention_nan_query_in_a_row_that_keeps_nothing_gives_zeros():
    gen = torch.Generator().manual_seed(2)
    q, k, v = randn(gen, 1, 2, 2, 8), randn(gen, 1, 3, 1, 8), randn(gen, 1, 3, 1, 8)
    mask = torch.tensor([[[True, False, True], [False, False, False]]])
    q[0, 1, 0, 0] = math.nan
    out = attention(q, k, v, mask=mask)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    torch.testing.assert_close(out.double(), attention_ref_faithful(q, k, v, mask=mask), **tolerance(torch.float32))


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_attention_masked_out_keys_are_never_read(poison):
    gen = torch.Generator().manual_seed(2)
    q, k, v = randn(gen, 1, 2, 2, 8), randn(gen, 1, 3, 1, 8), randn(gen, 1, 3, 1, 8)
    mask = torch.tensor([[True, False, True]])
    k[0, 1] = poison
    v[0, 1] = poison
    out = attention(q, k, v, mask=mask)
    # reference.attention_ref never reads masked-out keys or values (not even as 0 * NaN)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, mask=mask), **tolerance(torch.float32))


@pytest.mark.parametrize("shape", [(0, 4, 2, 16), (2, 0, 2, 16)], ids=["empty batch", "zero-length sequence"])
def test_attention_rejects_empty_batches_and_sequences(shape):
    q = torch.randn(shape)
    k = torch.randn(shape[0], 3, 2, 16)
    with pytest.raises(ValueError, match=r"^q has an empty dimension"):
        attention(q, k, k)
    with pytest.raises(ValueError, match=r"^k has an empty dimension"):
        attention(torch.randn(2, 4, 2, 16), torch.randn(2, 0, 2, 16), torch.randn(2, 0, 2, 16))


BREAKERS = {
    "q": [(TypeError, lambda a: dict(a, q=a["q"].to(torch.int32))),
          (TypeError, lambda a: dict(a, q=a["q"].tolist())),
          (ValueError, lambda a: dict(a, q=a["q"][0]))],
    "k": [(TypeError, lambda a: dict(a, k=a["k"].to(torch.float16 if a["k"].dtype != torch.float16 else torch.float32))),
          (ValueError, lambda a: dict(a, k=a["k"][..., :-1], v=a["v"][..., :-1]))],
    "v": [(ValueError, lambda a: dict(a, v=a["v"][:, :-1] if a["v"].shape[1] > 1 else a["v"][..., :1, :])),
          (TypeError, lambda a: dict(a, v=None))],
    "mask": [(TypeError, lambda a: dict(a, mask=torch.ones(a["q"].shape[0], a["k"].shape[1]))),
             (ValueError, lambda a: dict(a, mask=torch.ones(a["q"].shape[0], a["k"].shape[1] + 1, dtype=torch.bool)))],
    "is_causal": [(TypeError, lambda a: dict(a, is_causal=1))],
    "fwd": [(ValueError, lambda a: dict(a, fwd="train"))],
}


@SWEEP
@given(attention_calls(), st.sampled_from([(arg, i) for arg, cases in BREAKERS.items() for i in range(len(cases))]))
def test_attention_invalid_inputs_name_the_argument(c, breaker):
    (q, k, v), mask = make_attention(c)
    arg, i = breaker
    error, breaks = BREAKERS[arg][i]
    bad = breaks(dict(q=q, k=k, v=v, mask=mask, is_causal=c["causal"]))
    with pytest.raises(error) as info:
        attention(**bad)
    message = str(info.value)
    assert message.startswith(arg) or f"{arg} " in message.split(":")[0], message


@FEW
@given(st.sampled_from(FLOATS), st.integers(1, 3), st.integers(1, 5), st.booleans())
def test_attention_on_the_meta_device_gives_shape_and_dtype(dtype, b, lq, causal):
    q = torch.empty(b, lq, 4, 16, dtype=dtype, device="meta")
    k = torch.empty(b, 7, 2, 16, dtype=dtype, device="meta")
    out = attention(q, k, k, is_causal=causal)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == dtype


# -- rotary -----------------------------------------------------------------------------


@st.composite
def rotary_calls(draw):
    return dict(b=draw(st.integers(1, 3)), seq=draw(st.integers(1, 9)), h=draw(st.integers(1, 4)),
                d=2 * draw(st.integers(1, 40)), dtype=draw(st.sampled_from(FLOATS)),
                x_layout=draw(st.sampled_from(LAYOUTS)),
                table_layout=draw(st.sampled_from(["contiguous", "permuted", "strided_last", "offset"])),
                grad=draw(st.booleans()), seed=draw(seeds))


def make_rotary(c):
    gen = torch.Generator().manual_seed(c["seed"])
    x = laid_out(randn(gen, c["b"], c["seq"], c["h"], c["d"], dtype=c["dtype"]), c["x_layout"])
    angles = (torch.rand(c["seq"], c["d"] // 2, generator=gen, dtype=torch.float64) * 2 - 1) * math.pi * 64
    cos = laid_out(angles.cos().float(), c["table_layout"])
    sin = laid_out(angles.sin().float(), c["table_layout"])
    return x, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_float_view_at_an_odd_storage_offset(dtype):
    x, cos, sin = make_rotary(dict(b=1, seq=3, h=2, d=8, dtype=dtype, x_layout="offset",
                                   table_layout="contiguous", grad=False, seed=1))
    torch.testing.assert_close(apply_rotary_emb(x, (cos, sin)).double(), rotary_ref(x, cos, sin), **tolerance(dtype))


@SWEEP
@given(rotary_calls())
def test_rotary_matches_reference(c):
    x, cos, sin = make_rotary(c)
    copies = [t.clone() for t in (x, cos, sin)]
    with torch.set_grad_enabled(c["grad"]):
        out = apply_rotary_emb(x, (cos, sin))
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(c["dtype"]))
    assert_untouched((x, cos, sin), copies)


@FEW
@given(rotary_calls(), st.sampled_from([math.nan, math.inf, -math.inf]), st.data())
def test_rotary_nan_inf_stay_in_their_pair(c, value, data):
    x, cos, sin = make_rotary(dict(c, x_layout="contiguous", table_layout="contiguous"))
    idx = tuple(data.draw(st.integers(0, n - 1)) for n in x.shape)
    x[idx] = value
    out = apply_rotary_emb(x, (cos, sin))
    ref = rotary_ref(x, cos, sin)
    torch.testing.assert_close(out.double(), ref, equal_nan=True, **tolerance(c["dtype"]))
    bad = ~out.isfinite()
    pair = idx[:3] + (slice(idx[3] // 2 * 2, idx[3] // 2 * 2 + 2),)
    assert bad[pair].all() and bad.sum() == 2


@FEW
@given(rotary_calls())
def test_rotary_on_the_meta_device_gives_shape_and_dtype(c):
    x = torch.empty(c["b"], c["seq"], c["h"], c["d"], dtype=c["dtype"], device="meta")
    cos = torch.empty(c["seq"], c["d"] // 2, device="meta")
    out = apply_rotary_emb(x, (cos, cos))
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == x.dtype


ROTARY_BREAKERS = {
    "x": [(TypeError, lambda x, c, s: (x.to(torch.int16), (c, s))),
          (ValueError, lambda x, c, s: (x[..., :1], (c[:, :0], s[:, :0]))),
          (ValueError, lambda x, c, s: (x[0], (c, s)))],
    "cos": [(TypeError, lambda x, c, s: (x, (c.double(), s))),
            (ValueError, lambda x, c, s: (x, (torch.cat([c, c], dim=1), s)))],  # rotary_dim > head_dim
    "sin": [(ValueError, lambda x, c, s: (x, (c, s[..., :-1] if s.shape[-1] > 1 else s[:, :0])))],
    "freqs": [(TypeError, lambda x, c, s: (x, c))],
}


@SWEEP
@given(rotary_calls(), st.sampled_from([(a, i) for a, cases in ROTARY_BREAKERS.items() for i in range(len(cases))]))
def test_rotary_invalid_inputs_name_the_argument(c, breaker):
    x, cos, sin = make_rotary(c)
    arg, i = breaker
    error, breaks = ROTARY_BREAKERS[arg][i]
    with pytest.raises(error, match=rf"^{arg}\b"):
        apply_rotary_emb(*breaks(x, cos, sin))


# -- FP8 --------------------------------------------------------------------------------


def decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    return torch.from_numpy(codes.astype(np.uint8)).view(FP8[fmt]).to(torch.float64).numpy()


@st.composite
def quantize_calls(draw):
    return dict(m=draw(st.integers(1, 40)), k=draw(st.integers(1, 40)),
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                layout=draw(st.sampled_from(LAYOUTS)), fmt=draw(st.sampled_from(["e4m3", "e5m2"])),
                out_layout=draw(st.sampled_from([0, 1, 2])),
                log2_multiplier=draw(st.floats(-12, 16)), seed=draw(seeds))


def make_quantize(c):
    gen = torch.Generator().manual_seed(c["seed"])
    x = laid_out(randn(gen, c["m"], c["k"], dtype=c["dtype"]) * 8, c["layout"])
    return x, torch.tensor(2.0 ** c["log2_multiplier"], dtype=torch.float32)


def check_quantized(x, multiplier, fmt, out_layout, result):
    q, q_t, amax = result
    scaled = x.to(torch.float32).numpy().astype(np.float64) * np.float32(multiplier.item())
    expected = encode(scaled.astype(np.float32).astype(np.float64), fmt)
    got = [q] if out_layout == 0 else [q_t.t()] if out_layout == 1 else [q, q_t.t()]
    for g in got:
        assert g.dtype == FP8[fmt] and g.shape == x.shape
        np.testing.assert_array_equal(decode(g.contiguous().view(torch.uint8).numpy(), fmt),
                                      decode(expected, fmt))  # NaN == NaN here, whatever its sign
    empty = q if out_layout == 1 else q_t if out_layout == 0 else None
    assert empty is None or empty.numel() == 0
    ref_amax = np.abs(x.to(torch.float64).numpy()).max()
    np.testing.assert_array_equal(amax.numpy(), np.float32(ref_amax))


@SWEEP
@given(quantize_calls())
def test_fp8_quantize_matches_reference_bytes(c):
    x, multiplier = make_quantize(c)
    copy = x.clone()
    result = fp8_policy.quantize(x, multiplier, c["fmt"], c["out_layout"])
    check_quantized(x, multiplier, c["fmt"], c["out_layout"], result)
    assert_untouched([x], [copy])


@FEW
@given(quantize_calls(), st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30]), st.data())
def test_fp8_quantize_overflow_saturates_and_nan_stays(c, value, data):
    x, multiplier = make_quantize(dict(c, layout="contiguous", dtype=torch.float32))
    i, j = data.draw(st.integers(0, c["m"] - 1)), data.draw(st.integers(0, c["k"] - 1))
    x[i, j] = value
    q, _, amax = fp8_policy.quantize(x, multiplier, c["fmt"], 0)
    check_quantized(x, multiplier, c["fmt"], 0, (q, torch.empty(0), amax))
    got = float(q[i, j].to(torch.float64))
    fp8_max = float(torch.finfo(FP8[c["fmt"]]).max)
    assert math.isnan(got) if math.isnan(value) else got == math.copysign(fp8_max, value)


@st.composite
def gemm_calls(draw):
    return dict(m=draw(st.integers(1, 24)), k=draw(st.integers(1, 40)), n=draw(st.integers(1, 24)),
                fmts=draw(st.sampled_from([("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2")])),
                layouts=draw(st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS))),
                bias=draw(st.sampled_from([None, torch.bfloat16, torch.float32])),
                scale=draw(st.floats(2.0**-20, 2.0**4)), seed=draw(seeds))


def make_gemm(c):
    gen = torch.Generator().manual_seed(c["seed"])
    a = fp8_laid_out((randn(gen, c["m"], c["k"]) * 4).to(FP8[c["fmts"][0]]), c["layouts"][0])
    b = fp8_laid_out((randn(gen, c["k"], c["n"]) * 4).to(FP8[c["fmts"][1]]), c["layouts"][1])
    bias = None if c["bias"] is None else randn(gen, c["n"], dtype=c["bias"])
    return a, b, torch.tensor(c["scale"], dtype=torch.float32), bias


def check_gemm(out, a, b, scale, bias):
    ref = gemm_reference(a, b, float(scale), bias)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    finite = ref[ref.isfinite()]
    atol = 2**-7 * (float(finite.abs().max()) if finite.numel() else 1.0)
    torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=2**-7, atol=atol, equal_nan=True)


@SWEEP
@given(gemm_calls())
def test_fp8_gemm_matches_reference(c):
    a, b, scale, bias = make_gemm(c)
    copies = [a.view(torch.uint8).clone(), b.view(torch.uint8).clone()]
    check_gemm(fp8_policy.gemm(a, b, scale, bias), a, b, scale, bias)
    assert_untouched([a.view(torch.uint8), b.view(torch.uint8)], copies)


@FEW
@given(gemm_calls(), st.data())
def test_fp8_gemm_nan_fills_its_row_and_overflow_is_inf(c, data):
    a, b, scale, bias = make_gemm(dict(c, layouts=("contiguous", "contiguous")))
    i = data.draw(st.integers(0, c["m"] - 1))
    a.view(torch.uint8)[i, data.draw(st.integers(0, c["k"] - 1))] = 0x7F  # NaN in both formats
    out = fp8_policy.gemm(a, b, scale, bias)
    assert out[i].isnan().all() and out.isnan().sum() == c["n"]
    check_gemm(out, a, b, scale, bias)
    huge = torch.tensor(3e38, dtype=torch.float32)  # beyond bf16's largest finite value
    a2, b2, _, _ = make_gemm(dict(c, layouts=("contiguous", "contiguous")))
    check_gemm(fp8_policy.gemm(a2, b2, huge), a2, b2, huge, None)


GEMM_BREAKERS = {
    "a": [(TypeError, lambda a, b, s, bias: (a.to(torch.bfloat16), b, s, bias)),
          (ValueError, lambda a, b, s, bias: (a[None], b, s, bias))],
    "b": [(TypeError, lambda a, b, s, bias: (a, b.view(torch.uint8), s, bias))],
    "scale": [(TypeError, lambda a, b, s, bias: (a, b, s.double(), bias)),
              (TypeError, lambda a, b, s, bias: (a, b, 0.5, bias))],
    "bias": [(ValueError, lambda a, b, s, bias: (a, b, s, torch.zeros(b.shape[1] + 1, dtype=torch.bfloat16))),
             (TypeError, lambda a, b, s, bias: (a, b, s, torch.zeros(b.shape[1], dtype=torch.int32)))],
}


@SWEEP
@given(gemm_calls(), st.sampled_from([(a, i) for a, cases in GEMM_BREAKERS.items() for i in range(len(cases))]))
def test_fp8_gemm_invalid_inputs_name_the_argument(c, breaker):
    arg, i = breaker
    error, breaks = GEMM_BREAKERS[arg][i]
    with pytest.raises(error, match=rf"^{arg}\b"):
        fp8_policy.gemm(*breaks(*make_gemm(c)))


@SWEEP
@given(quantize_calls(), st.sampled_from(["x", "scale", "fmt", "out_layout"]))
def test_fp8_quantize_invalid_inputs_name_the_argument(c, arg):
    x, multiplier = make_quantize(c)
    args = dict(x=x, scale=multiplier, fmt=c["fmt"], out_layout=c["out_layout"])
    args[arg] = {"x": x.to(torch.int32), "scale": multiplier.reshape(1, 1).expand(2, 2),
                 "fmt": "e3m4", "out_layout": 3}[arg]
    with pytest.raises((TypeError, ValueError), match=rf"^{arg}\b"):
        fp8_policy.quantize(**args)


# -- fp8_autocast linear -----------------------------------------------------------------


def fp8_round(t: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """Dequantized FP8 value of ``t`` quantized with dequant ``scale`` (multiplier 1/scale in float32)."""
    multiplier = np.float32(1.0) / np.float32(scale)
    scaled = t.detach().to(torch.float32).numpy().astype(np.float64) * multiplier
    codes = encode(scaled.astype(np.float32).astype(np.float64), fmt)
    return torch.from_numpy(decode(codes, fmt)) * float(np.float32(scale))


@SWEEP
@given(st.integers(1, 48), st.integers(1, 48), st.sampled_from([(), (3,), (2, 2)]), st.integers(1, 9),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.sampled_from(["contiguous", "permuted"]),
       st.sampled_from([Format.E4M3, Format.HYBRID]), seeds)
def test_fp8_autocast_linear_is_the_documented_function(fin, fout, lead, rows, dtype, with_bias, layout, fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(fin, fout, bias=with_bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(randn(gen, fout, fin))
    x = laid_out(randn(gen, rows, *lead, fin, dtype=dtype), layout if not lead else "contiguous")
    with torch.no_grad(), fp8_autocast(recipe=DynamicScaling(fp8_format=fmt)):
        y = lin(x)
    e4m3_max = float(torch.finfo(torch.float8_e4m3fn).max)
    sx = float(np.float32(x.detach().abs().max().double().item() / e4m3_max))
    sw = float(np.float32(lin.weight.detach().abs().max().double().item() / e4m3_max))
    expected = fp8_round(x, sx, "e4m3") @ fp8_round(lin.weight, sw, "e4m3").T
    if with_bias:
        expected = expected + lin.bias.detach().to(torch.bfloat16).double()
    assert y.shape == (rows, *lead, fout) and y.dtype == dtype
    tol = 2**-7 * float(expected.abs().max()) + 1e-30
    torch.testing.assert_close(y.double(), expected, rtol=2**-7, atol=tol)


# -- paged KV cache: pages start as garbage ----------------------------------------------


@FEW
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.sampled_from([1, 4, 16]),
       st.sampled_from([torch.float32, torch.bfloat16]), seeds)
def test_paged_attention_never_reads_unwritten_cache_slots(q_lens, page_size, dtype, seed):
    # A fresh cache's pages hold whatever memory held before (torch.empty): NaN here. Only
    # written slots may reach the result: prefill, then one decode step, vs the reference
    # over each request's own tokens.
    gen = torch.Generator().manual_seed(seed)
    hkv, hq, d = 2, 4, 16
    cache = PagedKVCache(1, 64, page_size, hkv, d, dtype=dtype)
    cache.k_pages.fill_(math.nan)
    cache.v_pages.fill_(math.nan)
    seqs = list(range(len(q_lens)))
    for s in seqs:
        cache.add_sequence(s)
    history = {s: ([], []) for s in seqs}
    for step_lens in (q_lens, [1] * len(q_lens)):
        cache.plan(seqs, step_lens)
        total = sum(step_lens)
        q, k, v = (randn(gen, 1, total, h, d, dtype=dtype) for h in (hq, hkv, hkv))
        out = attention(q, k, v, kv_cache=cache, layer_id=0)
        start = 0
        for s, n in zip(seqs, step_lens):
            history[s][0].append(k[0, start:start + n])
            history[s][1].append(v[0, start:start + n])
            ks, vs = (torch.cat(parts)[None] for parts in history[s])
            ref = attention_ref_faithful(q[:, start:start + n], ks, vs, is_causal=True)
            torch.testing.assert_close(out[:, start:start + n].double(), ref, **tolerance(dtype))
            start += n
