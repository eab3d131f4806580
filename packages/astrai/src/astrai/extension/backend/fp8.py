"""FP8 quantize / GEMM policy: which implementation runs each call, and why.

GEMM (``scale * a @ b + bias`` -> bf16), in priority order:

1. ``plugin``    the astrai-fp8 kernel, when the registry says ``fp8_gemm`` is usable on
                 the device *and* its manifest marks the GEMM native there (``native_sm``)
                 *and*, where the manifest ships a measured table for the arch (``prefer``,
                 see ``prefer``), the nearest measured shape class says it beats
                 cuBLASLt; the trace carries the measured ratio either way. On sm_90 the
                 mma.sync kernel is an fp16 emulation: a build without the Hopper wgmma
                 mainloop is never chosen there, and the trace says so. With it, operands
                 are handed over K-major (see ``K_MAJOR_ONLY_SM``).
2. ``scaled_mm`` ``torch._scaled_mm`` (cuBLASLt) on CUDA sm_89+ (not for e5m2 x e5m2,
                 which cuBLASLt lacks).
3. ``emulated``  dequantize to float32 and matmul: any device, the same function.

Quantize: ``plugin`` (``fp8_quantize`` usable for the input dtype) > ``torch`` (a saturating
cast, ``backend.fp8_torch.quantize``).

Decisions go through the runtime's resolver, keyed by (device, arch, formats/dtype and, for
the GEMM, the shape class: M rounded up to a power of two, N, K), so
a repeated call costs a dict lookup and ``current_runtime().explain("fp8_gemm")`` shows
every candidate's verdict. ``backend=`` forces one implementation (strict: it raises if
that one can't run the call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compiling import assume_constant_result
from ..device import DeviceInfo, probe_device
from ..op_names import FP8_GEMM, FP8_QUANTIZE, FP8_SCALE_UPDATE
from ..ops import fp8 as ops_fp8
from ..runtime import Runtime, current_runtime
from . import fp8_torch, prefer
from .fp8_torch import FP8_DTYPES, FP8_FORMATS, QUANTIZE_INPUT_DTYPES

GEMM_BACKENDS = ("plugin", "scaled_mm", "emulated")
QUANTIZE_BACKENDS = ("plugin", "torch")
_MIN_SM_SCALED_MM = 89
# Archs whose native FP8 tensor-core path reads both operands K-major only: Hopper's wgmma
# has no transpose for 8-bit types, and astrai-fp8 runs other layouts there on its emulated
# mma.sync path. The policy therefore copies operands K-major before such a GEMM (as it
# does for cuBLASLt everywhere); ``wants_k_major`` lets callers produce them that way.
K_MAJOR_ONLY_SM = frozenset({90})
_E5M2 = "float8_e5m2"
# The accumulation both GEMM paths run (the plugin promotes every 128 of K, cuBLASLt runs
# with use_fast_accum=False): the measured table's mode the policy compares.
GEMM_MODE = "promote"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Fp8Call:
    """What the policy needs to know about one call: device facts and element formats."""

    device: DeviceInfo
    dtypes: tuple[str, ...]  # torch dtype names the plugin must list: GEMM (a, b); quantize (x,)
    shape: tuple[int, int, int] | None = None  # GEMM shape class (M bucket, N, K), if known
    mode: str = GEMM_MODE


def shape_class(m: int, n: int, k: int) -> tuple[int, int, int]:
    """The GEMM's decision class: M rounded up to a power of two (token counts vary per
    call; weight shapes do not), N and K as they are."""
    return (1 << max(int(m) - 1, 0).bit_length(), int(n), int(k))


# -- candidates -------------------------------------------------------------------------


class _PluginOp:
    """The astrai-fp8 kernel for ``op``; capable where the registry accepts it natively."""

    name = "plugin"

    def __init__(self, op: str, runtime: Runtime):
        self.op = op
        self.runtime = runtime

    def check(self, call: Fp8Call) -> str | None:
        if call.device.type != "cuda":
            return f"{call.device.describe()}: the plugin kernels run on CUDA devices"
        status = self.runtime.registry.op_status(self.op, call.device)
        if not status.usable:
            return status.reason
        missing = [d for d in call.dtypes if d not in status.spec.dtypes]
        if missing:
            return f"{status.reason} lists dtypes {list(status.spec.dtypes)}, not {missing}"
        if status.native is False:
            native = ", ".join(f"sm_{sm}" for sm in status.spec.native_sm) or "no arch"
            return (f"{status.reason} runs {self.op} emulated on sm_{call.device.sm} "
                    f"(native only on {native}); not used there")
        verdict = self._measured(status, call)
        if verdict is not None and not verdict.plugin_faster:
            return f"{status.reason}: {verdict.reason}"
        return None

    def _measured(self, status, call: Fp8Call) -> prefer.Verdict | None:
        return prefer.verdict(status.spec.prefer, call.device.sm, call.shape, call.mode)

    def why_capable(self, call: Fp8Call) -> str | None:
        """The trace's reason when the plugin wins: the measured ratio, where there is one."""
        status = self.runtime.registry.op_status(self.op, call.device)
        verdict = self._measured(status, call) if status.usable else None
        return None if verdict is None else f"{status.reason}: {verdict.reason}"


