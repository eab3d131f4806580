"""Attention variants (window, soft-cap, sinks, scale, ALiBi) through ``attention()`` on the CPU:
the torch path against the float64 loop reference, dense, masked and paged (ragged, chunked
prefill, decode); bad values rejected before anything changes; a backend lacking a feature
rejected with the reason."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, manifest
from reference import attention_ref

from astrai.extension import attention, explain
from astrai.extension.backend.attention import cuda as cuda_backend
from astrai.extension.backend.attention.base import AttentionCall
from astrai.extension.backend.attention.flash import FlashAttnBackend
from astrai.extension.kv_cache import PagedKVCache
from astrai.extension.registry import Registry
from astrai.extension.runtime import Runtime, use_runtime

TOL = dict(atol=1e-10, rtol=1e-10)  # float64 inputs: the torch path computes in float64


def qkv(b, lq, lkv, hq, hkv, d, seed, dtype=torch.float64, spread=3.0):
    """Large scores (``spread``) so soft-cap and sinks change the result visibly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, hq, d, generator=g, dtype=torch.float64) * spread
    k = torch.randn(b, lkv, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, lkv, hkv, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sinks_for(hq, seed):
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 2


VARIANTS = [  # (window_left, logits_soft_cap, sinks?, scale)
    (-1, None, False, None), (0, None, False, None), (3, None, False, None), (100, None, False, None),
    (-1, 5.0, False, None), (-1, None, True, None), (-1, None, False, 0.05),
    (4, 2.5, True, 0.2), (0, 30.0, True, None),
]
SHAPES = [  # (b, lq, lkv, hq, hkv, d)
    (2, 1, 37, 8, 2, 64), (1, 9, 9, 4, 4, 128), (2, 5, 23, 32, 1, 64), (1, 12, 40, 6, 2, 256),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("alibi", [False, True])
def test_dense_variants_match_the_reference(shape, variant, causal, alibi):
    b, lq, lkv, hq, hkv, d = shape
    window, cap, with_sinks, scale = variant
    q, k, v = qkv(b, lq, lkv, hq, hkv, d, seed=hash((shape, variant, causal)) % 1000)
    sinks = sinks_for(hq, 1) if with_sinks else None
    kw = dict(window_left=window, logits_soft_cap=cap, sinks=sinks, scale=scale,
              alibi_slopes=slopes_for(hq, 2) if alibi else None)
    out = attention(q, k, v, is_causal=causal, **kw)
    torch.testing.assert_close(out, attention_ref(q, k, v, is_causal=causal, **kw), **TOL)


@pytest.mark.parametrize("mask_dim", [2, 3])
def test_masks_and_every_feature_together(mask_dim):
    b, lq, lkv, hq, hkv, d = 2, 6, 19, 8, 2, 64
    q, k, v = qkv(b, lq, lkv, hq, hkv, d, seed=7)
    g = torch.Generator().manual_seed(3)
    shape = (b, lkv) if mask_dim == 2 else (b, lq, lkv)
    mask = torch.rand(shape, generator=g) > 0.3
    kw = dict(window_left=5, logits_soft_cap=4.0, sinks=sinks_for(hq, 2), scale=0.1)
    out = attention(q, k, v, mask=mask, is_causal=True, **kw)
    torch.testing.assert_close(out, attention_ref(q, k, v, mask, True, **kw), **TOL)


def test_float32_inputs_and_rows_without_keys():
    """float32 within float32 rounding; a window of 0 over a non-causal decode row keeps only
    the last key, a row the mask empties returns zeros (also with sinks)."""
    q, k, v = qkv(1, 4, 10, 4, 2, 64, seed=11, dtype=torch.float32)
    mask = torch.ones(1, 4, 10, dtype=torch.bool)
    mask[0, 1] = False
    kw = dict(window_left=2, logits_soft_cap=6.0, sinks=sinks_for(4, 3))
    out = attention(q, k, v, mask=mask, is_causal=True, **kw)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, mask, True, **kw), atol=2e-5, rtol=2e-5)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))


