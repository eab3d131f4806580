"""The rotary API on the torch path: both layouts against independent float64 references
(transformers' ``apply_rotary_pos_emb``, the complex multiply), positions, partial rotary,
q+k and in place, gradients, ``torch.compile``, bad input, and the kernel dispatch."""

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest
from reference import rotary_ref, rotary_tables, tolerance
from rotary_reference import random_positions, rope_reference, rope_tables

from astrai.extension import apply_rotary_emb, apply_rotary_emb_qk
from astrai.extension.backend import rotary
from astrai.extension.backend.rotary import RotaryCall
from astrai.extension.device import CPU
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.runtime import Runtime, use_runtime

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_POS = 4096


def inputs(b, l, h, d, dtype=torch.float32, seed=0, offset=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, d, generator=g).to(dtype)
    cos, sin = rotary_tables(l, d, offset=offset)
    return x, cos, sin


def case(b, l, h, d, rotary_dim, dtype, positions, seed):
    """x, freqs over MAX_POS positions, positions of the given kind."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, l, h, d, generator=g) * 2).to(dtype)
    return x, rope_tables(MAX_POS, rotary_dim), random_positions(g, positions, b, l, MAX_POS)


# -- against the references -------------------------------------------------------------


@pytest.mark.parametrize("positions", ["none", "1d", "2d"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, rotary_dim", [(128, 128), (64, 64), (80, 32), (128, 64)])
def test_neox_matches_transformers(d, rotary_dim, dtype, positions):
    x, freqs, pos = case(3, 11, 4, d, rotary_dim, dtype, positions, seed=d + rotary_dim)
    out = apply_rotary_emb(x, freqs, interleaved=False, positions=pos)
    assert out.shape == x.shape and out.dtype == dtype
    want = rope_reference(x, *freqs, pos, interleaved=False)
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))
    torch.testing.assert_close(out[..., rotary_dim:], x[..., rotary_dim:], atol=0, rtol=0)


@pytest.mark.parametrize("positions", ["none", "1d", "2d"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, rotary_dim", [(128, 128), (64, 64), (80, 32), (256, 128)])
def test_interleaved_matches_the_complex_multiply(d, rotary_dim, dtype, positions):
    x, freqs, pos = case(2, 9, 3, d, rotary_dim, dtype, positions, seed=3 * d + rotary_dim)
    out = apply_rotary_emb(x, freqs, positions=pos)
    torch.testing.assert_close(out.double(), rope_reference(x, *freqs, pos), **tolerance(dtype))
    torch.testing.assert_close(out[..., rotary_dim:], x[..., rotary_dim:], atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [2, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_original_call_keeps_its_meaning(head_dim, dtype):
    """cos/sin already gathered to [seq, head_dim / 2]: interleaved pairs, row s for token s."""
    x, cos, sin = inputs(2, 13, 3, head_dim, dtype, seed=head_dim, offset=1000)
    out = apply_rotary_emb(x, (cos, sin))
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(dtype))


def test_layouts_differ_and_positions_matter():
    """The tests above could not pass with the layouts or the position rows swapped."""
    x, freqs, pos = case(2, 6, 2, 64, 64, torch.float32, "2d", seed=8)
    neox = apply_rotary_emb(x, freqs, interleaved=False, positions=pos)
    gptj = apply_rotary_emb(x, freqs, interleaved=True, positions=pos)
    assert (neox - gptj).abs().max() > 0.1
    assert (neox - apply_rotary_emb(x, freqs, interleaved=False, positions=pos.flip(0))).abs().max() > 0.1


def test_random_angles_and_strided_input():
    """Arbitrary (not table-shaped) cos/sin, and x given as a permuted [B, H, L, D] view."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 9, 32, generator=g).transpose(1, 2)
    angles = torch.rand(9, 16, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    assert not x.is_contiguous()
    for interleaved in (True, False):
        torch.testing.assert_close(apply_rotary_emb(x, (cos, sin), interleaved=interleaved).double(),
                                   rope_reference(x, cos, sin, interleaved=interleaved), **tolerance(torch.float32))


def test_rotation_preserves_pair_norms():
    x, cos, sin = inputs(1, 6, 2, 16, torch.float64, seed=5)
    out = apply_rotary_emb(x, (cos, sin))
    norms = lambda t: t.view(*t.shape[:-1], -1, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norms(out), norms(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_view_at_an_odd_storage_offset(dtype):
    x, cos, sin = inputs(1, 4, 2, 8, dtype, seed=6)
    shifted = torch.cat([torch.zeros(1, dtype=dtype), x.flatten()])[1:].view(x.shape)
    assert shifted.storage_offset() == 1 and shifted.is_contiguous()
    torch.testing.assert_close(apply_rotary_emb(shifted, (cos, sin)).double(), rotary_ref(x, cos, sin), **tolerance(dtype))


# -- q and k ----------------------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_matches_the_reference(dtype, interleaved, inplace):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 7, 8, 64, generator=g).to(dtype)
    k = torch.randn(2, 7, 2, 64, generator=g).to(dtype)
    freqs, pos = rope_tables(MAX_POS, 48), random_positions(g, "2d", 2, 7, MAX_POS)
    want_q, want_k = (rope_reference(t, *freqs, pos, interleaved) for t in (q, k))
    q_in, k_in = q.clone(), k.clone()
    qo, ko = apply_rotary_emb_qk(q_in, k_in, freqs, positions=pos, interleaved=interleaved, inplace=inplace)
    torch.testing.assert_close(qo.double(), want_q, **tolerance(dtype))
    torch.testing.assert_close(ko.double(), want_k, **tolerance(dtype))
    if inplace:
        assert qo is q_in and ko is k_in
    else:
        assert torch.equal(q_in, q) and torch.equal(k_in, k)


def test_qk_of_token_major_tensors():
    """q [tokens, Hq, D], k [tokens, Hk, D] with positions [tokens] (a ragged serving batch)."""
    g = torch.Generator().manual_seed(12)
    q, k = torch.randn(10, 4, 32, generator=g), torch.randn(10, 1, 32, generator=g)
    freqs = rope_tables(MAX_POS, 32)
    pos = torch.tensor([0, 1, 2, 3, 900, 901, 17, 18, 19, 4000])
    qo, ko = apply_rotary_emb_qk(q, k, freqs, positions=pos, interleaved=False)
    assert qo.shape == q.shape and ko.shape == k.shape
    torch.testing.assert_close(qo.double(), rope_reference(q[None], *freqs, pos, False)[0], **tolerance(torch.float32))
    torch.testing.assert_close(ko.double(), rope_reference(k[None], *freqs, pos, False)[0], **tolerance(torch.float32))


# -- gradients --------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_matches_autograd_of_the_reference(dtype, interleaved):
    x, freqs, pos = case(2, 5, 3, 64, 32, dtype, "2d", seed=21)
    x.requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(22)).to(dtype)
    apply_rotary_emb(x, freqs, interleaved=interleaved, positions=pos).backward(g)
    x64 = x.detach().double().requires_grad_()
    rope_reference(x64, *freqs, pos, interleaved).backward(g.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **tolerance(dtype))


def test_qk_gradients_match_autograd_of_the_reference():
    g = torch.Generator().manual_seed(23)
    q = torch.randn(1, 6, 4, 32, generator=g, requires_grad=True)
    k = torch.randn(1, 6, 2, 32, generator=g, requires_grad=True)
    freqs, pos = rope_tables(64, 32), random_positions(g, "1d", 1, 6, 64)
    qo, ko = apply_rotary_emb_qk(q, k, freqs, positions=pos, interleaved=False)
    gq, gk = torch.randn(qo.shape, generator=g), torch.randn(ko.shape, generator=g)
    torch.autograd.backward((qo, ko), (gq, gk))
    for t, grad in ((q, gq), (k, gk)):
        t64 = t.detach().double().requires_grad_()
        rope_reference(t64, *freqs, pos, False).backward(grad.double())
        torch.testing.assert_close(t.grad.double(), t64.grad, **tolerance(torch.float32))


def test_gradcheck_float64():
    x, freqs, pos = case(2, 5, 2, 12, 8, torch.float64, "1d", seed=9)
    x.requires_grad_()
    for interleaved in (True, False):
        assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, freqs, interleaved=interleaved, positions=pos), (x,))