class _ScaledMm:
    name = "scaled_mm"

    def check(self, call: Fp8Call) -> str | None:
        if call.device.type != "cuda":
            return f"{call.device.describe()}: torch._scaled_mm needs a CUDA device"
        if call.device.sm is None or call.device.sm < _MIN_SM_SCALED_MM:
            return f"torch._scaled_mm needs sm_{_MIN_SM_SCALED_MM}+, device is sm_{call.device.sm}"
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no _scaled_mm"
        if call.dtypes == (_E5M2, _E5M2):
            return "cuBLASLt has no e5m2 x e5m2 GEMM"
        return None


class _Always:
    def __init__(self, name: str):
        self.name = name

    def check(self, call: Fp8Call) -> str | None:
        return None


def _gemm_candidates(runtime: Runtime) -> list:
    return [_PluginOp(FP8_GEMM, runtime), _ScaledMm(), _Always("emulated")]


def _quantize_candidates(runtime: Runtime) -> list:
    return [_PluginOp(FP8_QUANTIZE, runtime), _Always("torch")]


class _Candidates:
    """The candidate list, built only when the resolver decides (a cache miss): a repeated
    call then costs the resolver's dict lookup and no objects."""

    def __init__(self, build, runtime: Runtime):
        self._build, self._runtime, self._list = build, runtime, None

    def _get(self) -> list:
        if self._list is None:
            self._list = self._build(self._runtime)
        return self._list

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, index):
        return self._get()[index]


_NAMES = {dtype: _dtype_name(dtype) for dtype in (*FP8_FORMATS, *QUANTIZE_INPUT_DTYPES)}
_FMT_NAMES = {fmt: _NAMES[dtype] for fmt, dtype in FP8_DTYPES.items()}


def choose_gemm(device: DeviceInfo, a_fmt: str, b_fmt: str, *, runtime: Runtime | None = None,
                backend: str | None = None, shape: tuple[int, int, int] | None = None) -> str:
    """The GEMM implementation the policy picks for these facts (no tensors needed).

    ``shape`` (M, N, K) lets a measured preference table decide; without it a table keeps
    cuBLASLt.
    """
    runtime = runtime or current_runtime()
    cls = None if shape is None else shape_class(*shape)
    call = Fp8Call(device, (_FMT_NAMES[a_fmt], _FMT_NAMES[b_fmt]), cls)
    key = (device.key, device.sm, a_fmt, b_fmt, cls)
    return runtime.resolver.resolve(FP8_GEMM, _Candidates(_gemm_candidates, runtime), call, key,
                                    explicit=backend).name


