"""``astrai doctor``: what is installed, what runs here, why, and how to get the rest."""

from __future__ import annotations

import json
import os
import platform
import re
import sys

import torch
from packaging.version import InvalidVersion, Version
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import __version__
from ..extension.device import DeviceInfo, driver_cuda_version, probe_device
from ..extension.install import PLUGIN_EXTRAS, PUBLISHED_CUDA, cuda_index_tag, index_is_published
from ..extension.op_names import (ATTN_DECODE, ATTN_PAGED_DECODE, ATTN_PAGED_PREFILL, ATTN_PREFILL,
                                  FP8_GEMM, FP8_QUANTIZE, FP8_SCALE_UPDATE, FP8_WEIGHT_GEMM, FUSED_ADD_RMS_NORM,
                                  RMS_NORM, ROPE_PAGED_APPEND, ROTARY_EMB, SILU_AND_MUL)
from ..extension.ops._plugin import PLUGIN_OF_OP
from ..extension.registry import OpStatus, Registry
from ..extension.runtime import current_runtime
from .checks import environment_problems, installed_entry_points, plugin_names
from .install_hint import INSTALLERS, extra_of, install_command
from .output import reader_may_leave

FALLBACKS = {
    ATTN_DECODE: "torch SDPA",
    ATTN_PREFILL: "torch SDPA",
    ATTN_PAGED_DECODE: "torch SDPA over gathered pages",
    ATTN_PAGED_PREFILL: "torch SDPA over gathered pages",
    ROTARY_EMB: "torch complex multiply",
    ROPE_PAGED_APPEND: "torch rotation, then PagedKVCache.append",
    RMS_NORM: "torch ops (transformers' RMSNorm, op by op)",
    FUSED_ADD_RMS_NORM: "torch add, then RMSNorm op by op",
    SILU_AND_MUL: "torch F.silu(gate) * up",
    FP8_QUANTIZE: "torch saturating cast",
    FP8_GEMM: "torch._scaled_mm (sm_89+) or dequantize-matmul emulation",
    FP8_SCALE_UPDATE: "torch ops (nine small kernels)",
    FP8_WEIGHT_GEMM: "torch float32 matmul of the dequantized weights",
}


def _disabled_reason() -> str:
    value = os.environ.get("ASTRAI_DISABLE_PLUGINS")
    return f"disabled (ASTRAI_DISABLE_PLUGINS={value})" if value is not None else "disabled (plugin discovery is off)"


def _cuda_of_version(version: str | None) -> tuple[int, int] | None:
    """The CUDA build a plugin distribution's local version names in its first segment:
    ``0.1.0+cu130`` and ``0.1.0+cu130.post1`` -> (13, 0); None without one."""
    try:
        local = (Version(version).local or "") if version else ""
    except InvalidVersion:
        return None
    found = re.fullmatch(r"cu(\d+)(\d)", local.split(".")[0])
    return None if found is None else (int(found[1]), int(found[2]))


def _plugin_rows(registry: Registry, device: DeviceInfo) -> list[dict]:
    """One row per installed plugin; with discovery disabled, the entry points unread."""
    if not registry.enabled:
        return [{"name": dist or ep, "entry_point": ep, "version": version, "cuda": None, "sass_archs": [],
                 "ptx_archs": [], "ops": [], "usable": False, "disabled": True, "reason": _disabled_reason()}
                for ep, dist, version in sorted(installed_entry_points(registry), key=lambda e: (e[1] or e[0], e[0]))]
    rows = []
    for record in registry.plugins():
        m = record.manifest
        reason = record.rejected or (registry.device_rejection(m, device) if m else None)
        rows.append({
            "name": record.name,
            "entry_point": record.entry_point,
            "version": str(m.version) if m else None,
            "cuda": m.cuda_text if m else None,
            "sass_archs": [str(a) for a in m.sass_archs] if m else [],
            "ptx_archs": [str(a) for a in m.ptx_archs] if m else [],
            "ops": sorted(m.ops) if m else [],
            "usable": reason is None,
            "disabled": False,
            "reason": reason or "usable on this device",
        })
    return rows


def backend_name(op: str, status: OpStatus, device: DeviceInfo, kernel: bool | None = None) -> str:
    """What runs ``op`` on ``device``, in the words doctor uses: the plugin's CUDA kernel or
    the torch fallback. ``kernel`` says whether a call took the kernel (``astrai bench``
    knows); None: whenever the plugin is usable (doctor's view)."""
    if kernel is None:
        kernel = status.usable and status.native is not False
    if kernel:
        return f"CUDA kernel from {status.reason}"
    if status.usable and status.native is False:
        return f"{FALLBACKS[op]} (the {status.plugin.name} kernel is emulated on sm_{device.sm})"
    return FALLBACKS[op]


def _op_rows(registry: Registry, device: DeviceInfo) -> list[dict]:
    rows = []
    for op in PLUGIN_OF_OP:
        status = registry.op_status(op, device)
        rows.append({"op": op, "backend": backend_name(op, status, device), "plugin_status": status.reason})
    return rows


