"""PagedKVCache with FP8 storage (kv_dtype): the per-element error bound of docs/kv_cache_fp8.md,
saturation, calibration, set_kv_scales, attention over the dequantized values, the rope route."""

import math

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest
from reference import attention_ref, tolerance
from rotary_reference import rope_tables

from astrai.extension import attention
from astrai.extension.backend import rope_paged, rotary
from astrai.extension.backend.attention import ATTN_BACKEND, attn_backend
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

HQ, HKV, D = 4, 2, 32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {E4M3: dict(mantissa_bits=3, min_normal_exp=-6, max=448.0),
           E5M2: dict(mantissa_bits=2, min_normal_exp=-14, max=57344.0)}
# float32 rounding of x / scale and of stored * scale adds at most ~2**-23 relative to the bound
SLACK = 1 + 2**-18


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor, kv_dtype) -> torch.Tensor:
    """float64 bound on |dequant(quant(x)) - x| for |x| <= max * scale (docs/kv_cache_fp8.md): half
    the format's spacing at y = x / scale, times scale: scale * 2**(max(floor(log2|y|), emin) - m - 1);
    ``scale`` broadcastable to ``x``."""
    fmt = FORMATS[kv_dtype]
    y = x.double() / scale.double()
    _, exponent = torch.frexp(y)  # |y| = mantissa * 2**exponent, mantissa in [0.5, 1)
    binade = torch.clamp(exponent - 1, min=fmt["min_normal_exp"]).double()
    return scale.double() * 2.0 ** (binade - fmt["mantissa_bits"] - 1)


def relative_bound(x: torch.Tensor, scale: torch.Tensor, kv_dtype) -> torch.Tensor:
    """The looser form: max(2**-(m+1) |x|, scale * 2**(emin - m - 1))."""
    fmt = FORMATS[kv_dtype]
    floor = scale.double() * 2.0 ** (fmt["min_normal_exp"] - fmt["mantissa_bits"] - 1)
    return torch.maximum(2.0 ** -(fmt["mantissa_bits"] + 1) * x.double().abs(), floor)


def cache_of(kv_dtype, granularity="tensor", dtype=torch.float32, layers=2, seqs="ab", num_pages=48):
    order = list(range(num_pages))[::-1]  # non-contiguous page tables
    cache = PagedKVCache(layers, num_pages, 4, HKV, D, dtype=dtype, page_order=order, kv_dtype=kv_dtype,
                         kv_scale_granularity=granularity)
    for seq in seqs:
        cache.add_sequence(seq)
    return cache


def spread(shape, gen, magnitude=1.0, binades=14):
    """Random values whose magnitudes spread log-uniformly over ``binades`` binades below ``magnitude``."""
    exponent = torch.rand(shape, generator=gen, dtype=torch.float64) * -binades
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * magnitude * 2.0**exponent).float()


def per_head(scale):
    return scale.view(-1, 1)


# -- construction


def test_unquantized_cache_keeps_its_dtype_and_has_no_scales():
    for kv_dtype in (None, torch.bfloat16):
        cache = PagedKVCache(1, 4, 4, HKV, D, dtype=torch.bfloat16, kv_dtype=kv_dtype)
        assert cache.dtype == cache.kv_dtype == cache.k_cache(0).dtype == torch.bfloat16
        assert cache.kv_scales(0) is None
        with pytest.raises(TypeError, match=r"^set_kv_scales needs an FP8 cache: this one stores torch.bfloat16"):
            cache.set_kv_scales(0, 1.0, 1.0)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_fp8_cache_stores_bytes_and_computes_in_dtype(kv_dtype):
    cache = cache_of(kv_dtype, dtype=torch.bfloat16)
    assert cache.dtype == torch.bfloat16 and cache.kv_dtype == kv_dtype
    assert cache.k_cache(1).dtype == cache.v_cache(1).dtype == kv_dtype
    assert cache.k_pages.element_size() == 1
    assert f"kv_dtype={kv_dtype}" in repr(cache)
    assert cache.kv_scales(0) is None


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8, "float8_e4m3fn", torch.float8_e4m3fnuz])
def test_other_kv_dtypes_are_refused(kv_dtype):
    with pytest.raises(TypeError, match=r"^kv_dtype must be one of None, torch.float32, torch.float8_e4m3fn, "
                                        r"torch.float8_e5m2, got"):
        PagedKVCache(1, 4, 4, HKV, D, dtype=torch.float32, kv_dtype=kv_dtype)


