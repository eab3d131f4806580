"""Plugin discovery: entry points -> validated manifests -> lazily loaded compiled modules.

A ``Registry`` walks the entry-point group ``astrai.kernels`` once, keeps every plugin
it found with either a parsed manifest or the reason it was rejected, and answers
"which plugin runs op X on device D, or why none can" without importing any compiled
code. The compiled module is imported by ``load`` the first time an op runs.

Nothing here raises at discovery: a plugin that breaks is a rejected plugin. Whatever a
plugin's code raises (at discovery, import or launch) is contained, ``SystemExit`` and
other ``BaseException`` included: only ``KeyboardInterrupt`` passes through.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from packaging.version import Version

from .. import __version__ as CORE_VERSION
from .abi import SUPPORTED_OP_ABI
from .device import DeviceInfo
from .install import plugin_pip_command
from .manifest import Manifest, ManifestError, OpSpec, parse_manifest

GROUP = "astrai.kernels"
# The values of ASTRAI_DISABLE_PLUGINS that disable every plugin.
DISABLING_VALUES = ("1", "true", "yes")


class PluginRejectedWarning(RuntimeWarning):
    """A plugin is installed but cannot serve this device; the message says why."""


class EntryPointLike(Protocol):
    name: str
    value: str

    def load(self) -> object: ...


@dataclass
class PluginRecord:
    """One entry point of the group and what became of it."""

    entry_point: str  # "elementwise = astrai_elementwise:manifest"
    distribution: str | None
    manifest: Manifest | None = None
    rejected: str | None = None  # the reason, when discovery rejected it

    @property
    def name(self) -> str:
        if self.manifest is not None:
            return self.manifest.name
        return self.distribution or self.entry_point


@dataclass(frozen=True)
class OpStatus:
    """Whether ``op`` can run on a device, through which plugin, or why not."""

    op: str
    usable: bool
    reason: str
    plugin: PluginRecord | None = None
    spec: OpSpec | None = None
    trace: tuple[tuple[str, str], ...] = ()  # (plugin, verdict) per provider
    native: bool | None = None  # runs on native instructions there (manifest ``native_sm``)


def failure(exc: BaseException) -> str:
    """How a contained plugin exception reads in a rejection reason."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _environment_list(name: str) -> frozenset[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


