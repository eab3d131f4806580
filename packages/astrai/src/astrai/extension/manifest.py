"""Plugin manifests: the one document the core reads about a plugin (docs/plugins.md).

``parse_manifest`` turns the raw dict an entry point returns into a frozen ``Manifest``
or raises ``ManifestError`` naming the offending key. Nothing here imports plugin code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

API_VERSION = 1

_SASS = re.compile(r"^sm_(\d+)(\d)([af]?)$")
_PTX = re.compile(r"^compute_(\d+)(\d)([af]?)$")


class ManifestError(ValueError):
    """A manifest is malformed; the message names the key."""


@dataclass(frozen=True)
class Arch:
    """One compiled target: sm_90a is Arch(9, 0, "a", ptx=False)."""

    major: int
    minor: int
    suffix: str
    ptx: bool

    @classmethod
    def parse(cls, text: str, *, ptx: bool) -> Arch:
        match = (_PTX if ptx else _SASS).match(text)
        if match is None:
            raise ValueError(text)
        return cls(int(match[1]), int(match[2]), match[3], ptx)

    def __str__(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.major}{self.minor}{self.suffix}"

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Can a device of this compute capability run this code?

        SASS runs on its own major at an equal or higher minor; arch-specific ("a")
        code only on exactly its arch; family ("f") code on its major. PTX is JIT
        compiled by the driver for any newer device, except arch-specific PTX.
        """
        major, minor = capability
        if self.suffix == "a":
            return (major, minor) == (self.major, self.minor)
        if self.ptx:
            return (major, minor) >= (self.major, self.minor)
        return major == self.major and minor >= self.minor


@dataclass(frozen=True)
class OpSpec:
    name: str
    module: str
    abi: int
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...] | None = None
    min_sm: int | None = None
    native_sm: tuple[int, ...] | None = None
    # attention variant features the op's kernels apply (backend/attention/variant.FEATURES);
    # a plugin that states none takes plain attention only
    variants: tuple[str, ...] = ()
    # the cache page dtypes the op's kernels read besides its dtypes (FP8 KV caches)
    kv_dtypes: tuple[str, ...] = ()
    # optional per-arch measured tables, kept raw: the op's policy validates them, so a
    # malformed one costs only the preference, never the plugin (docs/plugins.md)
    prefer: object = field(default=None, compare=False, hash=False)

    def unsupported(self, dtype: str, head_dim: int | None = None) -> str | None:
        """Why this op, as its manifest states it, cannot take ``dtype`` (a torch dtype name:
        ``"bfloat16"``) or ``head_dim``; None when it can. The one statement of an op's
        capabilities the core reads (backends keep no copy of their own)."""
        if self.dtypes and dtype not in self.dtypes:
            return f"{self.name} takes {' or '.join(self.dtypes)}, got {dtype}"
        if head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            dims = ", ".join(str(d) for d in self.head_dims)
            return f"{self.name} supports head_dim {dims}, got {head_dim}"
        return None


@dataclass(frozen=True)
class Manifest:
    api_version: int
    name: str
    version: Version
    core_requires: SpecifierSet
    cuda: tuple[int, int] | None
    sass_archs: tuple[Arch, ...]
    ptx_archs: tuple[Arch, ...]
    ops: Mapping[str, OpSpec]

    @property
    def cuda_text(self) -> str:
        return "none (CPU only)" if self.cuda is None else "%d.%d" % self.cuda


def _get(raw: Mapping, key: str, kind: type | tuple[type, ...], where: str = "manifest"):
    if key not in raw:
        raise ManifestError(f"{where} is missing key {key!r}")
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ManifestError(f"{where} key {key!r} must be {names}, got {type(value).__name__}")
    return value


def _str_list(raw: Mapping, key: str, where: str) -> list[str]:
    value = _get(raw, key, list, where)
    if not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{where} key {key!r} must be a list of strings")
    return value


def _int_list(raw: Mapping, key: str, where: str) -> tuple[int, ...] | None:
    if raw.get(key) is None:
        return None
    value = _get(raw, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ManifestError(f"{where} key {key!r} must be a list of integers")
    return tuple(value)


def _archs(raw: Mapping, key: str, *, ptx: bool) -> tuple[Arch, ...]:
    out = []
    for text in _str_list(raw, key, "manifest"):
        try:
            out.append(Arch.parse(text, ptx=ptx))
        except ValueError:
            form = "compute_XY" if ptx else "sm_XY"
            raise ManifestError(f"manifest key {key!r}: {text!r} is not of the form {form}") from None
    return tuple(out)


def _op(name: str, raw: object) -> OpSpec:
    where = f"op {name!r}"
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{where} must be a dict, got {type(raw).__name__}")
    min_sm = raw.get("min_sm")
    if min_sm is not None:
        min_sm = _get(raw, "min_sm", int, where)
    return OpSpec(name=name, module=_get(raw, "module", str, where), abi=_get(raw, "abi", int, where),
                  dtypes=tuple(_str_list(raw, "dtypes", where)),
                  head_dims=_int_list(raw, "head_dims", where), min_sm=min_sm,
                  native_sm=_int_list(raw, "native_sm", where), prefer=raw.get("prefer"),
                  variants=tuple(_str_list(raw, "variants", where)) if "variants" in raw else (),
                  kv_dtypes=tuple(_str_list(raw, "kv_dtypes", where)) if "kv_dtypes" in raw else ())


class UnsupportedApiVersion(ManifestError):
    pass


def parse_manifest(raw: object) -> Manifest:
    if not isinstance(raw, Mapping):
        raise ManifestError(f"manifest must be a dict, got {type(raw).__name__}")
    api = _get(raw, "api_version", int)
    if api != API_VERSION:
        advice = "upgrade astrai" if api > API_VERSION else "upgrade the plugin"
        raise UnsupportedApiVersion(f"plugin API version {api}, this core speaks {API_VERSION}: {advice}")
    name = _get(raw, "name", str)
    try:
        version = Version(_get(raw, "version", str))
    except InvalidVersion:
        raise ManifestError(f"manifest key 'version': {raw['version']!r} is not a PEP 440 version") from None
    try:
        core_requires = SpecifierSet(_get(raw, "core_requires", str))
    except InvalidSpecifier:
        raise ManifestError(f"manifest key 'core_requires': {raw['core_requires']!r} "
                            "is not a PEP 440 specifier") from None
    cuda = raw.get("cuda")
    if cuda is not None:
        match = re.fullmatch(r"(\d+)\.(\d+)(\.\d+)?", _get(raw, "cuda", str))
        if match is None:
            raise ManifestError(f"manifest key 'cuda': {cuda!r} is not a version like '13.0'")
        cuda = (int(match[1]), int(match[2]))
    ops = _get(raw, "ops", Mapping)
    return Manifest(api_version=api, name=name, version=version, core_requires=core_requires,
                    cuda=cuda, sass_archs=_archs(raw, "sass_archs", ptx=False),
                    ptx_archs=_archs(raw, "ptx_archs", ptx=True),
                    ops={op: _op(op, spec) for op, spec in ops.items()})