def test_soft_cap_and_sinks_change_the_result():
    """The features are not ignored: each moves the output well beyond rounding."""
    q, k, v = qkv(1, 8, 8, 4, 4, 64, seed=5)
    plain = attention(q, k, v, is_causal=True)
    for kw in (dict(logits_soft_cap=2.0), dict(sinks=torch.full((4,), 3.0)), dict(scale=0.5), dict(window_left=1)):
        assert (attention(q, k, v, is_causal=True, **kw) - plain).abs().max() > 1e-2, kw


def test_gradients_flow_through_the_explicit_path():
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, 6, 4, 2, 16, seed=9, spread=1.0))
    kw = dict(window_left=3, logits_soft_cap=3.0, sinks=sinks_for(4, 4).double().float())
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, is_causal=True, **kw), (q, k, v))


# ---- paged ------------------------------------------------------------------------------

def _paged_case(kv_heads, hq, d, page, steps, variant, seed, **extra):
    """Runs ``steps`` (a list of per-request q lengths) through a cache, one attention call per
    step; checks every step's output against the reference over each request's whole sequence."""
    window, cap, with_sinks, scale = variant
    sinks = sinks_for(hq, seed) if with_sinks else None
    kw = dict(window_left=window, logits_soft_cap=cap, sinks=sinks, scale=scale, **extra)
    n = len(steps[0])
    total = [sum(s[i] for s in steps) for i in range(n)]
    pages = sum(-(-t // page) for t in total) + 2
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).tolist()
    cache = PagedKVCache(1, pages, page, kv_heads, d, dtype=torch.float64, page_order=order)
    seqs = [qkv(1, t, t, hq, kv_heads, d, seed=seed + i) for i, t in enumerate(total)]
    done = [0] * n
    ids = list(range(n))
    for i in ids:
        cache.add_sequence(i)
    for q_lens in steps:
        cache.plan(ids, q_lens)
        part = [(s[0][:, a:a + m], s[1][:, a:a + m], s[2][:, a:a + m]) for s, a, m in zip(seqs, done, q_lens)]
        if len(set(q_lens)) == 1:
            q, k, v = (torch.cat([p[j] for p in part]) for j in range(3))
        else:  # ragged: packed [1, total_q, ...]
            q, k, v = (torch.cat([p[j] for p in part], dim=1) for j in range(3))
        out = attention(q, k, v, kv_cache=cache, layer_id=0, **kw)
        rows = out if len(set(q_lens)) == 1 else out.split(q_lens, dim=1)
        for i, (s, a, m) in enumerate(zip(seqs, done, q_lens)):
            got = rows[i:i + 1] if len(set(q_lens)) == 1 else rows[i]
            want = attention_ref(s[0][:, a:a + m], s[1][:, :a + m], s[2][:, :a + m], is_causal=True, **kw)
            torch.testing.assert_close(got, want, **TOL)
        done = [a + m for a, m in zip(done, q_lens)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_ragged_chunked_and_decode(variant):
    """A ragged prefill, a chunked second prefill, then two decode steps, pages shuffled."""
    _paged_case(2, 8, 64, 4, [[5, 9, 1], [7, 2, 3], [1, 1, 1], [1, 1, 1]], variant, seed=20)


@pytest.mark.parametrize("kv_heads, hq, d, page", [(1, 32, 64, 16), (4, 4, 128, 1), (2, 10, 256, 3)])
def test_paged_group_sizes_and_head_dims(kv_heads, hq, d, page):
    _paged_case(kv_heads, hq, d, page, [[6, 3], [4, 4], [1, 1]], (2, 3.0, True, 0.08), seed=30)


# ---- bad values -------------------------------------------------------------------------

BAD = [
    (dict(window_left=-2), ValueError, "window_left"),
    (dict(window_left=1.5), TypeError, "window_left"),
    (dict(window_left=True), TypeError, "window_left"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=math.inf), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=math.nan), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="5"), TypeError, "logits_soft_cap"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(scale=math.nan), ValueError, "scale"),
    (dict(scale=-0.1), ValueError, "scale"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(8, dtype=torch.float64)), TypeError, "sinks"),
    (dict(sinks=torch.zeros(8, device="meta")), ValueError, "sinks"),
    (dict(sinks=[0.0] * 8), TypeError, "sinks"),
    (dict(alibi_slopes=torch.zeros(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.zeros(8, device="meta")), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=0.5), TypeError, "alibi_slopes"),
]