# -- torch.compile ----------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rotary_emb_compiles_fullgraph(interleaved):
    x, freqs, pos = case(2, 5, 3, 64, 64, torch.bfloat16, "2d", seed=31)
    fn = lambda x, p: apply_rotary_emb(x, freqs, interleaved=interleaved, positions=p)  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, pos)
    torch.testing.assert_close(got, fn(x, pos), atol=0, rtol=0)
    torch.testing.assert_close(got.double(), rope_reference(x, *freqs, pos, interleaved), **tolerance(torch.bfloat16))


@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_emb_qk_compiles_fullgraph(inplace):
    g = torch.Generator().manual_seed(32)
    q, k = torch.randn(2, 5, 4, 32, generator=g), torch.randn(2, 5, 2, 32, generator=g)
    freqs, pos = rope_tables(64, 32), random_positions(g, "1d", 2, 5, 64)

    def fn(q, k):
        return apply_rotary_emb_qk(q, k, freqs, positions=pos, interleaved=False, inplace=inplace)

    torch._dynamo.reset()
    qc, kc = q.clone(), k.clone()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(qc, kc)
    torch.testing.assert_close(got[0].double(), rope_reference(q, *freqs, pos, False), **tolerance(torch.float32))
    torch.testing.assert_close(got[1].double(), rope_reference(k, *freqs, pos, False), **tolerance(torch.float32))
    assert torch.equal(qc, got[0]) if inplace else torch.equal(qc, q)


