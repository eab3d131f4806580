"""The attention policy: validate a call, pick a backend, run it.

Precedence per call (docs/architecture.md, "Resolver"):

1. an explicit ``with attn_backend(ATTN_BACKEND.X):`` block is strict: that backend runs
   the call or ``BackendUnavailableError`` says why it can't;
2. else the ``ASTR_BACKEND`` environment variable (``cuda``, ``flash`` or ``torch_native``)
   is tried first, falling back to the first capable backend;
3. else the default priority: CUDA plugin > flash-attn > torch SDPA.

Decisions are cached by the resolver per :class:`AttentionCall` (device, dtype, head
dims, mode, mask kind, ...). A repeated kind of call (same shapes, strides, dtypes, devices;
for a cache, the same batch plan) is validated once and keeps its backend, and that
backend's eager runner, while the precedence it was selected under holds (the explicit
selection, the resolver and its generation, ``ASTR_BACKEND``): it costs one dict lookup and
the launch.
Training calls (``fwd=None``, no cache) resolve by capability like any other call: the
CUDA cache kernels decline them, flash-attn takes them when mask-free, SDPA otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import weakref
from collections.abc import Iterator, Sequence

import torch

from ...compiling import assume_constant_result
from ...environ import env_reader
from ...kv_cache import PagedKVCache
from ...runtime import current_runtime
from ..rope_paged import rope_and_append
from .base import AttentionBackend, AttentionCall
from .cuda import CudaBackend
from .flash import FlashAttnBackend
from .torch_native import TorchNativeBackend
from .validation import describe_call
from .variant import PLAIN, AttentionVariant, check_variant

__all__ = [
    "ATTN_BACKEND",
    "AttentionBackend",
    "AttentionCall",
    "AttentionPolicy",
    "AttentionVariant",
    "CudaBackend",
    "FlashAttnBackend",
    "TorchNativeBackend",
    "attention",
    "attn_backend",
    "default_policy",
]

ENV_VAR = "ASTR_BACKEND"


class ATTN_BACKEND(str, enum.Enum):
    """The attention backends, by the names ``ASTR_BACKEND`` and ``attn_backend`` accept."""

    CUDA = "cuda"
    FLASH = "flash"
    TORCH_NATIVE = "torch_native"

    def __str__(self) -> str:
        return self.value


_VALID = ", ".join(b.value for b in ATTN_BACKEND)
_UNPARSED = object()


def _parse_backend(value: object, source: str) -> ATTN_BACKEND:
    if isinstance(value, ATTN_BACKEND):
        return value
    if isinstance(value, str):
        try:
            return ATTN_BACKEND(value.strip().lower())
        except ValueError:
            pass
    raise ValueError(f"{source}={value!r} is not an attention backend: valid values are {_VALID}")


_explicit: contextvars.ContextVar[ATTN_BACKEND | None] = contextvars.ContextVar("astrai_attn_backend", default=None)


def current_attn_backend() -> ATTN_BACKEND | None:
    """The backend an enclosing ``attn_backend(...)`` forces, or None."""
    return _explicit.get()


@contextlib.contextmanager
def attn_backend(backend: ATTN_BACKEND | str | None) -> Iterator[ATTN_BACKEND | None]:
    """Run the attention calls of this block on ``backend``, strictly (no silent fallback).

    Accepts an :class:`ATTN_BACKEND` or its value (``"cuda"``, ``"flash"``,
    ``"torch_native"``); ``None`` restores the default resolution inside the block. The
    selection is a context variable: it is per thread and per asyncio task.
    """
    selected = None if backend is None else _parse_backend(backend, "backend")
    token = _explicit.set(selected)
    try:
        yield selected
    finally:
        _explicit.reset(token)


_env_parsed: dict[str, str | None] = {}  # ASTR_BACKEND's value -> the backend it names
_env_raw = env_reader(ENV_VAR)


def _env_backend() -> str | None:
    raw = _env_raw()
    if raw is None:
        return None
    found = _env_parsed.get(raw, _UNPARSED)
    if found is _UNPARSED:  # parsed once per value; an invalid one raises on every call
        found = _parse_backend(raw, ENV_VAR).value if raw.strip() else None
        if len(_env_parsed) < 64:
            _env_parsed[raw] = found
    return found


_LAST_DESCRIBED = "last described"  # a plan's entry: its latest kind of cache call


class _Described:
    """A validated kind of call: its :class:`AttentionCall` and effective ``is_causal``, and
    ``selection``: ``(state, backend, runner)``, the backend selected under ``state`` (the
    explicit selection, the resolver and its generation, ``ASTR_BACKEND``) and that backend's
    eager runner, replaced as one tuple so that threads never see half of it."""

    __slots__ = ("call", "causal", "remembered", "selection")

    def __init__(self, call: AttentionCall, causal: bool, remembered: bool) -> None:
        self.call, self.causal, self.remembered = call, causal, remembered
        self.selection = (None, None, None)


class AttentionPolicy:
    """Validation + resolution + execution over an ordered list of backends (the default
    priority). :data:`default_policy` serves :func:`attention`; tests build their own."""

    def __init__(self, backends: Sequence[AttentionBackend], op: str = "attention") -> None:
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backends must have distinct names, got {names}")
        self.backends = tuple(backends)
        self.op = op
        self._dense_calls: dict[tuple, _Described] = {}
        _POLICIES[id(self)] = self

    def _describe(self, q, k, v, kv_cache, layer_id, fwd, mask, is_causal, variant) -> _Described:
        """``describe_call``, remembered by the facts it depends on: a repeated call shape costs
        one tuple and its comparison with the latest kind's (else one dict lookup) instead of
        the checks. Dense calls are remembered by the
        policy (bounded); cache calls by their batch's plan, for every layer (so per batch,
        every call after the first, and forgotten with the plan): ``layer_id``, the one fact
        that varies between the layers, is checked on every call. For cache calls the strides
        are part of the key, for the backends' eager runners (which convert the layouts once)."""
        memo = None
        if mask is None and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
            if kv_cache is None:
                memo = self._dense_calls if layer_id is None else None
                if memo is not None and len(memo) >= 512:  # many shapes (varying lengths): start over
                    memo.clear()
            elif type(kv_cache) is PagedKVCache and type(layer_id) is int:
                try:
                    memo = kv_cache.active_plan.launches
                except RuntimeError:  # no plan: describe_call says so
                    pass
        if memo is None:  # described every time (describe_call names what is wrong)
            return _Described(*describe_call(q, k, v, kv_cache, layer_id, fwd, mask, is_causal, variant.features),
                              False)
        key = ("described", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               fwd, type(is_causal), is_causal, torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                             or v.requires_grad),
               None if kv_cache is None else (q.stride(), k.stride(), v.stride()),
               None if variant is PLAIN else variant.memo_key())
        # a cache call: (key, described) of the plan's latest kind of call, which a model's layers repeat
        last = None if kv_cache is None else memo.get(_LAST_DESCRIBED)
        if last is not None and last[0] == key:  # equal keys: no hash of the key needed
            found = last[1]
        else:
            found = memo.get(key)
            if found is None:
                found = memo[key] = _Described(*describe_call(q, k, v, kv_cache, layer_id, fwd, mask, is_causal,
                                                              variant.features), True)
            if kv_cache is not None:
                memo[_LAST_DESCRIBED] = (key, found)
        if kv_cache is not None and not 0 <= layer_id < kv_cache.num_layers:
            kv_cache.check_layer(layer_id)  # raises naming layer_id
        return found

    def select(self, call: AttentionCall) -> AttentionBackend:
        """The backend that runs ``call`` under the current precedence (no computation)."""
        explicit = _explicit.get()
        return current_runtime().resolver.resolve(
            self.op,
            self.backends,
            call,
            call,
            explicit=None if explicit is None else explicit.value,
            preferred=_env_backend(),
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKVCache | None = None,
        layer_id: int | None = None,
        fwd: str | None = None,
        mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
        appended: bool = False,
        variant: AttentionVariant = PLAIN,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            call, causal = describe_call(q, k, v, kv_cache, layer_id, fwd, mask, is_causal, variant.features)
            name = _select_while_compiling(id(self), str(call.device), call.dtype, *call[2:])
            backend = next(b for b in self.backends if b.name == name)
            selected = state = run = None
        else:
            described = self._describe(q, k, v, kv_cache, layer_id, fwd, mask, is_causal, variant)
            resolver = current_runtime().resolver
            state = (_explicit.get(), resolver, resolver.generation, _env_raw.raw())  # what select() reads
            selected, backend, run = described.selection
            if selected == state and run is not None:  # the kind of call's runner, still selected
                try:
                    return run(q, k, v, kv_cache, layer_id, appended)
                except RuntimeError:
                    return self._failed(described.call, backend, q, k, v, kv_cache, layer_id, mask,
                                        described.causal, appended, variant)
            call, causal = described.call, described.causal
            if selected != state:
                backend, run = self.select(call), None
            else:
                state = None  # nothing to remember
        try:
            if state is not None:  # a newly selected backend: its runner, for the calls to come
                if described.remembered and not call.features:
                    run = backend.eager_runner(call, q, k, v, kv_cache)
                described.selection = (state, backend, run)
            if run is not None:
                return run(q, k, v, kv_cache, layer_id, appended)
            return backend.forward(call, q, k, v, kv_cache=kv_cache, layer_id=layer_id, mask=mask, is_causal=causal,
                                   appended=appended, variant=variant)
        except RuntimeError:
            return self._failed(call, backend, q, k, v, kv_cache, layer_id, mask, causal, appended, variant)

    # attention() calls the policy by this name: a method call, without the instance call's
    # slot lookup (~0.15 us a call)
    run = __call__

    def _failed(self, call, backend, q, k, v, kv_cache, layer_id, mask, causal, appended, variant) -> torch.Tensor:
        """What a call does once ``backend`` raised ``RuntimeError`` (call it only while handling
        it). A plugin whose compiled module fails to load is marked unusable by the registry (with
        a warning) on its first call: its check now says why. Decide again without it, unless it
        was requested explicitly; any other error propagates. Repeating forward rewrites the same
        cache slots with the same values."""
        if _explicit.get() is not None or backend.check(call) is None:
            raise  # noqa: PLE0704 - the backend's error, being handled by the caller
        current_runtime().resolver.clear()
        backend = self.select(call)
        return backend.forward(call, q, k, v, kv_cache=kv_cache, layer_id=layer_id, mask=mask, is_causal=causal,
                               appended=appended, variant=variant)


# Policies by id, for the trace-time decision below (dynamo passes only constants to it).
_POLICIES: weakref.WeakValueDictionary[int, AttentionPolicy] = weakref.WeakValueDictionary()


@assume_constant_result
def _select_while_compiling(policy: int, device: str, dtype: torch.dtype, *facts) -> str:
    """``policy.select`` made once at trace time: dynamo cannot trace the runtime's context
    variables or the resolver's lock, and a graph fixes the backend anyway."""
    return _POLICIES[policy].select(AttentionCall(torch.device(device), dtype, *facts)).name


# The default priority: first capable wins.
default_policy = AttentionPolicy((CudaBackend(), FlashAttnBackend(), TorchNativeBackend()))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: PagedKVCache | None = None,
    layer_id: int | None = None,
    fwd: str | None = None,
    mask: torch.Tensor | None = None,
    is_causal: bool | None = None,
    *,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_interleaved: bool = True,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    layout: str = "blhd",
) -> torch.Tensor:
    """Scaled dot-product attention on the best available backend that can run the call.

    Args:
        q: ``[batch, q_len, q_heads, head_dim]`` (``layout="blhd"``, the default; every shape
            below is written in it). ``layout="bhld"`` takes ``q``, ``k``, ``v`` as SDPA does,
            ``[batch, heads, seq, head_dim]``, and returns that layout (views: nothing is
            copied); shape errors then say which layout was assumed.
        k, v: ``[batch, kv_len, kv_heads, head_dim]``; ``q_heads`` a multiple of ``kv_heads`` (GQA).
            With ``kv_cache``: this step's new keys/values, laid out like ``q``; they are
            appended to the cache and attention runs over each request's cached tokens.
        kv_cache: a :class:`~astrai.extension.kv_cache.PagedKVCache` whose
            ``active_plan`` describes this batch (``kv_cache.plan(...)``, once per batch).
            ``q`` is then ``[B, L, q_heads, head_dim]`` (every request adds ``L`` tokens) or
            packed ``[1, total_q, q_heads, head_dim]`` (ragged).
        layer_id: the cache layer; required with ``kv_cache``, not allowed without.
        fwd: ``None`` (decide by q length), ``"decode"`` (one query token per request) or
            ``"prefill"``.
        mask: bool, True = keep: ``[batch, kv_len]`` or ``[batch, q_len, kv_len]``; not with
            ``kv_cache``.
        is_causal: causal attention, bottom-right aligned when ``q_len != kv_len`` (row ``i``
            sees keys ``j <= i + kv_len - q_len``). ``None`` (default): causal with a
            ``kv_cache``, non-causal without.

        rope: with ``kv_cache``, ``(cos, sin)`` float32 ``[max_pos, rotary_dim // 2]``: ``q`` and
            the new ``k`` are first rotated at their cache positions, and ``k`` (rotated) and
            ``v`` written into their pages, in one kernel on CUDA (``apply_rotary_emb``'s
            layouts; ``rope_interleaved=False`` is NeoX).

        window_left: ``-1`` (no window) or ``W >= 0``: a query at absolute position ``p`` (its
            row plus ``kv_len - q_len``; with a cache, its position in its sequence) sees keys
            ``j >= p - W`` only (Mistral's ``sliding_window`` is ``W + 1``). Kernels skip the
            pages and tiles left of the window. A ``kv_cache`` built with ``window=`` (it
            releases pages left of it) needs ``0 <= window_left <=`` its window.
        logits_soft_cap: ``None`` or ``c > 0``: scaled scores ``s`` become ``c * tanh(s / c)``
            (Gemma 2).
        sinks: ``None`` or float32 ``[q_heads]``: one extra logit per query head in the softmax
            denominator, with no value row (gpt-oss).
        scale: ``None`` (``1/sqrt(head_dim)``) or a positive float multiplying ``q @ k^T``.
        alibi_slopes: ``None`` or float32 ``[q_heads]``: ALiBi (BLOOM, MPT): head ``h``'s scaled
            score of key ``j`` for a query at position ``p`` gains ``alibi_slopes[h] * (j - p)``,
            before a soft-cap. The CUDA kernels run it where the plugin states it (built with it);
            flash-attn's backend passes it over (``explain()``).

    A backend that lacks a feature the call uses is passed over with the reason
    (``explain()``); the torch path runs every feature.

    Returns ``q``'s shape and dtype. A query row that keeps no key yields zeros.
    Bad arguments raise ``TypeError`` / ``ValueError`` naming the argument before any work.
    """
    if layout == "bhld":
        q, k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in (q, k, v))
        try:
            out = attention(q, k, v, kv_cache, layer_id, fwd, mask, is_causal, rope=rope,
                            rope_interleaved=rope_interleaved, window_left=window_left,
                            logits_soft_cap=logits_soft_cap, sinks=sinks, scale=scale, alibi_slopes=alibi_slopes)
        except ValueError as exc:
            raise ValueError(f"{exc} (layout='bhld': q, k, v were read as [batch, heads, seq, head_dim], "
                             "the shapes above as [batch, seq, heads, head_dim])") from None
        return out.transpose(1, 2)
    if layout != "blhd":
        raise ValueError(f"layout must be 'blhd' ([batch, seq, heads, head_dim]) or 'bhld' (SDPA's "
                         f"[batch, heads, seq, head_dim]), got {layout!r}")
    if type(window_left) is int and window_left == -1 and logits_soft_cap is None and sinks is None and scale is None \
            and alibi_slopes is None:
        variant = PLAIN  # what check_variant returns for them, without its call
    else:
        variant = check_variant(q, window_left, logits_soft_cap, sinks, scale, alibi_slopes) \
            if isinstance(q, torch.Tensor) else PLAIN
    if isinstance(kv_cache, PagedKVCache) and kv_cache.window is not None:  # it releases keys left of its window
        kv_cache.check_window_left(variant.window_left)
    if rope is not None:
        q = rope_and_append(q, k, v, kv_cache, layer_id, rope, rope_interleaved)
        return default_policy.run(q, k, v, kv_cache, layer_id, fwd, mask, is_causal, appended=True, variant=variant)
    return default_policy.run(q, k, v, kv_cache, layer_id, fwd, mask, is_causal, variant=variant)
