"""The rotary plan: checks and decision once per kind of call, a repeated call only launches;
the launcher passes the compiled entry point exactly what the checked op would."""

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest
from reference import tolerance
from rotary_reference import rope_reference, rope_tables

from astrai.extension import apply_rotary_emb
from astrai.extension.abi import tensor_arg
from astrai.extension.backend import rotary
from astrai.extension.ops import _plugin
from astrai.extension.ops import rotary as rotary_ops
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.runtime import Runtime, use_runtime

OPS = {"rotary_emb": {"module": "fake_rotary_module", "abi": 1, "dtypes": ["bfloat16", "float32"]}}


def runtime_with(module_attrs) -> Runtime:
    return Runtime(Registry(entry_points(FakeEntryPoint("elementwise", manifest(ops=OPS))),
                            importer=lambda name: fake_module(name, **module_attrs)))


def test_a_repeated_call_is_planned_once(monkeypatch):
    made = []
    make = rotary._make_plan
    monkeypatch.setattr(rotary, "_make_plan", lambda *args: made.append(args) or make(*args))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 32, generator=g)
    freqs, pos = rope_tables(64, 32), torch.tensor([0, 7, 9, 40, 63])
    with use_runtime(Runtime(Registry(entry_points()))):
        for _ in range(3):
            out = apply_rotary_emb(x, freqs, positions=pos, interleaved=False)
        assert len(made) == 1
        apply_rotary_emb(x.double(), freqs, positions=pos, interleaved=False)  # another dtype: another plan
        apply_rotary_emb(x, freqs, positions=pos.view(1, 5), interleaved=False)  # another positions shape
        apply_rotary_emb(x, freqs, positions=pos, interleaved=True)  # another layout
        assert len(made) == 4
        with pytest.raises(ValueError, match=r"^positions must lie in \[0, 64\)"):  # host positions: every call
            apply_rotary_emb(x, freqs, positions=torch.tensor([0, 7, 9, 40, 64]), interleaved=False)
        with pytest.raises(ValueError, match=r"^x has odd head_dim"):  # a failed check plans nothing
            apply_rotary_emb(x[..., :31], freqs)
        with pytest.raises(ValueError, match=r"^x has odd head_dim"):
            apply_rotary_emb(x[..., :31], freqs)
    torch.testing.assert_close(out.double(), rope_reference(x, *freqs, pos, False), **tolerance(torch.float32))


def test_plans_follow_the_gradient_mode(monkeypatch):
    kernel_calls = []
    monkeypatch.setattr(rotary, "probe_device", lambda device=None: H200)
    monkeypatch.setattr(rotary.ops_rotary, "rotary_emb_unchecked",
                        lambda x, c, s, p, il, inv: kernel_calls.append(inv) or rotary.rotary_torch(x, c, s, p, il, inv))
    x = torch.randn(1, 4, 2, 16, requires_grad=True)
    freqs = rope_tables(8, 16)
    with use_runtime(runtime_with({})):
        with torch.no_grad():
            apply_rotary_emb(x, freqs)
        apply_rotary_emb(x, freqs).sum().backward()
    assert kernel_calls == [False, False, True]  # inference; training forward and its backward
    torch.testing.assert_close(x.grad.double(), rope_reference(torch.ones_like(x), freqs[0], -freqs[1]),
                               **tolerance(torch.float32))


@pytest.mark.parametrize("with_positions", [False, True])
def test_the_launcher_passes_what_the_checked_op_would(monkeypatch, with_positions):
    calls = []
    monkeypatch.setattr(_plugin, "probe_device", lambda device=None: H200)
    monkeypatch.setattr(rotary_ops, "current_device", lambda: 0)  # the launcher launches on the current stream
    monkeypatch.setattr(rotary_ops, "current_stream", lambda index: 0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 8, 64, generator=g).to(torch.bfloat16).transpose(1, 2)[:, :, :4]  # a strided view
    cos, sin = rope_tables(100, 48)
    pos = torch.randint(0, 100, (3, 8), generator=g) if with_positions else None
    with use_runtime(runtime_with({"rotary": lambda *args: calls.append(args)})):
        run = rotary_ops.rotary_emb_launcher(x, cos, sin, pos, False, True)
        out = run(x, cos, sin, pos)
        x2 = torch.randn(3, 4, 8, 64, generator=g).to(torch.bfloat16).transpose(1, 2)[:, :, :4]
        out2 = run(x2, cos, sin, pos)  # new tensors of the same kind: new pointers, same layout
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    for (xa, k, c, s, p, o, ko, interleaved, inverse, stream), (xt, ot) in zip(calls, [(x, out), (x2, out2)]):
        assert (xa, c, s, p, o) == (tensor_arg(xt), tensor_arg(cos), tensor_arg(sin), tensor_arg(pos), tensor_arg(ot))
        assert (k, ko, interleaved, inverse, stream) == (None, None, False, True, 0)