# -- bad input --------------------------------------------------------------------------


def _bad(x, c, s, **kw):
    return (x, (c, s)), kw


BAD = {
    "positions out of range": (lambda x, c, s: _bad(x, c, s, positions=torch.tensor([0, 1, 64])), ValueError,
                               r"^positions must lie in \[0, 64\)"),
    "negative position": (lambda x, c, s: _bad(x, c, s, positions=torch.tensor([0, -1, 5])), ValueError,
                          r"^positions must lie in \[0, 64\)"),
    "float positions": (lambda x, c, s: _bad(x, c, s, positions=torch.zeros(3)), TypeError, r"^positions must be int32 or int64"),
    "positions shape": (lambda x, c, s: _bad(x, c, s, positions=torch.zeros(2, 2, dtype=torch.int64)), ValueError,
                        r"^positions must have shape \[seq\] = \[3\] or \[batch, seq\] = \[2, 3\]"),
    "positions device": (lambda x, c, s: _bad(x, c, s, positions=torch.zeros(3, dtype=torch.int64, device="meta")),
                         ValueError, r"^positions is on meta"),
    "rotary_dim too large": (lambda x, c, s: _bad(x, torch.cat((c, c), 1), torch.cat((s, s), 1)), ValueError,
                             r"^cos has 16 columns: rotary_dim = 32 exceeds x's head_dim 16"),
    "cos/sin shapes differ": (lambda x, c, s: _bad(x, c, s[:, :4]), ValueError, r"^sin has shape \(64, 4\) but cos has \(64, 8\)"),
    "sin not float32": (lambda x, c, s: _bad(x, c, s.half()), TypeError, r"^sin must be float32"),
    "too few rows": (lambda x, c, s: _bad(x, c[:2], s[:2]), ValueError, r"^cos has shape \(2, 8\)"),
}


@pytest.mark.parametrize("make, error, match", BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_argument(make, error, match):
    x = torch.randn(2, 3, 2, 16)
    args, kw = make(x, *rope_tables(64, 16))
    with pytest.raises(error, match=match):
        apply_rotary_emb(*args, **kw)


QK_BAD = {
    "k batch": (lambda q, k: (q, k[:1]), ValueError, r"^k's leading dims \(1, 3\) must equal q's \(2, 3\)"),
    "k sequence": (lambda q, k: (q, k[:, :2]), ValueError, r"^k's leading dims \(2, 2\) must equal q's \(2, 3\)"),
    "k head_dim": (lambda q, k: (q, k[..., :8]), ValueError, r"^k's head_dim 8 must equal q's 16"),
    "k dtype": (lambda q, k: (q, k.half()), TypeError, r"^k's dtype torch.float16 must equal q's torch.float32"),
    "q rank": (lambda q, k: (q[0, 0], k), ValueError, r"^q must be 3-D or 4-D"),
}


@pytest.mark.parametrize("make, error, match", QK_BAD.values(), ids=QK_BAD.keys())
def test_qk_bad_input_names_the_argument(make, error, match):
    q, k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)
    with pytest.raises(error, match=match):
        apply_rotary_emb_qk(*make(q, k), rope_tables(8, 16))