@pytest.mark.parametrize("kw, error, name", BAD)
def test_bad_values_name_the_argument(kw, error, name):
    q, k, v = qkv(1, 3, 5, 8, 2, 64, seed=1)
    with pytest.raises(error, match=name):
        attention(q, k, v, **kw)


@pytest.mark.parametrize("kw, error, name", BAD[:4] + BAD[11:12])
def test_a_rejected_call_leaves_the_cache_unchanged(kw, error, name):
    cache = PagedKVCache(1, 8, 4, 2, 64, dtype=torch.float64)
    cache.add_sequence("s")
    cache.plan(["s"], [3])
    before = cache.k_cache(0).clone(), cache.v_cache(0).clone()
    q, k, v = qkv(1, 3, 3, 8, 2, 64, seed=2)
    with pytest.raises(error, match=name):
        attention(q, k, v, kv_cache=cache, layer_id=0, **kw)
    assert torch.equal(cache.k_cache(0), before[0]) and torch.equal(cache.v_cache(0), before[1])


# ---- backends that lack a feature -------------------------------------------------------

def _cuda_call(features, mode="decode"):
    return AttentionCall(torch.device("cuda", 0), torch.bfloat16, 128, 32, 8, mode, None, True, 0, True, 16, False,
                         features=features)


def _plugin_with(variants):
    spec = {"abi": 1, "dtypes": ["bfloat16"], "head_dims": [128], "min_sm": 80}
    if variants is not None:
        spec["variants"] = variants
    ops = {op: {"module": f"fake_{op}", **spec}
           for op in ("attn_decode", "attn_prefill", "attn_paged_decode", "attn_paged_prefill")}
    return FakeEntryPoint("attention", manifest(name="astrai-attention", ops=ops), dist="astrai-attention")


@pytest.mark.parametrize("stated, features, reason", [
    (None, ("logits_soft_cap",), "attn_paged_decode lacks logits_soft_cap in this build (it takes no variant)"),
    (["window_left", "scale"], ("window_left", "sinks"),
     "attn_paged_decode lacks sinks in this build (it takes window_left, scale)"),
    (["window_left", "logits_soft_cap", "sinks", "scale"], ("window_left", "logits_soft_cap", "sinks", "scale"), None),
    (["window_left", "logits_soft_cap", "sinks", "alibi_slopes", "scale"], ("alibi_slopes", "logits_soft_cap"), None),
])
def test_cuda_backend_takes_only_the_variants_its_manifest_states(monkeypatch, stated, features, reason):
    monkeypatch.setattr(cuda_backend, "probe_device", lambda device=None: H200)
    with use_runtime(Runtime(Registry(entry_points(_plugin_with(stated))))):
        assert cuda_backend.CudaBackend().check(_cuda_call(features)) == reason


@pytest.mark.parametrize("mode, stated, reason", [
    ("decode", ["float8_e4m3fn", "float8_e5m2"], None),
    ("decode", None, "attn_paged_decode reads bfloat16 pages in this build, not float8_e4m3fn"),
    ("prefill", ["float8_e4m3fn", "float8_e5m2"], None),
    ("prefill", None, "attn_paged_prefill reads bfloat16 pages in this build, not float8_e4m3fn"),
])
def test_cuda_backend_reads_fp8_pages_only_where_its_manifest_states_them(monkeypatch, mode, stated, reason):
    """An FP8 cache goes to the op whose manifest lists its page dtype (``kv_dtypes``), else to torch."""
    monkeypatch.setattr(cuda_backend, "probe_device", lambda device=None: H200)
    plugin = _plugin_with(None)
    if stated is not None:
        raw = plugin.load()
        raw["ops"][f"attn_paged_{mode}"]["kv_dtypes"] = stated
    call = _cuda_call((), mode)._replace(kv_dtype=torch.float8_e4m3fn)
    with use_runtime(Runtime(Registry(entry_points(plugin)))):
        assert cuda_backend.CudaBackend().check(call) == reason


