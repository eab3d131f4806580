"""What the CLI checks before any work starts: optional dependencies, output paths and the
environment variables astrai reads. A failed check is a :class:`UsageError`, which
``astrai`` prints as one line per problem (``astrai bench: ...``) and answers with exit
status 2.

>>> for problem in environment_problems({"ASTRAI_DEBUG": "maybe"}, plugin_names=set()):
...     print(problem)
ASTRAI_DEBUG='maybe' turns the debug checks on (any value but '' and '0' does): set 1 (on) or 0 (off)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Iterable, Mapping

from packaging.requirements import Requirement

from ..extension import ATTN_BACKEND
from ..extension.install import PLUGIN_EXTRAS
from ..extension.registry import DISABLING_VALUES

USAGE_EXIT = 2  # what argparse answers a bad command line with

# ASTRAI_DISABLE_PLUGINS: the registry disables plugins on these values only
DISABLING = DISABLING_VALUES
NOT_DISABLING = ("", "0", "false", "no")


class UsageError(Exception):
    """A mistake the user can fix (a value, a missing extra): the message says how."""


def require(module: str, extra: str, use: str) -> None:
    """Import ``module`` for ``use`` (``"--plot"``) or raise a :class:`UsageError` naming
    the extra that installs it; where astrai's metadata pins a version, check it too."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(f"{use} needs {module} ({exc}): pip install 'astrai[{extra}]'") from None
    pin = _pin(module, extra)
    if pin is None:
        return
    try:
        found = importlib.metadata.version(pin.name)
    except importlib.metadata.PackageNotFoundError:
        return  # importable without metadata (a source tree): nothing to compare
    if not pin.specifier.contains(found, prereleases=True):
        raise UsageError(f"{use} needs {pin.name}{pin.specifier}, found {found}: pip install 'astrai[{extra}]'")


def _pin(distribution: str, extra: str) -> Requirement | None:
    """The requirement on ``distribution`` that astrai's ``extra`` declares, if any."""
    try:
        requires = importlib.metadata.requires("astrai") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == distribution and req.marker is not None and req.marker.evaluate({"extra": extra}):
            return req
    return None


def writable(path: str | None, option: str) -> None:
    """``option FILE`` can be written: its folder exists and ``FILE`` is not a folder."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a folder, give a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: the folder {folder} is not writable")


def known_plugin_names() -> set[str]:
    """The project's plugin names, as distributions and entry points (``astrai-fp8``, ``fp8``)."""
    return set(PLUGIN_EXTRAS) | set(PLUGIN_EXTRAS.values())


def environment_problems(environ: Mapping[str, str], plugin_names: Iterable[str]) -> list[str]:
    """One line per environment variable whose value astrai would misread or reject, with
    the values it takes. ``plugin_names``: the entry-point and distribution names of the
    plugins installed here (``ASTRAI_PLUGINS_ALLOW`` / ``_DENY`` match those)."""
    problems = []
    backend = environ.get("ASTR_BACKEND")
    valid_backends = {b.value for b in ATTN_BACKEND}
    if backend is not None and backend.strip() and backend.strip().lower() not in valid_backends:
        problems.append(f"ASTR_BACKEND={backend!r} is not an attention backend: valid values are "
                        f"{', '.join(b.value for b in ATTN_BACKEND)} (or unset)")
    debug = environ.get("ASTRAI_DEBUG")
    if debug is not None and debug not in ("", "0", "1"):
        problems.append(f"ASTRAI_DEBUG={debug!r} turns the debug checks on (any value but '' and '0' "
                        "does): set 1 (on) or 0 (off)")
    disable = environ.get("ASTRAI_DISABLE_PLUGINS")
    if disable is not None and disable not in DISABLING + NOT_DISABLING:
        problems.append(f"ASTRAI_DISABLE_PLUGINS={disable!r} leaves the plugins enabled: "
                        f"{', '.join(DISABLING)} disable them; {', '.join(repr(v) for v in NOT_DISABLING)} "
                        "or unset keep them")
    installed = set(plugin_names)
    for name in ("ASTRAI_PLUGINS_ALLOW", "ASTRAI_PLUGINS_DENY"):
        raw = environ.get(name)
        if raw is None:
            continue
        unknown = [part.strip() for part in raw.split(",")
                   if part.strip() and part.strip() not in installed | known_plugin_names()]
        if unknown:
            listed = ", ".join(sorted(installed)) or "none installed"
            problems.append(f"{name}: {', '.join(repr(u) for u in unknown)} names no plugin: valid are the "
                            f"installed plugins' names ({listed}) or the project's "
                            f"({', '.join(sorted(known_plugin_names()))})")
    return problems


def check_environment(plugin_names: Iterable[str]) -> None:
    """Raise a :class:`UsageError` listing :func:`environment_problems` of ``os.environ``."""
    problems = environment_problems(os.environ, plugin_names)
    if problems:
        raise UsageError("\n".join(problems))


def installed_entry_points(registry) -> list[tuple[str, str | None, str | None]]:
    """(entry-point name, distribution, its version) of every entry point in ``registry``'s
    group, read without loading any, whether or not the registry is enabled (doctor shows
    what ``ASTRAI_DISABLE_PLUGINS`` disabled)."""
    try:
        eps = registry.entry_points()
    except Exception:  # broken metadata: the registry reports it as a rejected plugin
        return []
    out = []
    for ep in eps:
        dist = getattr(ep, "dist", None)
        out.append((ep.name, getattr(dist, "name", None), getattr(dist, "version", None)))
    return out


def plugin_names(registry) -> set[str]:
    """The names ``ASTRAI_PLUGINS_ALLOW`` / ``_DENY`` match for the plugins installed here."""
    return {name for ep, dist, _ in installed_entry_points(registry) for name in (ep, dist) if name}
