"""The quantize outputs the FP8 linear reuses between calls (``ops.fp8.QuantizeScratch``):
kept per thread, stream, operand and shape, never during a CUDA graph capture, bounded.
CUDA's stream and capture queries are simulated (the buffers are plain CPU tensors here);
that reuse changes no value on a GPU is tests/gpu/fp8/test_fp8_autocast_gpu.py's."""

from __future__ import annotations

import threading

import pytest
import torch

from astrai.extension.ops import fp8 as ops_fp8


@pytest.fixture
def cuda_state(monkeypatch):
    state = {"stream": 7, "capturing": False}
    monkeypatch.setattr(ops_fp8, "current_stream", lambda index: state["stream"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    return state


def _x(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 1000 + cols))


def test_outputs_are_kept_per_operand_shape_and_stream(cuda_state):
    scratch = ops_fp8.QuantizeScratch("e5m2")
    x = _x(6, 10)
    q, q_t, q_arg, qt_arg = first = scratch.outputs(x, 2, "g", True)
    assert q.shape == (6, 10) and q_t.shape == (10, 6) and q.dtype == q_t.dtype == torch.float8_e5m2
    assert q_arg == (q.data_ptr(), (6, 10), (10, 1), 4) and qt_arg == (q_t.data_ptr(), (10, 6), (6, 1), 4)
    assert scratch.outputs(_x(6, 10), 2, "g", True) is first  # the same buffers next call
    assert scratch.outputs(x, 2, "x", True) is not first  # another operand never shares them
    assert scratch.outputs(_x(5, 10), 2, "g", True) is not first  # nor another shape
    cuda_state["stream"] = 9
    assert scratch.outputs(x, 2, "g", True) is not first  # nor another stream
    cuda_state["stream"] = 7
    assert scratch.outputs(x, 2, "g", True) is first


def test_a_kept_q_t_only_when_asked(cuda_state):
    scratch = ops_fp8.QuantizeScratch("e4m3")
    q, q_t, _, qt_arg = scratch.outputs(_x(4, 8), 2, "x", False)  # the caller keeps q_t: made fresh
    assert q.shape == (4, 8) and q_t is None and qt_arg is None
    q, q_t, q_arg, _ = scratch.outputs(_x(4, 8), 1, "x", False)
    assert q is None and q_t is None and q_arg is None


def test_nothing_is_kept_or_reused_during_a_capture(cuda_state):
    scratch = ops_fp8.QuantizeScratch("e4m3")
    cuda_state["capturing"] = True
    assert scratch.outputs(_x(4, 8), 0, "x", False) is None
    assert scratch.buffers == {}


def test_threads_get_buffers_of_their_own(cuda_state):
    scratch = ops_fp8.QuantizeScratch("e4m3")
    x = _x(4, 8)
    mine = scratch.outputs(x, 0, "x", False)
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(scratch.outputs(x, 0, "x", False)))
    worker.start()
    worker.join()
    assert theirs[0][0] is not mine[0]
    assert scratch.outputs(x, 0, "x", False) is mine


def test_at_most_kept_shapes_oldest_dropped_first(cuda_state):
    scratch = ops_fp8.QuantizeScratch("e4m3", kept=2)
    a = scratch.outputs(_x(1, 8), 0, "x", False)
    scratch.outputs(_x(2, 8), 0, "x", False)
    scratch.outputs(_x(3, 8), 0, "x", False)  # drops the first
    assert len(scratch.buffers) == 2
    assert scratch.outputs(_x(1, 8), 0, "x", False) is not a
