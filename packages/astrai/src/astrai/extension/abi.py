"""The compiled call convention shared by every ops wrapper (docs/plugins.md, section 4).

Plugin binaries never see a torch tensor: wrappers pass device pointers, shapes,
strides (in elements), the dtype codes below and the CUDA stream as plain ints.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from .op_names import ALL_OPS

# Mirrors astrai/dtype.h in packages/cuda-common; the numbers are part of ABI 1.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.int32: 5,
    torch.int64: 6,
    torch.bool: 7,
}

# The ABI version of each op's call convention this core speaks.
SUPPORTED_OP_ABI: dict[str, frozenset[int]] = dict.fromkeys(ALL_OPS, frozenset({1}))  # every op: version 1


def dtype_code(tensor: torch.Tensor) -> int:
    try:
        return DTYPE_CODES[tensor.dtype]
    except KeyError:
        raise TypeError(f"dtype {tensor.dtype} has no ABI code; supported: "
                        f"{', '.join(str(d) for d in DTYPE_CODES)}") from None


# torch's own accessor of the raw current stream (what its generated kernels launch on):
# one C call instead of building a torch.cuda.Stream object per launch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# torch's accessor of the current CUDA device: torch.cuda.current_device() adds its lazy-init
# checks to every call, and a launch only ever follows CUDA tensors (CUDA is initialised).
_raw_device = getattr(torch._C, "_cuda_getDevice", None)


def _current_device() -> int:
    """The index of the current CUDA device (CUDA already initialised)."""
    return torch.cuda.current_device()


def _current_stream(index: int) -> int:
    """The raw cudaStream_t of the current stream on CUDA device ``index``."""
    return torch.cuda.current_stream(index).cuda_stream


# The launchers call these on every launch: torch's C functions themselves where this torch
# has them (no Python frame in between), the public torch.cuda calls otherwise.
current_device = _raw_device if _raw_device is not None else _current_device
current_stream = _raw_stream if _raw_stream is not None else _current_stream


def stream_handle(device: torch.device) -> int:
    """The raw cudaStream_t of the current stream on ``device``."""
    if _raw_stream is not None:
        index = device.index
        return _raw_stream(torch.cuda.current_device() if index is None else index)
    return torch.cuda.current_stream(device).cuda_stream


# torch's allocation entry points without the dispatcher (what inductor's generated code
# allocates with): (shape, strides, dtype) -> a new tensor, on the current device for CUDA.
# Fetched and tried once per device type; torch.empty_strided where one is missing or fails.
_FAST_EMPTY: dict[str, Callable | None] = {}


def _fast_empty(device: torch.device) -> Callable | None:
    if device.type not in _FAST_EMPTY:
        guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
        fn = getattr(guards, f"_empty_strided_{device.type}", None)
        # the probe allocates on the device the launcher serves, not on whichever is current
        where = torch.cuda.device(device) if device.type == "cuda" and device.index is not None else nullcontext()
        try:
            with where:
                probe = None if fn is None else fn((2, 3), (3, 1), torch.float16)
            ok = (probe is not None and probe.device.type == device.type and probe.dtype == torch.float16
                  and probe.shape == (2, 3) and probe.stride() == (3, 1))
        except (RuntimeError, TypeError, ValueError):
            ok = False
        _FAST_EMPTY[device.type] = fn if ok else None
    return _FAST_EMPTY[device.type]


def empty_allocator(device: torch.device) -> Callable[[tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor]:
    """``alloc(shape, strides, dtype)``: a new uninitialised tensor on ``device`` (for a CUDA
    device: the current device, which the caller makes sure is ``device``), what
    ``torch.empty_strided`` returns at a fraction of its host cost (no dispatcher, no
    argument parsing): a launcher's output, allocated on every call."""
    fast = _fast_empty(device) if device.type in ("cuda", "cpu") else None
    if fast is not None:
        return fast
    return lambda shape, strides, dtype: torch.empty_strided(shape, strides, dtype=dtype, device=device)


TensorArg = tuple[int, tuple[int, ...], tuple[int, ...], int]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) torch gives a new contiguous tensor of ``shape``."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def tensor_arg(t: torch.Tensor | None) -> TensorArg | None:
    """A tensor as the binaries take it: ``(data_ptr, shape, strides in elements, dtype code)``."""
    if t is None:
        return None
    code = DTYPE_CODES.get(t.dtype)
    return t.data_ptr(), tuple(t.shape), t.stride(), dtype_code(t) if code is None else code


def launch(device: torch.device, fn, *args, **kwargs) -> None:
    """Call a compiled entry point with ``device`` current (the binaries launch on the
    current device, like torch's own kernels) and its current stream appended as the last
    positional argument (``kwargs`` follow it); the device is looked up once, as this is
    every launch's host path."""
    index = device.index
    current = current_device()
    if index is None or index == current:
        fn(*args, _raw_stream(current) if _raw_stream is not None else stream_handle(device), **kwargs)
    else:
        with torch.cuda.device(device):
            fn(*args, stream_handle(device), **kwargs)