def test_flash_rejects_sinks_and_a_soft_cap_it_cannot_take():
    def varlen_without_softcap(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size=(-1, -1)):
        raise AssertionError("not called")

    module = type("flash_attn", (), {"flash_attn_varlen_func": staticmethod(varlen_without_softcap)})
    backend = FlashAttnBackend(module)
    assert backend.check(_cuda_call(("window_left", "scale"), "prefill")) is None
    assert "lacks sinks" in backend.check(_cuda_call(("sinks",), "prefill"))
    assert "lacks logits_soft_cap" in backend.check(_cuda_call(("logits_soft_cap",), "prefill"))


def test_explain_names_the_features_of_the_call():
    q, k, v = qkv(1, 4, 4, 4, 4, 64, seed=3, dtype=torch.float32)
    attention(q, k, v, is_causal=True, logits_soft_cap=9.0, sinks=torch.zeros(4))
    text = "\n".join(str(decision) for decision in explain("attention"))
    assert "logits_soft_cap" in text and "sinks" in text


def test_every_combination_runs_on_the_torch_path():
    q, k, v = qkv(1, 3, 6, 4, 2, 64, seed=4)
    for window, cap, sinks, scale in itertools.product((-1, 1), (None, 3.0), (None, torch.ones(4)), (None, 0.3)):
        kw = dict(window_left=window, logits_soft_cap=cap, sinks=sinks, scale=scale)
        torch.testing.assert_close(attention(q, k, v, is_causal=True, **kw),
                                   attention_ref(q, k, v, is_causal=True, **kw), **TOL)


# ---- layout="bhld" (SDPA's) -----------------------------------------------------------

def test_bhld_layout_matches_sdpa():
    q, k, v = (t.transpose(1, 2) for t in qkv(2, 9, 9, 8, 2, 64, seed=40))  # [B, H, L, D] views (SDPA: top-left causal)
    out = attention(q, k, v, is_causal=True, layout="bhld")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want, **TOL)
    kw = dict(window_left=2, logits_soft_cap=4.0, sinks=sinks_for(8, 5))
    got = attention(q, k, v, is_causal=True, layout="bhld", **kw)
    ref = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, **kw)
    torch.testing.assert_close(got.transpose(1, 2), ref, **TOL)


def test_layout_errors_say_which_layout_was_assumed():
    q, k, v = qkv(1, 6, 6, 8, 2, 64, seed=41)  # BLHD tensors passed as BHLD: 6 "heads" of q, 6 of k
    k = k[:, :4]
    with pytest.raises(ValueError, match="layout='bhld'"):
        attention(q, k, k, layout="bhld")
    with pytest.raises(ValueError, match="layout must be 'blhd'"):
        attention(q, q, q, layout="BSHD")


# ---- ALiBi ---------------------------------------------------------------------------------

ALIBI = [  # (window_left, logits_soft_cap, sinks?, scale) beside the slopes
    (-1, None, False, None), (3, None, False, None), (-1, 5.0, True, 0.2), (100, None, True, None),
]


def slopes_for(hq, seed):
    return torch.rand(hq, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) + 0.05


@pytest.mark.parametrize("mask_dim", [2, 3])
def test_alibi_under_a_mask_in_float32(mask_dim):
    """float32: the bias is taken against each query's own position, so a long context keeps its
    kept scores small and the result within float32 rounding."""
    b, lq, lkv, hq, hkv, d = 2, 5, 3000, 4, 2, 64
    q, k, v = qkv(b, lq, lkv, hq, hkv, d, seed=21, dtype=torch.float32, spread=1.0)
    shape = (b, lkv) if mask_dim == 2 else (b, lq, lkv)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(4)) > 0.2
    kw = dict(alibi_slopes=torch.full((hq,), 0.5))
    out = attention(q, k, v, mask=mask, is_causal=True, **kw)
    torch.testing.assert_close(out.double(), attention_ref(q, k, v, mask, True, **kw), atol=2e-5, rtol=2e-5)


def test_alibi_changes_the_result_and_zero_slopes_do_not():
    q, k, v = qkv(1, 8, 8, 4, 4, 64, seed=5, spread=1.0)
    plain = attention(q, k, v, is_causal=True)
    assert (attention(q, k, v, is_causal=True, alibi_slopes=torch.full((4,), 0.5)) - plain).abs().max() > 1e-2
    torch.testing.assert_close(attention(q, k, v, is_causal=True, alibi_slopes=torch.zeros(4)), plain, **TOL)