def _installed(registry: Registry) -> tuple[str | None, tuple[int, int] | None]:
    """The extra that reinstalls the project's plugins installed here (disabled, denied or
    broken ones too), and their CUDA build: from a manifest, else from a distribution's
    version (``0.1.0+cu130``), else the newest published build; None only without plugins."""
    extras, cuda = set(), None
    for record in registry.plugins():
        extra = PLUGIN_EXTRAS.get(record.name) or PLUGIN_EXTRAS.get(record.distribution or "")
        if extra is not None:
            extras.add(extra)
            if record.manifest is not None and record.manifest.cuda is not None:
                cuda = cuda or record.manifest.cuda
    for _, dist, version in installed_entry_points(registry):  # the ones no manifest describes
        if dist in PLUGIN_EXTRAS:
            extras.add(PLUGIN_EXTRAS[dist])
            cuda = cuda or _cuda_of_version(version)
    if extras and cuda is None:
        cuda = PUBLISHED_CUDA[0]
    return extra_of(extras), cuda


def _install_commands(device: DeviceInfo, registry: Registry) -> dict:
    """Per installer, the command that gives this machine what it should have: the plugins
    installed here (all of them when none is) from the build the driver runs, or, without
    a usable driver, the build installed here (the core alone when no plugin is)."""
    extra, installed_cuda = _installed(registry)
    driver = device.driver_cuda if cuda_index_tag(device.driver_cuda) is not None else installed_cuda
    commands = {kind: install_command(driver, kind, extra or "all") for kind in INSTALLERS}
    if device.type != "cuda" or cuda_index_tag(device.driver_cuda) is None:
        why = "no CUDA device" if device.type != "cuda" else "the driver is too old for any published build"
        commands["note"] = (f"{why}: the torch fallbacks serve every op; the plugins need an NVIDIA GPU "
                            "with a CUDA 12.4+ driver")
    if not index_is_published():
        commands["unpublished"] = ("no release is published on these indexes and channels yet: build "
                                   "the wheels and a local index from source (docs/install.md, "
                                   "'From source'), or set ASTRAI_INDEX_URL to an index you serve")
    return commands


def collect(runtime=None) -> dict:
    """Everything the doctor knows, as plain data (``--json`` prints exactly this)."""
    runtime = runtime or current_runtime()
    device = probe_device()
    return {
        "astrai": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver_cuda": None if driver_cuda_version() is None else "%d.%d" % driver_cuda_version(),
        "device": device.describe(),
        "plugins_disabled": None if runtime.registry.enabled else _disabled_reason(),
        "environment": environment_problems(os.environ, plugin_names(runtime.registry)),
        "plugins": _plugin_rows(runtime.registry, device),
        "ops": _op_rows(runtime.registry, device),
        "install": _install_commands(device, runtime.registry),
    }


def render(report: dict, console: Console) -> None:
    """The report as tables; every text from outside (plugin names, reasons, commands with
    ``astrai[all]``) is escaped, or rich would read its brackets as markup and drop them."""
    console.print(f"[bold]astrai {report['astrai']}[/bold]  python {report['python']}  "
                  f"torch {escape(report['torch'])} (CUDA {report['torch_cuda'] or 'none'})")
    console.print(f"driver CUDA: {report['driver_cuda'] or 'none'}   device: {escape(report['device'])}")
    for problem in report["environment"]:
        console.print(f"[red]environment:[/red] {escape(problem)}", soft_wrap=True, highlight=False)

    plugins = Table(title="plugins (entry-point group astrai.kernels)")
    for column in ("plugin", "version", "CUDA", "archs", "ops", "status"):
        plugins.add_column(column)
    for row in report["plugins"]:
        archs = " ".join(row["sass_archs"] + row["ptx_archs"])
        if row["usable"]:
            status = "[green]usable[/green]"
        elif row["disabled"]:
            status = f"[yellow]{escape(row['reason'])}[/yellow]"
        else:
            status = f"[red]unusable[/red]: {escape(row['reason'])}"
        plugins.add_row(escape(row["name"]), escape(row["version"] or "-"), row["cuda"] or "-", archs,
                        " ".join(row["ops"]), status)
    if not report["plugins"]:
        plugins.add_row("(none installed)", "", "", "", "", "")
    console.print(plugins)
    if report["plugins_disabled"]:
        console.print(f"[yellow]plugins {escape(report['plugins_disabled'])}: the torch fallbacks serve every op"
                      "[/yellow]", soft_wrap=True)

    ops = Table(title="what each op runs here")
    ops.add_column("op")
    ops.add_column("backend")
    for row in report["ops"]:
        ops.add_row(row["op"], escape(row["backend"]))
    console.print(ops)

    install = report["install"]
    if "note" in install:
        console.print(f"[yellow]{escape(install['note'])}[/yellow]")
    for kind in ("pip", "conda", "pixi"):
        if kind in install:
            console.print(f"install ({kind}): {escape(install[kind])}", soft_wrap=True)
    if "unpublished" in install:
        console.print(f"[yellow]{escape(install['unpublished'])}[/yellow]", soft_wrap=True)


def main(args) -> int:
    report = collect()
    with reader_may_leave():
        if args.json:
            json.dump(report, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            render(report, Console(width=160))
    return 0