def choose_quantize(device: DeviceInfo, x_dtype: torch.dtype, fmt: str, *,
                    runtime: Runtime | None = None, backend: str | None = None) -> str:
    """The quantize implementation the policy picks for these facts."""
    runtime = runtime or current_runtime()
    dtype_name = _NAMES.get(x_dtype) or _dtype_name(x_dtype)
    call = Fp8Call(device, (dtype_name,))
    key = (device.key, device.sm, dtype_name, fmt)
    return runtime.resolver.resolve(FP8_QUANTIZE, _Candidates(_quantize_candidates, runtime), call,
                                    key, explicit=backend).name


def wants_k_major(device: DeviceInfo, a_fmt: str, b_fmt: str, *, runtime: Runtime | None = None) -> bool:
    """Whether the GEMM chosen for these facts wants ``a`` row-major ``[M, K]`` and ``b``
    column-major ``[K, N]`` (both K-major); other layouts then cost a copy."""
    chosen = choose_gemm(device, a_fmt, b_fmt, runtime=runtime)
    return chosen == "scaled_mm" or (chosen == "plugin" and device.sm in K_MAJOR_ONLY_SM)


# -- validation -------------------------------------------------------------------------


def _check_scalar_scale(scale: object, name: str, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor with one element, got {type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise TypeError(f"{name} must be a float32 tensor with one element, "
                        f"got {scale.dtype} with {scale.numel()} elements")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device}, the operands on {device}")


def check_quantize_args(x: object, scale: object, fmt: object, out_layout: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype not in QUANTIZE_INPUT_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"x has a zero-size dimension: shape {tuple(x.shape)}")
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    if out_layout not in (0, 1, 2):
        raise ValueError(f"out_layout must be 0, 1 or 2, got {out_layout!r}")
    _check_scalar_scale(scale, "scale", x.device)


def check_gemm_args(a: object, b: object, scale: object, bias: object) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in FP8_FORMATS:
            raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if 0 in t.shape:
            raise ValueError(f"{name} has a zero-size dimension: shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: inner dimensions differ")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device}, b on {b.device}")
    _check_scalar_scale(scale, "scale", a.device)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if bias.dtype not in QUANTIZE_INPUT_DTYPES:
            raise TypeError(f"bias must be bfloat16, float16 or float32, got {bias.dtype}")
        if tuple(bias.shape) != (b.shape[1],):
            raise ValueError(f"bias must have shape ({b.shape[1]},), got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device}, the operands on {a.device}")


# Under torch.compile the decision is made once, at trace time: dynamo cannot trace the
# runtime's context variables or the resolver's lock, and a graph fixes the backend anyway.


# The shape is not passed here: under dynamic shapes the sizes are symbolic (dynamo offers
# no way to tell them from ints inside the trace), so a measured preference table keeps
# cuBLASLt in compiled graphs; the trace says "needs the call's M, N, K".
@assume_constant_result
def _choose_gemm_while_compiling(runtime: Runtime | None, device: str, a_fmt: str, b_fmt: str,
                                 backend: str | None) -> tuple[str, int | None]:
    info = probe_device(torch.device(device))
    return choose_gemm(info, a_fmt, b_fmt, runtime=runtime, backend=backend), info.sm


@assume_constant_result
def _choose_quantize_while_compiling(runtime: Runtime | None, device: str, x_dtype: torch.dtype,
                                     fmt: str, backend: str | None) -> str:
    return choose_quantize(probe_device(torch.device(device)), x_dtype, fmt, runtime=runtime, backend=backend)


