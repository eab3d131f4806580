"""A backward pass that raises leaves no trace in the FP8 gradient scaling: the next pass
neither folds the failed pass's amaxes into its step nor finds the state still pending."""

from __future__ import annotations

import pytest
import torch

from astrai.extension.backend import fp8_torch
from astrai.extension.fp8 import DelayedScaling, Format, fp8_autocast, fp8_state

E5M2_MAX = 57344.0


class FailsInBackward(torch.autograd.Function):
    """Identity whose backward raises: a failure upstream of the linear's backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("upstream backward failed")


def twins(seed: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(seed)
    a = torch.nn.Linear(16, 8)
    b = torch.nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    return a, b


def output_grad(seed: int, amax: float) -> torch.Tensor:
    g = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)).clamp_(-amax, amax)
    g[seed % 6, seed % 8] = amax
    return g


def step(lin, x, g, recipe, fail: bool = False):
    with fp8_autocast(recipe=recipe):
        y = lin(FailsInBackward.apply(x) if fail else x)
    (y * g).sum().backward()


def assert_same_state(a, b):
    for role in ("input", "weight", "grad_output"):
        ra, rb = getattr(fp8_state(a), role), getattr(fp8_state(b), role)
        assert torch.equal(ra.amax_history, rb.amax_history), role
        assert torch.equal(ra.scale, rb.scale) and ra.updates == rb.updates, role


@pytest.mark.parametrize("where", ["upstream", "in the linear"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_failed_backward_is_forgotten(monkeypatch, where, algo):
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, fp8_format=Format.HYBRID)
    failed, twin = twins(seed=7)
    g_fail = torch.Generator().manual_seed(1)
    x_fail = torch.randn(6, 16, generator=g_fail, requires_grad=True)
    # the failed pass sees a gradient 1000x larger than any later one: were its amax
    # consumed, the next scales would be 1000x too coarse
    if where == "upstream":
        with pytest.raises(RuntimeError, match="upstream backward failed"):
            step(failed, x_fail, output_grad(0, 500.0), recipe, fail=True)
    else:
        gemm = fp8_torch.emulated_gemm
        with fp8_autocast(recipe=recipe):
            y = failed(x_fail)

        def fails(*args, **kwargs):  # dgrad fails after the gradient was quantized
            raise RuntimeError("dgrad failed")

        monkeypatch.setattr(fp8_torch, "emulated_gemm", fails)
        with pytest.raises(RuntimeError, match="dgrad failed"):
            (y * output_grad(0, 500.0)).sum().backward()
        monkeypatch.setattr(fp8_torch, "emulated_gemm", gemm)
        # the twin's forward step must match the failed linear's: it ran one too
        with fp8_autocast(recipe=recipe):
            twin(x_fail)
    if where == "upstream":
        with fp8_autocast(recipe=recipe):
            twin(x_fail)
    failed.zero_grad(set_to_none=True)  # what autograd accumulated before the failure is the caller's
    state = fp8_state(failed)
    assert not state._backward_pending
    assert state.grad_output.updates == 0 and state.grad_output.scale.item() == 1.0
    assert not state.grad_output.amax_history.any()

    for i in range(1, 4):  # then both train the same: bit-identical state and gradients
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(10 + i), requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        g = output_grad(i, 0.25 * i)
        step(failed, x, g, recipe)
        step(twin, x_twin, g, recipe)
        assert_same_state(failed, twin)
        assert torch.equal(x.grad, x_twin.grad)
        assert fp8_state(failed).grad_output.updates == i
        newest = fp8_state(failed).grad_output.amax_history[1].item()
        assert newest == pytest.approx(float(g.abs().max()), rel=2**-7)  # bf16-rounded gradient
    assert torch.equal(failed.weight.grad, twin.weight.grad) and torch.equal(failed.bias.grad, twin.bias.grad)
    assert fp8_state(failed).grad_output.scale.item() == pytest.approx(
        float(fp8_state(failed).grad_output.amax_history.max()) / E5M2_MAX)


def test_failed_passes_leave_nothing_behind():
    from astrai.extension._fp8 import linear

    lin = torch.nn.Linear(16, 8)
    for i in range(5):
        x = torch.randn(6, 16, requires_grad=True)
        with pytest.raises(RuntimeError):
            step(lin, x, output_grad(i, 1.0), DelayedScaling(amax_history_len=2), fail=True)
    assert linear._pending == {}