# -- dispatch ---------------------------------------------------------------------------

ALL_DTYPES = {"rotary_emb": {"module": "fake_rotary_module", "abi": 1, "dtypes": ["float16", "bfloat16", "float32"]}}


def rotary_runtime(importer=None, ops=None):
    registry = Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=ops))),
                        importer=importer or (lambda name: fake_module(name)))
    return Runtime(registry)


def test_cpu_resolves_to_torch_with_reason():
    runtime = rotary_runtime()
    with use_runtime(runtime):
        x, cos, sin = inputs(1, 3, 2, 8, torch.bfloat16)
        apply_rotary_emb(x, (cos, sin))
    (decision,) = runtime.explain("rotary_emb")
    assert decision.chosen == "torch"
    assert "CUDA" in decision.trace[0].reason and not decision.trace[0].accepted


@pytest.mark.parametrize(
    "call, ops, verdict",
    [
        (RotaryCall(H200, torch.bfloat16, 128, needs_grad=False), None, None),
        (RotaryCall(H200, torch.bfloat16, 128, needs_grad=True), None, None),  # the backward kernel
        (RotaryCall(H200, torch.float16, 128, needs_grad=False), None, "lists dtypes ['bfloat16'], not float16"),
        (RotaryCall(H200, torch.float16, 80, needs_grad=True), ALL_DTYPES, None),
        (RotaryCall(H200, torch.float64, 128, needs_grad=False), ALL_DTYPES, "not float64"),
        (RotaryCall(CPU, torch.bfloat16, 128, needs_grad=False), None, "CUDA"),
    ],
)
def test_kernel_capability_comes_from_the_manifest(call, ops, verdict):
    reason = rotary._Kernel(rotary_runtime(ops=ops)).check(call)
    assert reason is None if verdict is None else verdict in reason


def test_no_plugin_means_torch():
    runtime = Runtime(Registry(entry_points()))
    reason = rotary._Kernel(runtime).check(RotaryCall(H200, torch.bfloat16, 64, False))
    assert reason == "no installed plugin provides it"


