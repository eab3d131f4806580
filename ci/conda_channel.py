"""A local conda channel made from built wheels, with the metadata of ``recipe/``.

Used by ``ci/check-conda``. No conda channel is reachable from the CI machine, so the
packages are not built by rattler-build from sources; instead:

1. ``recipe/recipe.yaml`` is rendered with ``recipe/variants.yaml`` (rattler-build's own
   renderer), giving each output's name, version, build string and run requirements per
   (CUDA version, Python) variant;
2. each wheel is matched to its variant (``astrai_elementwise-0.1.0+cu124-cp311-...`` ->
   ``astrai-elementwise``, CUDA 12.4, Python 3.11) and repackaged as that conda package: the
   wheel installed by PyPA ``installer`` (``site-packages``, ``.data/``, console scripts
   such as ``bin/astrai``), the rendered run requirements as ``depends``
   (the plugin's ``python`` pinned to its minor, as python's run-exports would);
3. the dependencies that live outside this project (python, pytorch, numpy, ...,
   ``cuda-version``) are added as empty *stand-in* packages carrying the host's versions
   (python's holds ``bin/python``, which starts the host's interpreter),
   and ``cuda-version X.Y`` constrains ``__cuda >=X`` exactly like conda-forge's;
4. the folder is indexed into a channel (``repodata.json`` per subdir).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import platform
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# ASTRAI_RECIPE_DIR points at another recipe folder (tests use it to show a broken one failing)
RECIPE_DIR = Path(os.environ.get("ASTRAI_RECIPE_DIR", ROOT / "recipe"))
RECIPE = RECIPE_DIR / "recipe.yaml"
VARIANTS = RECIPE_DIR / "variants.yaml"
# conda package name -> the host distribution whose version a stand-in carries
HOST_DISTRIBUTIONS = {"pytorch": "torch"}

# One fixed timestamp for every package made here: reproducible archives, and no build can
# win a solve by being made later (the solver must prefer cu130 for its cuda-version).
TIMESTAMP = datetime(2026, 1, 1, tzinfo=timezone.utc)
# the interpreter console scripts are staged with, then replaced (see _stage_wheel)
SCRIPT_PLACEHOLDER = "/placeholder/bin/python"


class ChannelError(RuntimeError):
    """A wheel, the recipe or the host does not fit: the message says which and why."""


@dataclass(frozen=True)
class Output:
    """One rendered recipe output: a conda package to make."""

    name: str
    version: str
    build_string: str
    noarch: str | None
    depends: tuple[str, ...]
    variant: dict
    summary: str
    license: str
    homepage: str

    @property
    def cuda(self) -> str | None:
        return self.variant.get("cuda_compiler_version") if self.noarch is None else None

    @property
    def python(self) -> str | None:
        return self.variant.get("python") if self.noarch is None else None


@dataclass(frozen=True)
class WheelInfo:
    path: Path
    name: str  # conda / normalized distribution name
    base_version: str
    cuda: str | None  # "12.4" from a +cu124 local tag
    python: str | None  # "3.11" from cp311, None for py3-none-any
    platform_tag: str


@dataclass
class Channel:
    path: Path
    packages: list[Output] = field(default_factory=list)  # made from wheels
    standins: list[str] = field(default_factory=list)  # "pytorch 2.13.0", ...
    skipped: list[str] = field(default_factory=list)  # wheels for another Python than the host's


def conda_subdir() -> str:
    machine = platform.machine()
    return {"x86_64": "linux-64", "aarch64": "linux-aarch64"}.get(machine, f"linux-{machine}")


def render_recipe(target_platform: str | None = None) -> list[Output]:
    """Every distinct output of the recipe over the variant matrix."""
    from rattler_build import Stage0Recipe, VariantConfig
    from rattler_build.render import RenderConfig
    from rattler_build.tool_config import PlatformConfig

    recipe = Stage0Recipe.from_file(str(RECIPE))
    variants = VariantConfig.from_file(str(VARIANTS))
    config = RenderConfig(platform=PlatformConfig(target_platform=target_platform or conda_subdir()))
    outputs: dict[tuple[str, str], Output] = {}
    for rendered in recipe.render(variants, config):
        r = rendered.recipe
        about = r.about
        noarch = r.build.noarch
        key = (r.package.name, r.build.string)
        outputs.setdefault(key, Output(
            name=r.package.name,
            version=str(r.package.version),
            build_string=r.build.string,
            noarch=None if noarch in (None, "none") else str(noarch),
            depends=tuple(str(d) for d in r.requirements.run),
            variant=dict(rendered.variant),
            summary=about.summary or "",
            license=about.license or "",
            homepage=about.homepage or "",
        ))
    return list(outputs.values())


def read_wheel_name(path: Path) -> WheelInfo:
    try:
        name, version, _build, tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        raise ChannelError(f"{path.name}: not a wheel file name ({exc})") from None
    cuda = None
    if version.local:  # the CUDA tag is the first local segment: +cu130, +cu130.post1
        tag = re.fullmatch(r"cu(\d+)(\d)", version.local.split(".")[0])
        if not tag:
            raise ChannelError(f"{path.name}: local version {version.local!r} is not a CUDA tag like cu124")
        cuda = f"{tag[1]}.{tag[2]}"
    cpython = sorted(t.interpreter for t in tags if re.fullmatch(r"cp3\d+", t.interpreter))
    python = f"3.{cpython[0][3:]}" if cpython else None
    return WheelInfo(path, name, version.base_version, cuda, python, ".".join(sorted({t.platform for t in tags})))


def output_for(wheel: WheelInfo, outputs: list[Output]) -> Output:
    """The recipe output a wheel becomes, or a ChannelError naming what does not match."""
    named = [o for o in outputs if o.name == wheel.name]
    if not named:
        raise ChannelError(f"{wheel.path.name}: recipe/recipe.yaml has no output named {wheel.name!r}")
    if named[0].noarch == "python":
        if wheel.cuda or wheel.python:
            raise ChannelError(f"{wheel.path.name}: {wheel.name} is noarch: python in the recipe, the wheel is not pure")
        match = named[0]
    else:
        if wheel.cuda is None or wheel.python is None:
            raise ChannelError(f"{wheel.path.name}: a CUDA plugin wheel needs a +cuXY tag and a cpXY tag")
        found = [o for o in named if o.cuda == wheel.cuda and o.python == wheel.python]
        if not found:
            have = sorted({(o.cuda, o.python) for o in named})
            raise ChannelError(f"{wheel.path.name}: the recipe builds {wheel.name} for (CUDA, Python) in {have}, "
                               f"not ({wheel.cuda}, {wheel.python}); add it to recipe/variants.yaml")
        match = found[0]
    if match.version != wheel.base_version:
        raise ChannelError(f"{wheel.path.name}: version {wheel.base_version} != recipe version {match.version}")
    return match


def _assemble(*args, **kwargs):
    from rattler_build import assemble_package

    return assemble_package(*args, timestamp=TIMESTAMP, **kwargs)


def _stage_wheel(wheel: WheelInfo, output: Output, staging: Path) -> None:
    """Install the wheel into ``staging`` as pip would (``.data/``, console scripts and all), in
    its conda package's layout. Scripts start ``#!/usr/bin/env python``, as conda-build writes
    them for a noarch package: the environment's python once it is activated."""
    from installer import install
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    if output.noarch == "python":  # conda's noarch layout: linked under lib/pythonX.Y/ and bin/
        site, scripts = "site-packages", "python-scripts"
    else:
        site, scripts = f"lib/python{wheel.python}/site-packages", "bin"
    scheme = {"purelib": site, "platlib": site, "scripts": scripts, "data": ".", "headers": "include"}
    # A short fixed interpreter, replaced below: installer writes a plain `#!path` line only for
    # paths under 127 bytes (a /bin/sh trampoline otherwise), and the staging folder can be longer.
    destination = SchemeDictionaryDestination({k: str(staging / v) for k, v in scheme.items()},
                                              interpreter=SCRIPT_PLACEHOLDER, script_kind="posix")
    with WheelFile.open(wheel.path) as source:
        install(source, destination, additional_metadata={"INSTALLER": b"conda\n"})
    for script in (staging / scripts).glob("*"):
        first, rest = script.read_bytes().split(b"\n", 1)
        if first != f"#!{SCRIPT_PLACEHOLDER}".encode():
            raise ChannelError(f"{wheel.path.name}: console script {script.name} starts {first[:80]!r}, "
                               f"not the #!{SCRIPT_PLACEHOLDER} line it was written with")
        script.write_bytes(b"#!/usr/bin/env python\n" + rest)


