"""``LLM``: greedy generation with continuous batching over a paged KV cache.

    >>> from astrai.serve import LLM
    >>> llm = LLM.from_preset("tiny", dtype=torch.float32)            # random weights, CPU
    >>> outputs = llm.generate([[1, 5, 9], [7, 3]], max_new_tokens=8)  # new tokens per prompt

Each engine step plans the cache once (``with kv_cache.step(...)``: a step that fails is
rolled back) and runs the model over the step's packed tokens; decode steps on CUDA replay
a captured graph (:mod:`.graphs`) unless ``cuda_graphs=False``. ``fp8=True`` runs the
decoder layers' linears in FP8; ``kv_cache_dtype=torch.float8_e4m3fn`` (or ``float8_e5m2``)
stores the KV cache in FP8. On a model whose every layer slides (Mistral; Qwen2 with
``use_sliding_window`` on every layer) the cache returns the pages left of the widest window
to the pool as requests decode (``PagedKVCache(window=...)``), so a request may grow far past
what the cache could hold as full history.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..extension import PagedKVCache
from ..extension.kv_window import shared_window
from .config import ModelConfig, preset
from .graphs import DecodeGraphs, held_while_growing
from .greedy import greedy_tokens
from .inflight import InFlight
from .kv_cache_dtype import calibrate_kv_scales, check_kv_cache_dtype
from .model import DecoderModel, hf_state_dict, load_hf_state_dict
from .precision import check_linear_precision
from .scheduler import Request, Scheduler, Step, requests_of
from .stats import GenerationStats, progress

__all__ = ["LLM"]

_PAD_SEQ = "__pad__"


@contextlib.contextmanager
def _released_on_failure(cache: PagedKVCache, requests: list[Request]):
    """A ``generate`` that raises frees its requests' sequences (``kv_cache.step`` rolled its
    failed step back), so the cache serves the next call as if this one never ran."""
    try:
        yield
    except BaseException:
        for r in requests:
            if r.rid in cache.sequences:
                cache.release(r.rid)
        raise


class LLM:
    """A Llama-family model served by AstrAI's kernels (or their torch fallbacks).

    One device: the engine holds the whole model and its :class:`PagedKVCache` on one GPU (or
    the CPU). Past one GPU, serve through vLLM with AstrAI's attention backend
    (``--attention-backend CUSTOM --tensor-parallel-size N``, ``pip install "astrai[vllm]"``) or
    through transformers' tensor parallelism with ``attn_implementation="astrai"``
    (``tp_plan="auto"`` under ``torchrun``): docs/serve.md, "Serving on more than one GPU".

    Args:
        model: the :class:`~astrai.serve.model.DecoderModel` (see :meth:`from_transformers`,
            :meth:`from_pretrained`, :meth:`from_preset`).
        page_size: tokens per KV-cache page.
        max_batch_size: requests decoded together at most.
        max_batch_tokens: prompt tokens per prefill step at most (longer prompts are chunked).
        cuda_graphs: replay decode steps from CUDA graphs (CUDA only; ignored on the CPU).
        fp8: run the decoder layers' linears in FP8 (``fp8_autocast``: FP8 weights and activations).
            Slower than 16-bit at serving batches (:attr:`precision_note` says by how much):
            ``fp8_weights`` is the serving mode.
        fp8_weights: give the decoder layers' linears FP8 weight copies, one scale per output
            channel, read by ``fp8_weight_linear`` (activations stay 16-bit: what pays at decode
            sizes). Not with ``fp8``. A model passed in keeps its 16-bit weights; the ``from_*``
            constructors' own models free them (the memory goes to the KV cache).
        memory_fraction: share of the free GPU memory the KV cache may take.
        overlap: plan and launch each decode step before the previous one's tokens reach the
            host (while no request waits for a slot); False waits for every step.
        fused_rope: rotary fused with the KV-cache write (``attention(..., rope=...)``); False
            rotates q and k with ``apply_rotary_emb_qk`` first.
        kv_cache_dtype: the KV cache's storage: None (the model's dtype), or
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``: one byte per value, with per-layer
            K and V scales (``PagedKVCache(kv_dtype=...)``, docs/kv_cache_fp8.md).

    An FP8 cache's scales are calibrated when the engine builds the cache, before any decode
    graph is captured: the workload's first prefill step (the one ``generate`` then runs
    first) runs eagerly on throw-away sequences, and each layer's first append calibrates its
    scales (``amax / fp8 max`` of that step's keys and values), the values a cache calibrated
    by the step itself would hold. A capture's warm-up step would otherwise calibrate them on
    its filler tokens, and a capture would record the calibration into the graph. The scales
    then never change for the cache's life (a graph reads them by address); a cache rebuilt
    for a larger workload calibrates again on that workload.
    """

    def __init__(self, model: DecoderModel, *, page_size: int = 16, max_batch_size: int = 64,
                 max_batch_tokens: int = 8192, cuda_graphs: bool = True, fp8: bool = False,
                 memory_fraction: float = 0.8, overlap: bool = True, fused_rope: bool = True,
                 kv_cache_dtype: torch.dtype | None = None, fp8_weights: bool = False) -> None:
        if not isinstance(model, DecoderModel):
            raise TypeError(f"model must be a DecoderModel, got {type(model).__name__}")
        # where the precision chosen is measured to lose to another at serving sizes
        self.precision_note: str | None = check_linear_precision(model, fp8, fp8_weights)
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype, model.dtype)
        for name, value, low in (("page_size", page_size, 3), ("max_batch_size", max_batch_size, 1),
                                 ("max_batch_tokens", max_batch_tokens, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        self.model = model.eval().requires_grad_(False)  # inference only: the kernels without backward qualify
        self.config: ModelConfig = model.config
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.use_graphs = bool(cuda_graphs) and model.device.type == "cuda"
        self.graphs_off_reason: str | None = None  # why decode steps run eagerly on CUDA, when they do
        self.fp8 = bool(fp8)
        self.fp8_weights = bool(fp8_weights)
        if self.fp8_weights and not all(layer.fp8_weights for layer in model.layers):
            model.quantize_weights_fp8()
        self.memory_fraction = memory_fraction
        self.overlap = bool(overlap)
        self.fused_rope = bool(fused_rope)
        self.kv_cache: PagedKVCache | None = None
        self.graphs: DecodeGraphs | None = None
        self.last_stats: GenerationStats | None = None

    # -- construction

    @classmethod
    def from_transformers(cls, hf_model, *, dtype: torch.dtype | None = None, device=None, **kwargs) -> LLM:
        """Serve the weights of a transformers Llama / Mistral / Qwen2 causal LM (copied, fused)."""
        devices = {p.device for p in hf_model.parameters()}
        if len(devices) > 1 or getattr(hf_model, "tp_size", None) not in (None, 1):
            raise ValueError(
                f"hf_model is spread over {len(devices)} devices (or sharded by tensor parallelism): LLM serves one "
                "device; past one GPU use vLLM with AstrAI's backend (--attention-backend CUSTOM) or transformers' "
                "tensor parallelism with attn_implementation=\"astrai\" (docs/serve.md)")
        config = ModelConfig.from_hf(hf_model.config)
        ref = next(hf_model.parameters())
        dtype = ref.dtype if dtype is None else dtype
        device = ref.device if device is None else torch.device(device)
        rotary = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        model = DecoderModel(config, dtype=dtype, device=device, inv_freq=inv_freq, rope_scaling=scaling)
        load_hf_state_dict(model, hf_model.state_dict())
        return cls(model.quantize_weights_fp8(release=True) if kwargs.get("fp8_weights") else model, **kwargs)

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | None = None, device=None, **kwargs) -> LLM:
        """Serve the local transformers folder ``path`` (``config.json`` + safetensors, sharded or
        not), loaded tensor by tensor onto ``device`` (default CUDA when available) in ``dtype``
        (default the checkpoint's) without building a transformers model; no downloads. See
        :mod:`~astrai.serve.checkpoint` for what is supported."""
        from .checkpoint import load_checkpoint

        fp8 = torch.float8_e4m3fn if kwargs.get("fp8_weights") else None  # quantized layer by layer as read
        return cls(load_checkpoint(path, dtype=dtype, device=device, fp8_weights=fp8), **kwargs)

    @classmethod
    def from_preset(cls, name: str, *, num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                    device=None, seed: int = 0, **kwargs) -> LLM:
        """Random weights of the preset ``name`` (``tiny``, ``llama3-8b``; see
        :func:`~astrai.serve.config.preset`), on CUDA when available. No downloads."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = DecoderModel.random(preset(name, num_layers), dtype=dtype, device=torch.device(device), seed=seed)
        return cls(model.quantize_weights_fp8(release=True) if kwargs.get("fp8_weights") else model, **kwargs)

    def to_transformers(self, attn_implementation: str = "sdpa"):
        """The same weights as a transformers model (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``)."""
        from transformers import AutoModelForCausalLM

        with torch.device(self.model.device):  # built (and randomly initialised) where it will run
            hf = AutoModelForCausalLM.from_config(self.config.to_hf(), attn_implementation=attn_implementation,
                                                  dtype=self.model.dtype)
        missing, unexpected = hf.load_state_dict(hf_state_dict(self.model), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # the head is absent only when tied
            raise RuntimeError(f"weights do not map onto {type(hf).__name__}: missing {missing}, unexpected {unexpected}")
        return hf.eval()

    # -- the KV cache

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache's pages (keys and values of every layer), 0 before it is built."""
        cache = self.kv_cache
        return 0 if cache is None else cache.k_pages.nbytes + cache.v_pages.nbytes

    @torch.inference_mode()
    def reserve(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Size the KV cache (and capture the decode graphs) for this workload now, so a later
        ``generate`` of it (or of a smaller one) starts at once; ``generate`` does it when needed."""
        self._ensure_cache(requests_of(prompts, max_new_tokens, self.config))

    @property
    def cache_window(self) -> int | None:
        """The KV cache's ``window``: the widest ``window_left`` of the layers, None when one
        attends to every key (then no page is released before its request ends)."""
        return shared_window(layer.window_left for layer in self.model.layers)

    def _ensure_cache(self, requests: list[Request]) -> None:
        ps, window = self.page_size, self.cache_window
        held = [r.pages_held(ps, window, self.max_batch_tokens) for r in requests]
        extra = 1 + (window is not None)  # the graphs' pad page, the null page released columns point at
        longest = max(r.pages_needed(ps) for r in requests)  # page-table columns, released ones too
        widest = min(len(requests), self.max_batch_size)  # the largest decode batch this workload runs
        need = sum(held) + extra
        if window is not None and self.use_graphs:  # the widest capture: every sequence with `longest` columns
            need = max(need, widest * min(held_while_growing(window, ps), longest) + extra)
        cache, graphs = self.kv_cache, self.graphs
        if cache is not None and cache.window == window and cache.num_pages >= need and (
                graphs is None or (graphs.max_seq_pages >= longest and graphs.sizes[-1] >= widest)):
            return
        c = self.config
        num_pages = need
        self.kv_cache = self.graphs = cache = None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()  # the old cache and graph pool count as free
            page_bytes = 2 * c.num_layers * ps * c.kv_size * (self.kv_cache_dtype or self.model.dtype).itemsize
            free, _ = torch.cuda.mem_get_info(self.model.device)
            budget = int(free * self.memory_fraction) // page_bytes
            if budget < max(held) + extra:
                raise MemoryError(f"the KV cache fits {budget} pages in GPU memory, the longest request needs "
                                  f"{max(held)}")
            num_pages = min(need, budget)
        cache = PagedKVCache(num_layers=c.num_layers, num_pages=num_pages, page_size=ps, kv_heads=c.num_kv_heads,
                             head_dim=c.head_dim, dtype=self.model.dtype, device=self.model.device,
                             kv_dtype=self.kv_cache_dtype, window=window)
        cache.k_pages.zero_()  # no NaN garbage under the pad rows and capture steps
        cache.v_pages.zero_()
        cache.add_sequence(_PAD_SEQ)
        cache.plan([_PAD_SEQ], [1])  # owns one page: pad rows of graph replays write and read only there
        if self.kv_cache_dtype is not None:
            calibrate_kv_scales(self, cache, requests)
        if self.use_graphs:
            try:
                self.graphs = DecodeGraphs(lambda tokens, positions: self._forward(tokens, positions, None, cache),
                                           cache, _PAD_SEQ, widest, longest)
            except RuntimeError as exc:  # said by astrai generate; eager decoding gives the same tokens
                self.graphs_off_reason = str(exc)
                self.use_graphs = False
        self.kv_cache = cache

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor | None,
                 cache: PagedKVCache) -> torch.Tensor:
        return self.model(tokens, positions, cache, logit_rows, fp8=self.fp8, fused_rope=self.fused_rope,
                          fp8_weights=self.fp8_weights)

    # -- generation

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 32, *, progress_bar: bool = False,
                 return_logits: bool = False):
        """Greedy continuations of ``prompts`` (lists of token ids): the new tokens of each,
        stopping after the model's EOS token (kept, as transformers does) or ``max_new_tokens``.

        ``return_logits=True`` returns ``(tokens, logits)`` with each request's float32 logits
        ``[new_tokens, vocab]`` on the CPU (slow: for checking only). Timings of the call are
        in :attr:`last_stats`.
        """
        requests = requests_of(prompts, max_new_tokens, self.config)
        self._ensure_cache(requests)
        cache = self.kv_cache
        sched = Scheduler(requests, page_size=self.page_size, num_pages=cache.free_pages,
                          max_batch_size=self.max_batch_size, max_batch_tokens=self.max_batch_tokens,
                          window=cache.window)
        stats = GenerationStats(num_requests=len(requests), prompt_tokens=sum(len(r.prompt) for r in requests))
        logits_out: dict[int, list[torch.Tensor]] = {r.rid: [] for r in requests}
        eos = set(self.config.eos_token_ids)
        start = time.perf_counter()
        with _released_on_failure(cache, requests), progress(len(requests), progress_bar) as advance:

            def emit(r: Request, token: int, logits: torch.Tensor | None, now: float) -> None:
                r.output.append(token)
                if return_logits:
                    logits_out[r.rid].append(logits.float().cpu())
                if r.first_token_time is None:
                    r.first_token_time = now - start
                if token in eos or len(r.output) >= r.max_new_tokens:
                    cache.release(r.rid)
                    sched.finish(r)
                    advance()

            while not sched.done:
                step = sched.next_step()
                if step.kind == "decode" and self.overlap and not sched.waiting:
                    self._decode_run(step.requests, stats, emit, return_logits)
                    continue
                t0 = time.perf_counter()
                next_tokens, logits = self._run_step(step)
                next_tokens = next_tokens.tolist()  # waits for the step
                now = time.perf_counter()
                context = sum(len(r.prompt) + len(r.output) for r in step.requests) if step.kind == "decode" else 0
                stats.add_step(step.kind, sum(step.q_lens), len(step.logits_for), now - t0, context)
                for i, r in enumerate(step.requests):
                    r.prefilled += step.q_lens[i] if step.kind == "prefill" else 0
                for j, b in enumerate(step.logits_for):
                    emit(step.requests[b], next_tokens[j], logits[j], now)
        stats.total_time = time.perf_counter() - start
        stats.ttft = [r.first_token_time for r in requests]
        stats.new_tokens = sum(len(r.output) for r in requests)
        if self.model.device.type == "cuda":
            stats.gpu_memory_bytes = torch.cuda.max_memory_allocated(self.model.device)
        self.last_stats = stats
        tokens = [r.output for r in requests]
        if return_logits:
            return tokens, [torch.stack(logits_out[r.rid]) for r in requests]
        return tokens

    def _decode_run(self, reqs: tuple[Request, ...], stats: GenerationStats, emit, keep_logits: bool) -> None:
        """Decode steps back to back for ``reqs`` (every running request, none waiting): step
        ``k + 1`` is planned and launched before step ``k``'s tokens reach the host, its input
        tokens being step ``k``'s on the device, so the host's planning overlaps the GPU's work.
        Runs until the first request stops: a request that met EOS at step ``k`` still rides
        along in step ``k + 1`` (inside its reserved pages), whose token for it is dropped."""
        cache = self.kv_cache
        ids = [r.rid for r in reqs]
        steps = min(r.max_new_tokens - len(r.output) for r in reqs)
        base = [len(r.prompt) + len(r.output) - 1 for r in reqs]
        tokens = self._to_device([r.output[-1] for r in reqs])
        into = self._static_plan(len(ids))
        t0 = time.perf_counter()
        pending = None
        ran = 0
        for _ in range(steps):
            with cache.step(ids, [1] * len(ids), into=into) as plan:
                next_tokens, logits = self._decode(plan, tokens)
            launched = InFlight(next_tokens, logits.float().clone() if keep_logits else None)
            tokens = next_tokens
            ran += 1
            stopped = pending is not None and self._resolve(pending, reqs, emit, stats)
            pending = launched
            if stopped:
                break
        self._resolve(pending, reqs, emit, stats)
        # step k attends over base + k + 1 keys per request
        context = ran * sum(base) + len(reqs) * ran * (ran + 1) // 2
        stats.add_decode_run(ran, len(reqs), time.perf_counter() - t0, context)

    @staticmethod
    def _resolve(step: InFlight, reqs: tuple[Request, ...], emit, stats: GenerationStats) -> bool:
        """Hand a launched step's tokens to their requests; True when one of them stopped."""
        tokens = step.tokens()
        now = time.perf_counter()
        stopped = False
        for i, r in enumerate(reqs):
            if r.finished:
                continue  # stopped in an earlier step: this row was a passenger
            emit(r, tokens[i], None if step.logits is None else step.logits[i], now)
            stats.decode_tokens += 1
            stopped |= r.finished
        return stopped

    def _to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.model.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.model.device, non_blocking=True)

    def _static_plan(self, batch: int):
        """The graph buffers a decode step of ``batch`` requests is planned into, or None (eager)."""
        return None if self.graphs is None else self.graphs.static_plan(batch)

    def _decode(self, plan, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's ``(next tokens, logits)``: a graph replay when ``plan`` was planned into
        a graph's buffers (:meth:`_static_plan`), else eagerly at the plan's positions."""
        if self._static_plan(plan.batch_size) is not None:
            return self.graphs.run(plan, tokens)
        logits = self._forward(tokens, plan.token_positions, None, self.kv_cache)
        return greedy_tokens(logits), logits

    def _run_step(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        cache, device = self.kv_cache, self.model.device
        reqs = step.requests
        for r in reqs:
            if step.kind == "prefill" and r.prefilled == 0:
                cache.add_sequence(r.rid)
        ids = [r.rid for r in reqs]
        if step.kind == "decode":
            tokens_t = self._to_device([r.output[-1] for r in reqs])
            with cache.step(ids, list(step.q_lens), into=self._static_plan(len(ids))) as plan:
                return self._decode(plan, tokens_t)
        tokens, positions = [], []
        for r, n in zip(reqs, step.q_lens):
            tokens += r.prompt[r.prefilled: r.prefilled + n]
            positions += range(r.prefilled, r.prefilled + n)
        with cache.step(ids, list(step.q_lens)) as plan:
            tokens_t, positions_t = self._to_device(tokens + positions).view(2, -1).unbind(0)
            ends = torch.tensor(step.q_lens).cumsum(0) - 1
            rows = ends[list(step.logits_for)].to(device, non_blocking=True)
            logits = self._forward(tokens_t, positions_t, rows, cache)
            return greedy_tokens(logits), logits