def test_alibi_is_blooms_bias():
    """transformers' BLOOM bias (``build_alibi_tensor``: slope times the key's position, added to
    the scaled scores) and ``alibi_slopes(n)``, through ``attention()``: the same output."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    from astrai.extension.backend.attention.variant import alibi_slopes

    b, l, h, d = 2, 7, 12, 32
    q, k, v = qkv(b, l, l, h, h, d, seed=6, spread=1.0)
    alibi = bloom.build_alibi_tensor(torch.ones(b, l), h, torch.float64)  # [B * H, 1, L]
    qh, kh, vh = (t.transpose(1, 2).reshape(b * h, l, d) for t in (q, k, v))
    scores = torch.baddbmm(alibi, qh, kh.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(d))
    scores = scores.masked_fill(torch.ones(l, l, dtype=torch.bool).triu(1), float("-inf"))
    want = (torch.softmax(scores, dim=-1) @ vh).reshape(b, h, l, d).transpose(1, 2)
    torch.testing.assert_close(alibi_slopes(h).double(), alibi[:h, 0, 1], atol=1e-7, rtol=1e-7)
    torch.testing.assert_close(attention(q, k, v, is_causal=True, alibi_slopes=alibi_slopes(h)), want,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ALIBI)
def test_alibi_paged_ragged_chunked_and_decode(variant):
    _paged_case(2, 8, 64, 4, [[5, 9, 1], [7, 2, 3], [1, 1, 1], [1, 1, 1]], variant, seed=30,
                alibi_slopes=slopes_for(8, 3))


def test_backends_without_alibi_pass_the_call_over(monkeypatch):
    monkeypatch.setattr(cuda_backend, "probe_device", lambda device=None: H200)
    stated = ["window_left", "logits_soft_cap", "sinks", "scale"]
    with use_runtime(Runtime(Registry(entry_points(_plugin_with(stated))))):
        assert cuda_backend.CudaBackend().check(_cuda_call(("alibi_slopes",))) == \
            "attn_paged_decode lacks alibi_slopes in this build (it takes window_left, logits_soft_cap, sinks, scale)"
    module = type("flash_attn", (), {"flash_attn_varlen_func": staticmethod(lambda *a, **k: None)})
    assert "lacks alibi_slopes" in FlashAttnBackend(module).check(_cuda_call(("alibi_slopes",), "prefill"))
    q, k, v = qkv(1, 4, 4, 4, 4, 64, seed=3, dtype=torch.float32)
    attention(q, k, v, is_causal=True, alibi_slopes=torch.ones(4))
    assert "alibi_slopes" in "\n".join(str(decision) for decision in explain("attention"))


def test_the_cuda_ops_pass_alibi_as_the_variants_fifth_item():
    """The slopes reach the binding as the variant tuple's fifth item; every other variant keeps the
    four items a plugin built before ALiBi takes."""
    from astrai.extension.backend.attention.variant import check_variant
    from astrai.extension.ops.attention_args import variant_arg, variant_binding, variant_kwargs

    q = torch.zeros(1, 1, 4, 64)
    slopes = torch.ones(4)
    variant = check_variant(q, alibi_slopes=slopes, logits_soft_cap=30.0)
    (scale, cap, window, sinks, alibi), = variant_binding(variant).values()
    assert (scale, cap, window, sinks) == (0.0, 30.0, -1, None)
    assert alibi[0] == slopes.data_ptr() and tuple(alibi[1]) == (4,)
    assert variant_kwargs(variant)["alibi_slopes"] is slopes
    assert variant_arg(**variant_kwargs(variant)) == variant_binding(variant)
    assert len(variant_binding(check_variant(q, window_left=3))["variant"]) == 4
    assert variant_arg(alibi_slopes=slopes)["variant"][:4] == (0.0, 0.0, -1, None)


@pytest.mark.parametrize("n", [1, 3, 8, 12, 40])
def test_alibi_slopes_are_blooms(n):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    from astrai.extension.backend.attention.variant import alibi_slopes

    want = bloom.build_alibi_tensor(torch.ones(1, 2), n, torch.float64)[:, 0, 1]
    torch.testing.assert_close(alibi_slopes(n).double(), want, atol=1e-7, rtol=1e-7)
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)