class Registry:
    """The plugins of one entry-point group, validated against this core and a device.

    ``entry_points`` returns the entry points to consider (tests pass fakes);
    ``allow`` / ``deny`` filter plugins by distribution or entry-point name;
    ``enabled=False`` disables discovery altogether.
    """

    def __init__(
        self,
        entry_points: Callable[[], Iterable[EntryPointLike]] | None = None,
        *,
        core_version: str = CORE_VERSION,
        allow: Iterable[str] | None = None,
        deny: Iterable[str] = (),
        enabled: bool = True,
        importer: Callable[[str], ModuleType] = importlib.import_module,
    ) -> None:
        self._entry_points = entry_points or (lambda: importlib.metadata.entry_points(group=GROUP))
        self.core_version = Version(core_version)
        self.allow = None if allow is None else frozenset(allow)
        self.deny = frozenset(deny)
        self.enabled = enabled
        self._import = importer
        self._lock = threading.RLock()
        self._plugins: tuple[PluginRecord, ...] | None = None
        self._status: dict[tuple[str, str], OpStatus] = {}
        self._modules: dict[str, ModuleType] = {}
        self._broken: dict[tuple[str, str], str] = {}  # (op, device key) -> reason
        self._warned: set[tuple[str, str]] = set()

    @classmethod
    def from_environment(cls) -> Registry:
        """The registry the process uses: ``ASTRAI_PLUGINS_ALLOW`` / ``ASTRAI_PLUGINS_DENY``
        (comma-separated names) and ``ASTRAI_DISABLE_PLUGINS=1`` control what may load."""
        return cls(allow=_environment_list("ASTRAI_PLUGINS_ALLOW"),
                   deny=_environment_list("ASTRAI_PLUGINS_DENY") or (),
                   enabled=os.environ.get("ASTRAI_DISABLE_PLUGINS", "") not in DISABLING_VALUES)

    # -- discovery -------------------------------------------------------------------

    def entry_points(self) -> list:
        """The group's entry points as found, enabled or not, none loaded (what doctor lists
        as disabled); raises what reading the distributions' metadata raises."""
        return list(self._entry_points())

    def plugins(self) -> tuple[PluginRecord, ...]:
        """Every plugin found, accepted or rejected, in a deterministic order."""
        if self._plugins is None:
            with self._lock:
                if self._plugins is None:
                    self._plugins = self._discover()
        return self._plugins

    def _discover(self) -> tuple[PluginRecord, ...]:
        if not self.enabled:
            return ()
        records = []
        try:
            entry_points = list(self._entry_points())
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # broken metadata of some distribution
            return (PluginRecord(entry_point=f"(the {GROUP} entry points)", distribution=None,
                                 rejected=f"reading the entry points raised {failure(exc)}"),)
        for ep in entry_points:
            try:
                dist = getattr(getattr(ep, "dist", None), "name", None)
                record = PluginRecord(entry_point=f"{ep.name} = {ep.value}", distribution=dist)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                records.append(PluginRecord(entry_point=repr(ep), distribution=None,
                                            rejected=f"reading the entry point raised {failure(exc)}"))
                continue
            names = {ep.name, dist} - {None}
            if self.allow is not None and not names & self.allow:
                record.rejected = "not in ASTRAI_PLUGINS_ALLOW"
            elif names & self.deny:
                record.rejected = "listed in ASTRAI_PLUGINS_DENY"
            else:
                self._read_manifest(ep, record)
            records.append(record)
        records.sort(key=lambda r: (r.name, r.entry_point))
        seen: dict[str, PluginRecord] = {}
        for record in records:
            if record.manifest is None:
                continue
            if record.manifest.name in seen:
                record.rejected = f"duplicate of {seen[record.manifest.name].entry_point}"
                record.manifest = None
            else:
                seen[record.manifest.name] = record
        return tuple(records)

    def _read_manifest(self, ep: EntryPointLike, record: PluginRecord) -> None:
        try:
            obj = ep.load()
            raw = obj() if callable(obj) else obj
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a broken plugin (even one calling sys.exit) must never break astrai
            record.rejected = f"entry point raised {failure(exc)}"
            return
        try:
            manifest = parse_manifest(raw)
        except ManifestError as exc:
            record.rejected = str(exc)
            return
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # an object posing as a manifest whose reads raise
            record.rejected = f"reading the manifest raised {failure(exc)}"
            return
        if not manifest.core_requires.contains(self.core_version, prereleases=True):
            record.rejected = (
                f"needs astrai{manifest.core_requires}, this is astrai {self.core_version}: "
                f"{plugin_pip_command(manifest.name, None, str(self.core_version))}")
            return
        record.manifest = manifest

    # -- per device ------------------------------------------------------------------

    @staticmethod
    def device_rejection(manifest: Manifest, device: DeviceInfo) -> str | None:
        """Why ``manifest``'s binaries can't run on ``device``, or None when they can."""
        if manifest.cuda is None:
            return None
        if device.type != "cuda":
            return f"CUDA plugin (built for CUDA {manifest.cuda_text}); {device.describe()}"
        if device.driver_cuda is not None and device.driver_cuda[0] < manifest.cuda[0]:
            return (f"built for CUDA {manifest.cuda_text}, the driver supports CUDA "
                    "%d.%d: update the driver or install the CUDA %d build" % (*device.driver_cuda, device.driver_cuda[0]))
        archs = manifest.sass_archs + manifest.ptx_archs
        if not any(arch.runs_on(device.capability) for arch in archs):
            listed = ", ".join(str(a) for a in archs) or "none"
            return f"no SASS or PTX for sm_{device.sm} in the binaries (has {listed})"
        return None

    def _op_rejection(self, spec: OpSpec, device: DeviceInfo) -> str | None:
        speaks = SUPPORTED_OP_ABI.get(spec.name)
        if speaks is None:
            return f"op {spec.name!r} is unknown to astrai {self.core_version}"
        if spec.abi not in speaks:
            return f"op ABI {spec.abi}, this core speaks {sorted(speaks)}"
        if spec.min_sm is not None and device.sm is not None and device.sm < spec.min_sm:
            return f"needs sm_{spec.min_sm}+, device is sm_{device.sm}"
        broken = self._broken.get((spec.name, device.key))
        if broken is not None:
            return broken
        return None

    def op_status(self, op: str, device: DeviceInfo) -> OpStatus:
        """Which plugin serves ``op`` on ``device`` (first usable by distribution name)."""
        key = (op, device.key)
        status = self._status.get(key)
        if status is None:
            with self._lock:
                status = self._status.get(key) or self._compute_status(op, device)
                self._status[key] = status
            self._warn_rejections(device)
        return status

    def _compute_status(self, op: str, device: DeviceInfo) -> OpStatus:
        trace: list[tuple[str, str]] = []
        winner: OpStatus | None = None
        for record in self.plugins():
            if record.manifest is None or op not in record.manifest.ops:
                continue
            spec = record.manifest.ops[op]
            reason = self.device_rejection(record.manifest, device) or self._op_rejection(spec, device)
            if reason is not None:
                trace.append((record.name, f"rejected: {reason}"))
            elif winner is not None:
                trace.append((record.name, f"shadowed by {winner.plugin.name}"))
            else:
                trace.append((record.name, "accepted"))
                native = None if spec.native_sm is None else device.sm in spec.native_sm
                winner = OpStatus(op, True, f"{record.name} {record.manifest.version}",
                                  record, spec, native=native)
        if winner is not None:
            return dataclasses.replace(winner, trace=tuple(trace))
        if not trace:
            return OpStatus(op, False, "no installed plugin provides it")
        return OpStatus(op, False, "; ".join(f"{name}: {verdict}" for name, verdict in trace), trace=tuple(trace))

    def load(self, op: str, device: DeviceInfo) -> ModuleType:
        """Import (once) and return the compiled module serving ``op`` on ``device``."""
        status = self.op_status(op, device)
        if not status.usable:
            raise RuntimeError(f"{op}: {status.reason}")
        module = self._modules.get(status.spec.module)
        if module is None:
            with self._lock:  # one import per module, even when many threads arrive at once
                module = self._modules.get(status.spec.module)
                broken = self._broken.get((op, device.key))
                if broken is not None:  # another thread's import just failed
                    raise RuntimeError(f"{op}: {status.plugin.name}: {broken}")
                if module is None:
                    try:
                        module = self._import(status.spec.module)
                    except KeyboardInterrupt:
                        raise
                    except BaseException as exc:  # SystemExit included: the process goes on
                        reason = f"importing {status.spec.module} failed: {failure(exc)}"
                        self.mark_unusable(op, device, reason)
                        raise RuntimeError(f"{op}: {status.plugin.name}: {reason}") from exc
                    self._modules[status.spec.module] = module
        return module

    def mark_unusable(self, op: str, device: DeviceInfo, reason: str) -> None:
        """Record that ``op`` failed on ``device`` (import error, no kernel image...)."""
        with self._lock:
            if (op, device.key) in self._broken:
                return  # already marked (another thread got there first): one warning
            self._broken[(op, device.key)] = reason
            self._status.pop((op, device.key), None)
        warnings.warn(f"astrai: {op} disabled on {device.key}: {reason}; falling back",
                      PluginRejectedWarning, stacklevel=3)

    def rejections(self, device: DeviceInfo) -> list[tuple[str, str]]:
        """(plugin, reason) for every installed plugin that can't serve ``device``."""
        out = []
        for record in self.plugins():
            if record.rejected is not None:
                out.append((record.name, record.rejected))
            elif (reason := self.device_rejection(record.manifest, device)) is not None:
                out.append((record.name, reason))
        return out

    def _warn_rejections(self, device: DeviceInfo) -> None:
        """One warning per rejected plugin and CUDA device, at the first op lookup there."""
        if device.type != "cuda":
            return  # CUDA plugins never serve CPU tensors; that is not news
        for name, reason in self.rejections(device):
            if (name, device.key) not in self._warned:
                self._warned.add((name, device.key))
                warnings.warn(f"astrai: plugin {name} not used on {device.key}: {reason} "
                              "(see `astrai doctor`)", PluginRejectedWarning, stacklevel=4)
