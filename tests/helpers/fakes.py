"""Fake entry points, devices and plugins for registry / resolver tests."""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

from astrai.extension.bindings import BINDINGS
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


def manifest(name="astrai-elementwise", ops=None, **overrides) -> dict:
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


def binding_fake(entry: str, calls: list[tuple]):
    """A fake of the compiled entry point ``entry`` that takes its arguments as the binding
    does (``BINDINGS[entry]``; a call the binding would refuse raises ``TypeError``) and
    appends each call's positional arguments to ``calls``."""
    binding = BINDINGS[entry]
    signature = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in binding.required]
        + [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in binding.optional])

    def fake(*args, **kwargs):
        signature.bind(*args, **kwargs)
        calls.append(args)

    fake.__name__ = entry
    fake.__signature__ = signature
    return fake


class FakeDecodeModule:
    """What plan_paged_decode / a launch call use of the paged attention modules."""

    def __init__(self, splits=3):
        self.splits = splits
        self.plans: list[tuple] = []
        self.launches: list[tuple] = []
        self.attn_paged_decode = binding_fake("attn_paged_decode", self.launches)
        self.attn_paged_prefill = binding_fake("attn_paged_prefill", self.launches)

    def decode_plan(self, batch, kv_heads, group, head_dim, kv_len_hint, num_sms, kv_bytes=2):
        self.plans.append((batch, kv_heads, group, head_dim, kv_len_hint, num_sms))
        return self.splits


class FakeAppendingModule(FakeDecodeModule):
    """A compiled module with the fused append (``kv_append`` and the decode's trailing k_new, v_new, slots)."""

    def kv_append(self, k_new, v_new, k_cache, v_cache, slots, stream, kv_scales=None):
        raise AssertionError("the decode launch appends itself")


class FakeLastAppendingModule(FakeAppendingModule):
    """A compiled module whose decode kernel appends each request's last position itself (``append_last``)."""

    APPEND_LAST = True


# the fake compiled modules above, whose entry points tests/core/test_bindings.py holds to BINDINGS
FAKE_MODULES = (FakeDecodeModule, FakeAppendingModule, FakeLastAppendingModule)