def _depends(output: Output) -> list[str]:
    if output.noarch is not None:
        return list(output.depends)
    # python in host exports `python X.Y.*` at build time; the render leaves a bare `python`.
    return [f"python {output.python}.*" if d == "python" else d for d in output.depends]


def _host_version(name: str) -> str:
    if name == "python":
        return platform.python_version()
    dist = HOST_DISTRIBUTIONS.get(name, name)
    try:
        return Version(importlib.metadata.version(dist)).base_version
    except importlib.metadata.PackageNotFoundError as exc:
        raise ChannelError(f"the packages need {name!r}, which this Python does not have ({dist} is not installed)") from exc


def _python_standin(folder: Path) -> Path:
    """The python stand-in's files: bin/python starting this host's interpreter, which the
    packages' console scripts name in their first line."""
    shutil.rmtree(folder, ignore_errors=True)
    script = folder / "bin" / "python"
    script.parent.mkdir(parents=True)
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    script.chmod(0o755)
    return folder


def _add_standins(channel: Channel, made: list[Output], all_outputs: list[Output]) -> None:
    ours = {o.name for o in all_outputs}
    needed = sorted({d.split()[0] for o in made for d in _depends(o)} - ours)
    for name in needed:
        if name.startswith("__"):
            continue
        if name == "cuda-version":
            for cuda in sorted({o.cuda for o in all_outputs if o.cuda}):
                _assemble(name, cuda, "noarch", "standin_0", channel.path / "noarch", files=[],
                                 noarch="generic", constrains=[f"__cuda >={cuda.split('.')[0]}"],
                                 summary="stand-in for conda-forge's cuda-version: constrains __cuda to its major")
                channel.standins.append(f"cuda-version {cuda} (constrains __cuda >={cuda.split('.')[0]})")
            continue
        version = _host_version(name)
        subdir = conda_subdir() if name == "python" else "noarch"
        files = {"files": []}
        if name == "python":
            files = {"files_dir": _python_standin(channel.path.parent / "python-standin")}
        _assemble(name, version, subdir, "standin_0", channel.path / subdir, **files,
                         noarch=None if name == "python" else "generic",
                         summary=f"stand-in: {name} {version} is the host's own (no conda channel reachable)")
        channel.standins.append(f"{name} {version}")