class StandIn:
    """The ops layer's kernels, computed by the torch path, recording each launch."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(rotary, "probe_device", lambda device: H200)  # pretend tensors live on an H200
        for name in ("rotary_emb_unchecked", "rotary_qk_unchecked", "rotary_qk_inplace_unchecked"):
            monkeypatch.setattr(rotary.ops_rotary, name, getattr(self, name))

    def rotary_emb_unchecked(self, x, cos, sin, positions, interleaved, inverse):
        self.calls.append(("x", interleaved, inverse))
        return rotary.rotary_torch(x, cos, sin, positions, interleaved, inverse)

    def rotary_qk_unchecked(self, q, k, cos, sin, positions, interleaved, inverse):
        self.calls.append(("qk", interleaved, inverse))
        return (rotary.rotary_torch(q, cos, sin, positions, interleaved, inverse),
                rotary.rotary_torch(k, cos, sin, positions, interleaved, inverse))

    def rotary_qk_inplace_unchecked(self, q, k, cos, sin, positions, interleaved):
        self.calls.append(("qk_", interleaved, False))
        q.copy_(rotary.rotary_torch(q, cos, sin, positions, interleaved))
        k.copy_(rotary.rotary_torch(k, cos, sin, positions, interleaved))


def test_inference_and_training_take_the_kernel(monkeypatch):
    kernel = StandIn(monkeypatch)
    x, freqs, pos = case(2, 7, 4, 64, 64, torch.bfloat16, "1d", seed=1)
    with use_runtime(rotary_runtime(ops=ALL_DTYPES)):
        with torch.no_grad():
            out = apply_rotary_emb(x, freqs, positions=pos, interleaved=False)
        assert kernel.calls == [("x", False, False)]
        xg = x.clone().requires_grad_()
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.dtype)
        apply_rotary_emb(xg, freqs, positions=pos, interleaved=False).backward(g)
        assert kernel.calls[1:] == [("x", False, False), ("x", False, True)]  # forward, backward (inverse)
        x64 = x.double().requires_grad_()
        rope_reference(x64, *freqs, pos, False).backward(g.double())
        torch.testing.assert_close(xg.grad.double(), x64.grad, **tolerance(torch.bfloat16))
        apply_rotary_emb(x.double(), freqs, positions=pos)  # float64: not in the manifest, torch path
        assert len(kernel.calls) == 3
    torch.testing.assert_close(out.double(), rope_reference(x, *freqs, pos, False), **tolerance(torch.bfloat16))


def test_qk_takes_one_launch_forward_backward_and_in_place(monkeypatch):
    kernel = StandIn(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 4, 32, generator=g), torch.randn(1, 4, 2, 32, generator=g)
    freqs = rope_tables(16, 32)
    with use_runtime(rotary_runtime(ops=ALL_DTYPES)):
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = apply_rotary_emb_qk(qg, kg, freqs)
        (qo.sum() + ko.sum()).backward()
        assert kernel.calls == [("qk", True, False), ("qk", True, True)]
        qi, ki = q.clone(), k.clone()
        with torch.no_grad():
            assert apply_rotary_emb_qk(qi, ki, freqs, inplace=True) == (qi, ki)
        assert kernel.calls[2:] == [("qk_", True, False)]
    torch.testing.assert_close(qi.double(), rope_reference(q, *freqs), **tolerance(torch.float32))
    torch.testing.assert_close(qg.grad.double(), rope_reference(torch.ones_like(q), freqs[0], -freqs[1]),
                               **tolerance(torch.float32))


def test_kernel_that_fails_to_import_falls_back(monkeypatch):
    def broken(name):
        raise ImportError("undefined symbol: cudaLaunchKernelExC")

    runtime = rotary_runtime(importer=broken)
    monkeypatch.setattr(rotary, "probe_device", lambda device: H200)
    monkeypatch.setattr(rotary.ops_rotary, "rotary_emb_unchecked",
                        lambda *args: runtime.registry.load("rotary_emb", H200))
    x, cos, sin = inputs(1, 5, 2, 32, torch.bfloat16, seed=4)
    with use_runtime(runtime), torch.no_grad():
        with pytest.warns(PluginRejectedWarning, match="undefined symbol"):
            out = apply_rotary_emb(x, (cos, sin))
        torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin), **tolerance(torch.bfloat16))
        apply_rotary_emb(x, (cos, sin))
    (decision,) = runtime.explain("rotary_emb")
    assert decision.chosen == "torch" and "undefined symbol" in decision.trace[0].reason


# -- a transformers Llama through the API (docs/kernels/rotary.md) -------------------------


def test_transformers_llama_with_the_documented_patch_gives_the_same_logits(monkeypatch):
    import transformers.models.llama.modeling_llama as llama
    from transformers import LlamaConfig

    def astrai_rope(q, k, cos, sin, unsqueeze_dim=1):  # as in the docs
        b, l, d = cos.shape
        half = d // 2
        table = (cos[..., :half].reshape(b * l, half).float(), sin[..., :half].reshape(b * l, half).float())
        positions = torch.arange(b * l, device=q.device).view(b, l)
        q_rot, k_rot = apply_rotary_emb_qk(q.transpose(1, 2), k.transpose(1, 2), table, positions=positions,
                                           interleaved=False)
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    model = llama.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 9))
    # per-request positions with gaps (cos/sin [2, L, D]); a uniform shift would not change attention
    ragged = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 2, 3, 10, 11, 12, 30, 31, 40]])
    with torch.no_grad():
        want = [model(ids).logits, model(ids, position_ids=ragged).logits]
        monkeypatch.setattr(llama, "apply_rotary_pos_emb", astrai_rope)
        got = [model(ids).logits, model(ids, position_ids=ragged).logits]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert (want[0] - want[1]).abs().max() > 1e-3  # the positions matter