# -- the calls --------------------------------------------------------------------------


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` cut from autograd; ``t`` itself where autograd records nothing anyway (no view op)."""
    return t.detach() if t.requires_grad and torch.is_grad_enabled() else t


def _plugin_broken(runtime: Runtime, op: str, device: DeviceInfo) -> bool:
    """True when the registry has just marked ``op`` unusable (its module failed to import)."""
    if runtime.registry.op_status(op, device).usable:
        return False
    runtime.resolver.clear()
    return True


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3", out_layout: int = 0, *,
             backend: str | None = None, runtime: Runtime | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, q_t, amax)``: ``q = saturate(x * scale)`` in ``fmt``, ``amax = max|x|``.

    ``scale`` is the quantization *multiplier* (the strategy layer passes the reciprocal
    of its dequantization scale). Layouts as ``ops.fp8_quantize``.
    """
    check_quantize_args(x, scale, fmt, out_layout)
    x, scale = _detached(x), _detached(scale)  # not differentiable: the strategy layer owns autograd
    if torch.compiler.is_compiling():
        chosen = _choose_quantize_while_compiling(runtime, str(x.device), x.dtype, fmt, backend)
    else:
        runtime = runtime or current_runtime()
        device = probe_device(x.device)
        chosen = choose_quantize(device, x.dtype, fmt, runtime=runtime, backend=backend)
    if chosen == "plugin":
        try:
            return ops_fp8.fp8_quantize(x, scale.reshape(()), fmt, out_layout)
        except RuntimeError:
            if backend is not None or not _plugin_broken(runtime, FP8_QUANTIZE, device):
                raise
            return quantize(x, scale, fmt, out_layout, runtime=runtime)
    return fp8_torch.quantize(x, scale, fmt, out_layout)


def gemm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         *, backend: str | None = None, runtime: Runtime | None = None) -> torch.Tensor:
    """``bf16(scale * a @ b + bias)`` for FP8 ``a [M, K]`` and ``b [K, N]`` of any strides.
    Not differentiable (``fp8_autocast``'s linear defines the FP8 backward).

    ``scale`` is the combined dequantization scale (``sa * sb``); ``bias`` is rounded to
    bf16 first on every path, as the kernel's epilogue reads it.
    """
    check_gemm_args(a, b, scale, bias)
    a, b, scale = _detached(a), _detached(b), _detached(scale)
    bias = None if bias is None else _detached(bias)
    if torch.compiler.is_compiling():
        chosen, sm = _choose_gemm_while_compiling(runtime, str(a.device), FP8_FORMATS[a.dtype],
                                                  FP8_FORMATS[b.dtype], backend)
    else:
        runtime = runtime or current_runtime()
        device = probe_device(a.device)
        chosen, sm = choose_gemm(device, FP8_FORMATS[a.dtype], FP8_FORMATS[b.dtype], runtime=runtime,
                                 backend=backend, shape=(a.shape[0], b.shape[1], a.shape[1])), device.sm
    bias16 = None if bias is None else bias.to(torch.bfloat16)
    scale0 = scale if scale.dim() == 0 else scale.reshape(())
    if chosen == "plugin":
        if sm in K_MAJOR_ONLY_SM:
            a, b = fp8_torch.k_major(a, b)
        try:
            return ops_fp8.mm_fp8(a, b, scale0, bias16)
        except RuntimeError:
            if backend is not None or not _plugin_broken(runtime, FP8_GEMM, device):
                raise
            return gemm(a, b, scale, bias, runtime=runtime)
    if chosen == "scaled_mm":
        return fp8_torch.scaled_mm_gemm(a, b, scale0, bias16)
    return fp8_torch.emulated_gemm(a, b, scale0, bias16)


def _scale_update_candidates(runtime: Runtime) -> list:
    return [_PluginOp(FP8_SCALE_UPDATE, runtime), _Always("torch")]


def choose_scale_update(device: DeviceInfo, *, runtime: Runtime | None = None) -> str:
    """The implementation of delayed scaling's end-of-step update for ``device``."""
    runtime = runtime or current_runtime()
    return runtime.resolver.resolve(FP8_SCALE_UPDATE, _Candidates(_scale_update_candidates, runtime),
                                    Fp8Call(device, ("float32",)), (device.key, device.sm)).name
