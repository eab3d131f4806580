"""The astrai-fp8 plugin's decode-size linear over FP8 weights as a torch custom op.

``fp8_weight_gemm_unchecked(x [M, K], w [N, K], w_scale [N]) -> y [M, N]``:
``y = x (w * w_scale[:, None])^T`` for ``M <= 64`` rows of bfloat16 / float16 ``x``
(``y`` in ``x``'s dtype), ``w`` float8_e4m3fn / float8_e5m2, ``w_scale`` float32, K a
multiple of :data:`K_MULTIPLE`, rows 16-byte aligned (``backend/fp8_weights.py`` checks all
of it and runs the torch path otherwise). ``torch.ops.astrai.fp8_weight_gemm`` with a fake
implementation (``torch.compile``, CUDA graphs).

The launch splits K over blocks where the output channels alone leave SMs idle (the module's
``weight_gemm_plan``); the splits add into a float32 workspace that the launch leaves zero, kept
per device and stream. A CUDA-graph capture reuses one its warm-up made (the graph then reads
it by address, with no zeroing recorded); only a capture without one allocates (and zeroes) its own.

``fp8_quantize_rows_unchecked(x [M, K]) -> (q [M, K] e4m3, scale [M, 1] float32)``: the W8A8
route's per-token quantize in one launch (``scale = amax of the row * float32(1 / 448)``, 1 for a
row whose amax is not > 0; ``q = x / scale``), the same bytes as
``backend.fp8_weights.quantize_per_token``; 16-bit ``x``, K a multiple of 8, rows 16-byte aligned. A plugin built before it has no
``quantize_rows``: :func:`has_quantize_rows` says so and the caller quantizes in torch.

``fp8_rowwise_gemm_unchecked(xq [M, K], x_scale [M, 1], w [N, K], w_scale [N]) -> y [M, N]``
bfloat16: the W8A8 product ``(xq * x_scale) (w * w_scale[:, None])^T`` on the plugin's Hopper
kernel (sm_90a; swap-AB tiles for ``M <= ROWWISE_MAX_ROWS``, K split over a cluster of CTAs
where N alone leaves SMs idle), e4m3 operands with 16-byte aligned rows, K a multiple of 16. A
plugin built before it has no ``gemm_rowwise``: :func:`has_rowwise_gemm` says so.

Call convention (ABI 1) of ``astrai_fp8._fp8_ops``: ``weight_gemm(x, w, w_scale, y, ws,
k_per_split, stream)``, ``weight_gemm_plan(n, k, sms) -> k_per_split``, ``quantize_rows(x, q,
scale, stream)``, ``gemm_rowwise(a, b, a_scale, b_scale, out, stream)``; tensors as tuples
``(data_ptr, shape, strides_in_elements, dtype_code)``, ``ws`` None without splits.
"""

from __future__ import annotations

import torch

from ..abi import launch, stream_handle, tensor_arg
from ..op_names import FP8_WEIGHT_GEMM
from . import _plugin

__all__ = ["K_MULTIPLE", "MAX_ROWS", "ROWWISE_MAX_ROWS", "fp8_quantize_rows_unchecked", "fp8_rowwise_gemm_unchecked",
           "fp8_weight_gemm_unchecked", "has_quantize_rows", "has_rowwise_gemm"]

MAX_ROWS = 64  # rows of x (decode tokens) the kernel takes
K_MULTIPLE = 256  # K is staged in chunks of this many
ROWWISE_MAX_ROWS = 64  # rows of xq gemm_rowwise's swap-AB tiles cover (the planner's widest)

_SPLITS: dict[tuple[int, int, int], int] = {}  # (device index, n, k) -> k_per_split
_WORKSPACES: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream) -> float32, all zero
_OUTGROWN: list[torch.Tensor] = []  # replaced by larger ones, kept: a captured graph may hold their address


def _k_per_split(module, device: torch.device, n: int, k: int) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, n, k)
    found = _SPLITS.get(key)
    if found is None:
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        found = _SPLITS[key] = module.weight_gemm_plan(n, k, sms)
    return found


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A zero float32 buffer of at least ``numel`` elements for this device's current stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        made = [ws for (i, _), ws in _WORKSPACES.items() if i == index and ws.numel() >= numel]
        return made[0] if made else torch.zeros(numel, dtype=torch.float32, device=device)
    key = (index, stream_handle(device))
    found = _WORKSPACES.get(key)
    if found is None or found.numel() < numel:
        if found is not None:
            _OUTGROWN.append(found)
        found = _WORKSPACES[key] = torch.zeros(numel, dtype=torch.float32, device=device)
    return found


@_plugin.plugin_op(f"astrai::{FP8_WEIGHT_GEMM}")
def fp8_weight_gemm_unchecked(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    module = _plugin.require(FP8_WEIGHT_GEMM, x.device)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split = _k_per_split(module, x.device, n, k)
    ws = None if k_per_split >= k else tensor_arg(_workspace(x.device, m * n)[:m * n].view(m, n))
    launch(x.device, module.weight_gemm, tensor_arg(x), tensor_arg(w), tensor_arg(w_scale), tensor_arg(y), ws,
           k_per_split)
    return y


@fp8_weight_gemm_unchecked.op.register_fake
def _fp8_weight_gemm_fake(x, w, w_scale):
    return torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)


def has_quantize_rows(device: torch.device) -> bool:
    """Whether a plugin serves the weight GEMM on ``device`` and has the per-token quantize."""
    return _plugin.has_entry(FP8_WEIGHT_GEMM, device, "quantize_rows")


@_plugin.plugin_op("astrai::fp8_quantize_rows")
def fp8_quantize_rows_unchecked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    module = _plugin.require(FP8_WEIGHT_GEMM, x.device)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    launch(x.device, module.quantize_rows, tensor_arg(x), tensor_arg(q), tensor_arg(scale.view(-1)))
    return q, scale


@fp8_quantize_rows_unchecked.op.register_fake
def _fp8_quantize_rows_fake(x):
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


def has_rowwise_gemm(device: torch.device) -> bool:
    """Whether a plugin serves the weight GEMM on ``device`` and has the row-wise scaled FP8 GEMM."""
    return _plugin.has_entry(FP8_WEIGHT_GEMM, device, "gemm_rowwise")


@_plugin.plugin_op("astrai::fp8_rowwise_gemm")
def fp8_rowwise_gemm_unchecked(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                               w_scale: torch.Tensor) -> torch.Tensor:
    module = _plugin.require(FP8_WEIGHT_GEMM, xq.device)
    y = torch.empty((xq.shape[0], w.shape[0]), dtype=torch.bfloat16, device=xq.device)
    launch(xq.device, module.gemm_rowwise, tensor_arg(xq), tensor_arg(w), tensor_arg(x_scale.view(-1)),
           tensor_arg(w_scale), tensor_arg(y))
    return y


@fp8_rowwise_gemm_unchecked.op.register_fake
def _fp8_rowwise_gemm_fake(xq, x_scale, w, w_scale):
    return torch.empty((xq.shape[0], w.shape[0]), dtype=torch.bfloat16, device=xq.device)
