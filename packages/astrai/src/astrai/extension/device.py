"""Facts about the machine that decide which plugin binaries can run.

Everything here is plain data (``DeviceInfo``) so the registry can be tested with
made-up devices; ``probe_device`` is the only place that asks the real machine.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """One device as the registry sees it."""

    type: str  # "cuda" or "cpu"
    index: int | None = None
    name: str = "cpu"
    capability: tuple[int, int] | None = None  # (major, minor) for CUDA devices
    driver_cuda: tuple[int, int] | None = None  # CUDA version the driver supports

    @property
    def sm(self) -> int | None:
        """Compute capability as major * 10 + minor (90 for an H100/H200)."""
        if self.capability is None:
            return None
        return self.capability[0] * 10 + self.capability[1]

    @functools.cached_property  # read by every registry lookup
    def key(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def describe(self) -> str:
        if self.type != "cuda":
            return "no CUDA device"
        major, minor = self.capability or (0, 0)
        drv = "unknown" if self.driver_cuda is None else "%d.%d" % self.driver_cuda
        return f"{self.name} (sm_{major}{minor}, driver CUDA {drv})"


CPU = DeviceInfo(type="cpu")


@functools.cache
def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports, read from libcuda; None without one."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return version.value // 1000, (version.value % 1000) // 10
    return None


@functools.cache
def _probe_cuda(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(type="cuda", index=index, name=props.name,
                      capability=(props.major, props.minor),
                      driver_cuda=driver_cuda_version())


def probe_device(device: torch.device | str | None = None) -> DeviceInfo:
    """Describe ``device`` (default: the current CUDA device, else the CPU)."""
    if type(device) is torch.device and device.index is not None and device.type == "cuda":
        return _probe_cuda(device.index)  # a tensor's device: the per-call case
    if device is None:
        if not torch.cuda.is_available():
            return CPU
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe_cuda(index)
