"""Fake entry points, devices and plugins for registry / resolver tests."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from astrai.extension.device import DeviceInfo

H200 = DeviceInfo(type="cuda", index=0, name="NVIDIA H200", capability=(9, 0), driver_cuda=(13, 0))
L20 = DeviceInfo(type="cuda", index=1, name="NVIDIA L20", capability=(8, 9), driver_cuda=(13, 0))
A100_OLD_DRIVER = DeviceInfo(type="cuda", index=0, name="NVIDIA A100", capability=(8, 0), driver_cuda=(12, 4))
T4 = DeviceInfo(type="cuda", index=0, name="Tesla T4", capability=(7, 5), driver_cuda=(13, 0))


@dataclass
class FakeDist:
    name: str


class FakeEntryPoint:
    def __init__(self, name: str, target: Any, dist: str | None = None):
        self.name = name
        self.value = f"fake_{name}:manifest"
        self.dist = FakeDist(dist or f"astrai-{name}")
        self._target = target

    def load(self):
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


def manifest(name="astrai-rotary", ops=None, **overrides) -> dict:
    raw = {
        "api_version": 1,
        "name": name,
        "version": "0.1.0+cu130",
        "core_requires": ">=0.1.0,<0.2.0",
        "cuda": "13.0",
        "sass_archs": ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120"],
        "ptx_archs": ["compute_120"],
        "ops": ops if ops is not None else {
            "rotary_emb": {"module": "fake_rotary_module", "abi": 1, "dtypes": ["bfloat16"]},
        },
    }
    raw.update(overrides)
    return raw


def entry_points(*eps):
    return lambda: list(eps)


def fake_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module
