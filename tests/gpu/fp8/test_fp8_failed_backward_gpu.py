"""A backward pass that raises, on the GPU: the CUDA autograd engine (its device threads)
frees the end-of-pass callback unrun too, and the next steps train as a twin that never
saw the failure (the plugin's kernels, the scale update kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from astrai.extension._fp8 import linear
from astrai.extension.fp8 import DelayedScaling, Format, fp8_autocast, fp8_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fp8"))  # tests/fp8, the CPU test
from test_fp8_failed_backward import FailsInBackward  # noqa: E402 - the CPU test's failing identity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA device of sm_89 or newer"),
]


def test_a_failed_backward_is_forgotten_on_the_gpu():
    recipe = DelayedScaling(amax_history_len=4, fp8_format=Format.HYBRID)
    torch.manual_seed(0)
    failed = torch.nn.Linear(256, 128, device="cuda", dtype=torch.bfloat16)
    twin = torch.nn.Linear(256, 128, device="cuda", dtype=torch.bfloat16)
    twin.load_state_dict(failed.state_dict())
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    with fp8_autocast(recipe=recipe):
        y = failed(FailsInBackward.apply(x))
        twin(x)
    with pytest.raises(RuntimeError, match="upstream backward failed"):
        (y * 1000.0).sum().backward()  # a 1000x gradient: its amax must never be consumed
    torch.cuda.synchronize()
    failed.zero_grad(set_to_none=True)
    state = fp8_state(failed)
    assert not state._backward_pending and linear._pending == {}
    assert state.grad_output.updates == 0 and not state.grad_output.amax_history.any()
    for step in range(3):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        grad = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for lin, inp in ((failed, x), (twin, x_twin)):
            with fp8_autocast(recipe=recipe):
                out = lin(inp)
            out.backward(grad)
        for role in ("input", "weight", "grad_output"):
            a, b = getattr(fp8_state(failed), role), getattr(fp8_state(twin), role)
            assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale), (step, role)
        assert torch.equal(x.grad, x_twin.grad)
    assert torch.equal(failed.weight.grad, twin.weight.grad)