def test_an_unknown_granularity_is_refused():
    with pytest.raises(ValueError, match=r"^kv_scale_granularity must be one of \('tensor', 'head'\), got 'channel'"):
        PagedKVCache(1, 4, 4, HKV, D, kv_dtype=E4M3, kv_scale_granularity="channel")


# -- the per-element bound


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_round_trip_error_within_the_bound(kv_dtype, granularity):
    """Calibrated scales, fresh values over several magnitudes (per head: heads 1e4 apart); the
    bound holds everywhere and is reached (nearly) somewhere, in the normal and subnormal range."""
    gen = torch.Generator().manual_seed(11)
    for layer, magnitude in enumerate((1e-3, 1.0, 3e3)):
        cache = cache_of(kv_dtype, granularity, layers=1, num_pages=130)
        plan = cache.plan(["a", "b"], [300, 212])
        head_magnitude = torch.tensor([magnitude, magnitude * 1e-4] if granularity == "head" else [magnitude] * HKV)
        fmt = FORMATS[kv_dtype]
        binades = math.log2(fmt["max"]) - fmt["min_normal_exp"] + 4  # the normal range, subnormals and below
        k = spread((512, HKV, D), gen, binades=binades) * head_magnitude.view(-1, 1).float()
        v = spread((512, HKV, D), gen, binades=binades) * head_magnitude.view(-1, 1).float()
        cache.append(0, k, v)
        k_scale, v_scale = cache.kv_scales(0)
        assert k_scale.shape == v_scale.shape == ((HKV,) if granularity == "head" else (1,))
        k_back, v_back = cache.gather_flat(0)  # one prefill: flat order is packed order
        for x, back, scale in ((k, k_back, k_scale), (v, v_back, v_scale)):
            bound = fp8_error_bound(x, per_head(scale), kv_dtype)
            error = (back.double() - x.double()).abs()
            assert (error <= bound * SLACK).all(), (error / bound).max()
            assert (error / bound).max() > 0.99  # the bound is tight: round to nearest, not truncation
            assert (error <= relative_bound(x, per_head(scale), kv_dtype) * SLACK).all()
            subnormal = x.double().abs() < per_head(scale).double() * 2.0 ** fmt["min_normal_exp"]
            assert subnormal.any() and (~subnormal).any()
        assert plan.kv_lens_host == (300, 212)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_set_scales_bound_and_exact_storage(kv_dtype):
    """With scales set by hand: the stored bytes are round_to_fp8(x / scale) and the gather returns
    stored * scale exactly (float32 compute dtype)."""
    cache = cache_of(kv_dtype, "head")
    k_scale, v_scale = torch.tensor([0.5, 3.0]), torch.tensor([2.0**-7, 1.25])
    cache.set_kv_scales(1, k_scale, v_scale)
    plan = cache.plan(["a", "b"], [9, 7])
    gen = torch.Generator().manual_seed(5)
    k, v = spread((16, HKV, D), gen, 50.0), spread((16, HKV, D), gen, 0.5)
    cache.append(1, k, v)
    limit = FORMATS[kv_dtype]["max"]
    for x, scale, pages, back in ((k, k_scale, cache.k_cache(1), cache.gather_flat(1)[0]),
                                  (v, v_scale, cache.v_cache(1), cache.gather_flat(1)[1])):
        stored = pages.reshape(-1, HKV, D)[plan.write_index]
        assert stored.dtype == kv_dtype
        want = (x.double() / per_head(scale).double()).clamp(-limit, limit).to(kv_dtype)
        assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(back, stored.double().mul(per_head(scale).double()).float())
        assert (
            (back.double() - x.double()).abs() <= fp8_error_bound(x, per_head(scale), kv_dtype) * SLACK
        ).all()


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_overflow_saturates_and_nan_stays_nan(kv_dtype):
    cache = cache_of(kv_dtype)
    cache.set_kv_scales(0, 2.0, 0.5)
    cache.plan(["a"], [1])
    specials = torch.tensor([1e30, -1e30, math.inf, -math.inf, math.nan, 0.0, -0.0, 3.0])
    k = specials.repeat(HKV * D // 8).view(1, HKV, D)
    cache.append(0, k, k)
    k_back, v_back = cache.gather_flat(0)
    limit = FORMATS[kv_dtype]["max"]
    for back, scale in ((k_back, 2.0), (v_back, 0.5)):
        row = back[0, 0, :8]
        assert row[:4].tolist() == [limit * scale, -limit * scale, limit * scale, -limit * scale]
        assert math.isnan(row[4]) and not torch.isinf(back).any()
        assert row[5:].tolist() == [0.0, -0.0, 3.0]


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_bf16_gather_is_the_dequantized_value_rounded_to_bf16(kv_dtype):
    cache = cache_of(kv_dtype, "head", dtype=torch.bfloat16)
    plan = cache.plan(["a", "b"], [6, 3])
    k, v = (torch.randn(9, HKV, D).bfloat16() for _ in range(2))
    cache.append(0, k, v)
    k_scale, v_scale = cache.kv_scales(0)
    for pages, scale, back in ((cache.k_cache(0), k_scale, cache.gather_flat(0)[0]),
                               (cache.v_cache(0), v_scale, cache.gather_flat(0)[1])):
        stored = pages.reshape(-1, HKV, D)[plan.flat_index]
        assert back.dtype == torch.bfloat16
        assert torch.equal(back, (stored.float() * per_head(scale)).bfloat16())
    padded_k, padded_v, valid = cache.gather_padded(0)
    assert torch.equal(padded_k[0, :6], cache.gather_flat(0)[0][:6])
    assert torch.equal(padded_v[1, :3], cache.gather_flat(0)[1][6:])
    assert valid.tolist() == [[True] * 6, [True] * 3 + [False] * 3]


# -- calibration


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_first_append_calibrates_later_ones_keep_the_scales(kv_dtype, granularity):
    cache = cache_of(kv_dtype, granularity)
    cache.plan(["a", "b"], [5, 4])
    k = torch.randn(9, HKV, D) * torch.tensor([1.0, 40.0]).view(-1, 1)
    k[3, 1, 7] = math.nan  # non-finite values do not take part
    k[4, 0, 2] = -math.inf
    v = torch.randn(9, HKV, D) * 1e-3
    cache.append(0, k, v)
    finite = k.nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()
    dims = (0, 2) if granularity == "head" else (0, 1, 2)
    limit = FORMATS[kv_dtype]["max"]
    k_scale, v_scale = (s.clone() for s in cache.kv_scales(0))
    torch.testing.assert_close(k_scale, (finite.amax(dim=dims) / limit).reshape(k_scale.shape), rtol=1e-6, atol=0)
    torch.testing.assert_close(v_scale, (v.abs().amax(dim=dims) / limit).reshape(v_scale.shape), rtol=1e-6, atol=0)
    assert k_scale.dtype == torch.float32 and k_scale.device == cache.device
    assert cache.kv_scales(1) is None  # layer 1 has not been written
    cache.append(1, k, v)  # every layer writes the step before the next plan
    cache.plan(["a", "b"], [1, 1])
    cache.append(0, torch.randn(2, HKV, D) * 1e3, torch.randn(2, HKV, D))
    assert torch.equal(cache.kv_scales(0)[0], k_scale) and torch.equal(cache.kv_scales(0)[1], v_scale)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_an_all_zero_first_append_gives_the_unit_scale(kv_dtype):
    cache = cache_of(kv_dtype, "head", layers=1)
    cache.plan(["a"], [4])
    zeros = torch.zeros(4, HKV, D)
    cache.append(0, zeros, zeros)
    limit = FORMATS[kv_dtype]["max"]
    for scale in cache.kv_scales(0):
        assert torch.equal(scale, torch.full((HKV,), 1 / limit))
    assert torch.equal(cache.gather_flat(0)[0], zeros)
    cache.plan(["a"], [2])
    k = torch.rand(2, HKV, D) * 2 - 1
    cache.append(0, k, k)
    back = cache.gather_flat(0)[0][4:]
    assert ((back.double() - k.double()).abs() <= fp8_error_bound(k, torch.tensor(1 / limit), kv_dtype) * SLACK).all()


def test_tiny_values_calibrate_to_a_normal_float32_scale():
    cache = cache_of(E4M3)
    cache.plan(["a"], [1])
    k = torch.full((1, HKV, D), 1e-44)  # a float32 subnormal: amax / 448 would be 0
    cache.append(0, k, k)
    scale = cache.kv_scales(0)[0]
    assert scale.item() == torch.finfo(torch.float32).tiny
    assert torch.isfinite(cache.gather_flat(0)[0]).all()


def test_a_rejected_append_calibrates_nothing():
    cache = cache_of(E4M3)
    cache.plan(["a"], [2])
    with pytest.raises(TypeError, match=r"^k has dtype torch.float64"):
        cache.append(0, torch.randn(2, HKV, D).double(), torch.randn(2, HKV, D))
    assert cache.kv_scales(0) is None
    cache.set_kv_scales(0, 1.0, 1.0)  # still free to set


# -- set_kv_scales


BAD_SCALES = {
    "zero": (dict(k_scale=0.0), ValueError, r"^k_scale must be finite and > 0 \(in float32\), got \[0.0, 0.0\]"),
    "negative v": (dict(v_scale=-1.0), ValueError, r"^v_scale must be finite and > 0"),
    "inf": (dict(k_scale=math.inf), ValueError, r"^k_scale must be finite and > 0"),
    "nan tensor": (dict(v_scale=torch.tensor([1.0, math.nan])), ValueError, r"^v_scale must be finite and > 0"),
    "float32 overflow": (dict(k_scale=torch.tensor([1e300, 1.0], dtype=torch.float64)), ValueError, r"^k_scale must be"),
    "one head bad": (dict(k_scale=torch.tensor([1.0, 0.0])), ValueError, r"^k_scale must be finite and > 0"),
    "shape": (dict(v_scale=torch.ones(3)), ValueError, r"^v_scale has shape \(3,\): expected \(2,\)"),
    "int tensor": (dict(k_scale=torch.ones(2, dtype=torch.int32)), TypeError, r"^k_scale must be a floating tensor"),
    "bool": (dict(v_scale=True), TypeError, r"^v_scale must be a float or a torch.Tensor, got bool"),
    "string": (dict(k_scale="1.0"), TypeError, r"^k_scale must be a float or a torch.Tensor, got str"),
    "device": (dict(v_scale=torch.ones(2, device="meta")), ValueError, r"^v_scale is on meta but the kv_cache is on cpu"),
    "layer": (dict(layer_id=2), ValueError, r"^layer_id 2 is out of range"),
}


@pytest.mark.parametrize("override, error, match", BAD_SCALES.values(), ids=BAD_SCALES.keys())
def test_bad_scales_raise_naming_the_argument_and_change_nothing(override, error, match):
    cache = cache_of(E4M3, "head")
    cache.set_kv_scales(0, torch.tensor([1.0, 2.0]), 3.0)
    args = dict(layer_id=0, k_scale=torch.tensor([5.0, 6.0]), v_scale=torch.tensor([7.0, 8.0]))
    args.update(override)
    with pytest.raises(error, match=match):
        cache.set_kv_scales(**args)
    k_scale, v_scale = cache.kv_scales(0)
    assert k_scale.tolist() == [1.0, 2.0] and v_scale.tolist() == [3.0, 3.0]
    assert cache.kv_scales(1) is None


def test_scale_forms_accepted_per_tensor():
    cache = cache_of(E5M2)
    cache.set_kv_scales(0, 0.25, torch.tensor(4.0, dtype=torch.float64))
    cache.set_kv_scales(1, torch.tensor([0.5]), 2)
    assert [s.tolist() for s in cache.kv_scales(0)] == [[0.25], [4.0]]
    assert [s.tolist() for s in cache.kv_scales(1)] == [[0.5], [2.0]]
    with pytest.raises(ValueError, match=r"^k_scale has shape \(2,\): expected \(1,\)"):
        cache.set_kv_scales(0, torch.ones(2), 1.0)


def test_scales_are_fixed_while_the_layer_holds_tokens():
    cache = cache_of(E4M3)
    cache.plan(["a", "b"], [2, 1])
    cache.append(0, torch.randn(3, HKV, D), torch.randn(3, HKV, D))
    written = [s.clone() for s in cache.kv_scales(0)]
    with pytest.raises(RuntimeError, match=r"^layer 0 already stores values quantized with its scales"):
        cache.set_kv_scales(0, 1.0, 1.0)
    assert [s.tolist() for s in cache.kv_scales(0)] == [s.tolist() for s in written]
    cache.set_kv_scales(1, 1.0, 1.0)  # layer 1 holds nothing yet
    cache.append(1, torch.randn(3, HKV, D), torch.randn(3, HKV, D))  # the step complete
    cache.release("a")
    with pytest.raises(RuntimeError, match="already stores"):
        cache.set_kv_scales(0, 1.0, 1.0)  # "b" still holds a token
    cache.release("b")
    cache.set_kv_scales(0, 0.5, 0.5)
    assert [s.tolist() for s in cache.kv_scales(0)] == [[0.5], [0.5]]


# -- attention over an FP8 cache


def attention_error_bound(q, k, v, k_bound, v_bound, keep):
    """float64 ``[Lq, Hq, D]`` bound on |attention(q, k^, v^) - attention(q, k, v)| for one request,
    given elementwise bounds |k^ - k| <= k_bound, |v^ - v| <= v_bound (docs/kv_cache_fp8.md):
    max_j v_bound + (exp(2 Delta) - 1) max_j |v|, Delta = max_j sum_i |q_i| k_bound_ji / sqrt(D),
    maxima over the keys a row keeps."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        kb, vb, vh = k_bound[:, h // group], v_bound[:, h // group], v[:, h // group].double().abs()
        shift = (q[:, h].double().abs() @ kb.T) / math.sqrt(q.shape[-1])  # [Lq, Lkv]
        for row in range(q.shape[0]):
            kept = keep[row]
            delta = shift[row, kept].max()
            out[row, h] = vb[kept].amax(0) + torch.expm1(2 * delta) * vh[kept].amax(0)
    return out


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_attention_over_fp8_cache(kv_dtype, granularity):
    """Prefill, decode and a chunk through the torch backend: equal to float64 attention over the
    dequantized values to float32 tolerance, and to attention over the unquantized values
    within the derived bound."""
    cache = cache_of(kv_dtype, granularity, seqs="abc")
    gen = torch.Generator().manual_seed(21)
    written = {(layer, s): [] for layer in range(2) for s in "abc"}
    for q_lens in ([7, 3, 12], [1, 1, 1], [4, 1, 2]):
        plan = cache.plan(list("abc"), q_lens)
        for layer in range(2):
            q = torch.randn(plan.total_q, HQ, D, generator=gen)
            k = torch.randn(plan.total_q, HKV, D, generator=gen) * torch.tensor([1.0, 5.0]).view(-1, 1)
            v = torch.randn(plan.total_q, HKV, D, generator=gen)
            with attn_backend(ATTN_BACKEND.TORCH_NATIVE):
                out = attention(q[None], k[None], v[None], kv_cache=cache, layer_id=layer, is_causal=True)[0]
            k_scale, v_scale = cache.kv_scales(layer)
            stored_k = cache.k_cache(layer).reshape(-1, HKV, D)
            stored_v = cache.v_cache(layer).reshape(-1, HKV, D)
            slots = plan.flat_index.split(list(plan.kv_lens_host))
            for b, s in enumerate("abc"):
                rows = slice(int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1]))
                written[layer, s].append((k[rows], v[rows]))
                k_all = torch.cat([kv[0] for kv in written[layer, s]])
                v_all = torch.cat([kv[1] for kv in written[layer, s]])
                k_deq = stored_k[slots[b]].double() * per_head(k_scale).double()
                v_deq = stored_v[slots[b]].double() * per_head(v_scale).double()
                want = attention_ref(q[rows][None], k_deq[None], v_deq[None], is_causal=True)[0]
                torch.testing.assert_close(out[rows].double(), want, **tolerance(torch.float32))
                exact = attention_ref(q[rows][None], k_all[None], v_all[None], is_causal=True)[0]
                lq, lkv = rows.stop - rows.start, k_all.shape[0]
                keep = torch.arange(lkv)[None, :] <= torch.arange(lq)[:, None] + (lkv - lq)
                k_bound = fp8_error_bound(k_all, per_head(k_scale), kv_dtype)
                v_bound = fp8_error_bound(v_all, per_head(v_scale), kv_dtype)
                bound = attention_error_bound(q[rows], k_all, v_all, k_bound, v_bound, keep)
                assert ((out[rows].double() - exact).abs() <= bound * SLACK + 2e-5).all()


# -- the fused rope + append route


def test_rope_with_an_fp8_cache_takes_the_torch_path(monkeypatch):
    """With the fused kernel usable but stating no FP8 pages (no ``kv_dtypes``), an FP8 cache
    rotates in torch and appends (quantizing): the kernel is never called."""
    calls = []
    monkeypatch.setattr(rope_paged.ops_rope_paged, "rope_paged_append_unchecked", lambda *a: calls.append(a))
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    ops = {"rope_paged_append": {"module": "fake_rotary_module", "abi": 1, "dtypes": ["float32"]}}
    runtime = Runtime(Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=ops))), importer=fake_module))
    with_kernel, torch_only = cache_of(E4M3, "head"), cache_of(E4M3, "head")
    freqs = rope_tables(64, 32)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 5, HQ, D, generator=gen)
    k, v = torch.randn(1, 5, HKV, D, generator=gen), torch.randn(1, 5, HKV, D, generator=gen)
    no_plugins = Runtime(Registry(entry_points()))
    outs = []
    for cache, context in ((with_kernel, use_runtime(runtime)), (torch_only, use_runtime(no_plugins))):
        cache.plan(["a", "b"], [3, 2])
        with context, torch.no_grad():
            outs.append(attention(q, k, v, kv_cache=cache, layer_id=0, rope=freqs))
    assert calls == []
    assert torch.equal(outs[0], outs[1])
    for one, two in zip(with_kernel.gather_flat(0), torch_only.gather_flat(0)):
        assert torch.equal(one, two)
    assert torch.equal(with_kernel.kv_scales(0)[0], torch_only.kv_scales(0)[0])


def test_rope_with_an_fp8_cache_takes_the_kernel_once_the_scales_are_known(monkeypatch):
    """A plugin that states FP8 pages gets the step once the layer's scales exist: the layer's
    first append rotates in torch and calibrates (on the rotated keys), the next steps call the
    fused kernel with the layer's scales."""
    calls = []

    def stand_in(q, k, v, k_cache, v_cache, cos, sin, positions, slots, interleaved, k_scale=None, v_scale=None):
        calls.append((k_scale, v_scale))
        return q.clone()

    monkeypatch.setattr(rope_paged.ops_rope_paged, "rope_paged_append_unchecked", stand_in)
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    ops = {"rope_paged_append": {"module": "fake_rotary_module", "abi": 1, "dtypes": ["float32"],
                                 "kv_dtypes": ["float8_e4m3fn"]}}
    runtime = Runtime(Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=ops))), importer=fake_module))
    freqs = rope_tables(64, 32)
    gen = torch.Generator().manual_seed(4)
    for kv_dtype, fused in ((E4M3, True), (E5M2, False)):  # the manifest states e4m3 pages only
        calls.clear()
        cache = cache_of(kv_dtype, "head", layers=1)
        with use_runtime(runtime), torch.no_grad():
            for q_lens in ([3, 2], [1, 1]):
                cache.plan(["a", "b"], q_lens)
                n = sum(q_lens)
                q, k, v = (torch.randn(1, n, h, D, generator=gen) for h in (HQ, HKV, HKV))
                attention(q, k, v, kv_cache=cache, layer_id=0, rope=freqs)
        scales = cache.kv_scales(0)
        assert len(calls) == (1 if fused else 0), kv_dtype
        if fused:
            assert calls[0][0] is scales[0] and calls[0][1] is scales[1]