@pytest.fixture
def kernel_path(monkeypatch):
    """CPU tensors take the planned kernel path of a CUDA call: an H200, the launcher, device 0."""
    monkeypatch.setattr(rotary, "probe_device", lambda device=None: H200)
    monkeypatch.setattr(_plugin, "probe_device", lambda device=None: H200)
    monkeypatch.setattr(rotary_ops, "current_device", lambda: 0)
    monkeypatch.setattr(rotary_ops, "current_stream", lambda index: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"))


def test_a_planned_kernel_call_still_rejects_changed_arguments_before_launching(kernel_path):
    calls = []
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 32, generator=g).to(torch.bfloat16)
    cos, sin = rope_tables(16, 32)
    with use_runtime(runtime_with({"rotary": lambda *args: calls.append(args)})):
        out = apply_rotary_emb(x, (cos, sin))
        x2 = torch.randn(2, 3, 4, 32, generator=g).to(torch.bfloat16)
        out2 = apply_rotary_emb(x2, (cos, sin))  # the plan's launcher: new pointers, same layout
        assert [c[0] for c in calls] == [tensor_arg(x), tensor_arg(x2)]
        assert [c[5] for c in calls] == [tensor_arg(out), tensor_arg(out2)] and out.data_ptr() != out2.data_ptr()
        with pytest.raises(ValueError, match="^cos is on meta but x is on cpu"):
            apply_rotary_emb(x, (cos.to("meta"), sin))
        with pytest.raises(TypeError, match="^sin must be float32, got torch.float64"):
            apply_rotary_emb(x, (cos, sin.double()))
        with pytest.raises(ValueError, match="^sin has shape"):
            apply_rotary_emb(x, (cos, sin[:, :8]))
        with pytest.raises(ValueError, match=r"^cos has shape \(2, 16\)"):  # fewer rows than x's 3 positions
            apply_rotary_emb(x, (cos[:2], sin[:2]))
        with pytest.raises(ValueError, match="^x has odd head_dim 31"):
            apply_rotary_emb(x[..., :31], (cos, sin))
        assert len(calls) == 2  # nothing launched for a rejected call
        strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # x's shape, other strides: another plan
        apply_rotary_emb(strided, (cos, sin))
        assert calls[-1][0] == tensor_arg(strided) and calls[-1][0][2] != tensor_arg(x)[2]


def test_an_image_error_of_the_launcher_marks_the_kernel_unusable_and_falls_back(kernel_path):
    def no_image(*args):
        exc = RuntimeError("CUDA error cudaErrorNoKernelImageForDevice")
        exc.cuda_error = 209
        raise exc

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 2, 16, generator=g)
    freqs = rope_tables(8, 16)
    runtime = runtime_with({"rotary": no_image})
    with use_runtime(runtime), pytest.warns(PluginRejectedWarning, match="rotary_emb disabled"):
        out = apply_rotary_emb(x, freqs)
        assert not runtime.registry.op_status("rotary_emb", H200).usable
        assert rotary.choose(x, False) == "torch"
    torch.testing.assert_close(out.double(), rope_reference(x, *freqs), **tolerance(torch.float32))


def test_an_argument_error_of_the_launcher_propagates_and_keeps_the_kernel(kernel_path):
    def rejects(*args):
        raise ValueError("q: head_dim must be even")

    x = torch.randn(1, 3, 2, 16)
    runtime = runtime_with({"rotary": rejects})
    with use_runtime(runtime), pytest.raises(ValueError, match="head_dim must be even"):
        apply_rotary_emb(x, rope_tables(8, 16))
    assert runtime.registry.op_status("rotary_emb", H200).usable