def make_channel(wheels: list[Path], path: Path) -> Channel:
    """Repackage ``wheels`` as the recipe's conda packages, add stand-ins, index ``path``."""
    from rattler.index import index_fs
    if path.exists():
        shutil.rmtree(path)
    subdir = conda_subdir()
    for folder in ("noarch", subdir):
        (path / folder).mkdir(parents=True)
    outputs = render_recipe(subdir)
    channel = Channel(path)
    staging_root = path.parent / (path.name + "-staging")
    shutil.rmtree(staging_root, ignore_errors=True)
    for wheel_path in sorted(wheels):
        wheel = read_wheel_name(wheel_path)
        output = output_for(wheel, outputs)
        if wheel.python is not None and wheel.python != "%d.%d" % sys.version_info[:2]:
            channel.skipped.append(f"{wheel_path.name} (Python {wheel.python}; this host runs "
                                   f"{sys.version_info[0]}.{sys.version_info[1]} and can only import its own)")
            continue
        staging = staging_root / wheel_path.stem
        _stage_wheel(wheel, output, staging)
        _assemble(output.name, output.version, "noarch" if output.noarch else subdir, output.build_string,
                         path / ("noarch" if output.noarch else subdir), files_dir=staging,
                         depends=_depends(output), noarch=output.noarch, summary=output.summary,
                         license=output.license, homepage=output.homepage)
        channel.packages.append(output)
    shutil.rmtree(staging_root, ignore_errors=True)
    made = {o.name for o in channel.packages}
    meta = [o for o in outputs if o.name == "astrai-kernels"]
    plugins = {d.split()[0] for o in meta for d in o.depends}
    if meta and plugins <= made:
        # the all-in-one metapackage: only installable once every package it names is there
        _assemble(meta[0].name, meta[0].version, "noarch", meta[0].build_string, path / "noarch",
                         files=[], noarch="generic", depends=list(meta[0].depends), summary=meta[0].summary,
                         license=meta[0].license, homepage=meta[0].homepage)
        channel.packages.append(meta[0])
    _add_standins(channel, channel.packages, outputs)
    asyncio.run(index_fs(path, write_zst=False, write_shards=False, force=True))
    return channel


def describe(channel: Channel) -> str:
    lines = [f"channel {channel.path}"]
    lines += [f"  {o.name} {o.version} {o.build_string}" for o in channel.packages]
    lines += [f"  stand-in {s}" for s in channel.standins]
    lines += [f"  skipped {s}" for s in channel.skipped]
    return "\n".join(lines)
