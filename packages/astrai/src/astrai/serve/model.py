"""A Llama-family decoder (Llama, Mistral, Qwen2) written against AstrAI's public API.

Every layer runs ``attention(..., kv_cache=cache, layer_id=i, rope=(cos, sin))`` over the
packed tokens of one engine step (``[1, total_tokens, heads, head_dim]``): the cache's active
plan says which request each token belongs to and its position; rotary (NeoX layout, as
transformers) is fused with the cache write. ``fused_rope=False`` runs ``apply_rotary_emb_qk``
with per-token positions first instead. Projections are fused (q/k/v in one
linear, gate/up in one), so ``fp8_autocast`` turns four GEMMs per layer into FP8.

The residual stream runs beside the layers' outputs: a layer takes ``(x, residual)`` and
adds ``x`` into ``residual`` in the same launch as the norm that follows
(``fused_add_rms_norm``, in place), so no layer ends with a residual add of its own; the MLP
activation is ``silu_and_mul`` of the gate/up projection's output. Both are the plugin's
kernels on CUDA and transformers' math op for op elsewhere (the CPU's results are
unchanged by the fusion: the same additions and roundings in the same order).

With FP8 weights a linear whose rows take the W8A8 route (``fp8_weight_route``: a step of many
requests on Hopper) reads activations quantized per token by the launch that makes them: the
norm before q/k/v and before gate/up, and SiLU-and-mul before down (``backend.norm_fp8``). The
attention output is quantized inside the o projection's ``fp8_weight_linear``.

Weights come from transformers (:func:`load_hf_state_dict`) or from a seeded random init
(:meth:`DecoderModel.random`); :func:`hf_state_dict` gives them back in transformers' names.

A ``rope`` argument below is ``(cos, sin, positions)``: the float32 ``[max_positions,
head_dim // 2]`` table and the int64 ``[tokens]`` position of every token of the step.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..extension import (DynamicScaling, PagedKVCache, apply_rotary_emb_qk, attention, fp8_autocast,
                         fp8_weight_linear, fused_add_rms_norm, quantize_weight, rms_norm, silu_and_mul)
from ..extension.backend.fp8_weights import W8A8_MIN_ROWS, fp8_input_linear, fp8_weight_route
from ..extension.backend.norm_fp8 import add_rms_norm_fp8, silu_and_mul_fp8
from .config import ModelConfig

__all__ = ["DecoderModel", "add_rms_norm", "hf_layer_state", "hf_state_dict", "load_hf_state_dict", "rms_norm"]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``: ``x`` and ``residual`` overwritten with them
    (one launch on CUDA); before the first layer (``residual`` None) ``x`` itself is the
    residual stream and only normalized."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    return fused_add_rms_norm(x, residual, weight, eps)


class DecoderLayer(nn.Module):
    LINEARS = ("qkv", "o", "gate_up", "down")

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device,
                 linears_released: bool = False) -> None:
        super().__init__()
        c = config
        self.config = c
        self.layer_id = layer_id
        self.window_left = c.window_left(layer_id)
        kw = dict(dtype=dtype, device=device)
        self.attn_norm = nn.Parameter(torch.ones(c.hidden_size, **kw))
        self.qkv = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias, **kw)
        self.o = nn.Linear(c.q_size, c.hidden_size, bias=False, **kw)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden_size, **kw))
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False, **kw)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **kw)
        # FP8 copies of the linears' weights, (w, w_scale) by name (DecoderModel.quantize_weights_fp8)
        self.fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if linears_released:
            self._set_linear_weights("meta")

    @property
    def linears_released(self) -> bool:
        """Whether the linears' 16-bit weights are gone (shape and dtype kept on the meta device)."""
        return self.qkv.weight.is_meta

    def _set_linear_weights(self, device) -> None:
        """The linears' weights as new uninitialised tensors on ``device`` ("meta": released)."""
        for name in self.LINEARS:
            linear = getattr(self, name)
            linear.weight = nn.Parameter(torch.empty_like(linear.weight, device=device), requires_grad=False)

    def materialize_linears(self) -> None:
        """Uninitialised 16-bit weights for released linears, on the layer's device (for a loader)."""
        self._set_linear_weights(self.attn_norm.device)

    def quantize_weights_fp8(self, dtype: torch.dtype = torch.float8_e4m3fn, *, release: bool = False) -> None:
        """FP8 copies of the linears' weights (see :meth:`DecoderModel.quantize_weights_fp8`)."""
        with torch.no_grad():
            self.fp8_weights = {name: quantize_weight(getattr(self, name).weight, dtype) for name in self.LINEARS}
        if release:
            self._set_linear_weights("meta")

    def linear_weight(self, name: str) -> torch.Tensor:
        """The 16-bit weight of the linear ``name``: its own, or its FP8 copy dequantized once released."""
        weight = getattr(self, name).weight
        if not weight.is_meta:
            return weight
        if name not in self.fp8_weights:
            raise RuntimeError(f"layer {self.layer_id}'s {name} weight is released and has no FP8 copy")
        w, w_scale = self.fp8_weights[name]
        return (w.float() * w_scale[:, None]).to(weight.dtype)

    def project(self, name: str, x: torch.Tensor, fp8_weights: bool = False) -> torch.Tensor:
        """The linear ``name`` of ``x``; with ``fp8_weights``, over its FP8 weight copy."""
        linear = getattr(self, name)
        if not fp8_weights:
            return linear(x)
        return fp8_weight_linear(x, *self.fp8_weights[name], linear.bias)

    def takes_fp8_input(self, name: str, x2: torch.Tensor) -> bool:
        """Whether the FP8 copy of linear ``name`` runs W8A8 on rows like ``x2 [rows, K]``: then
        its input is quantized by the launch that makes it. Below the route table's crossover it
        never does, and the table is not asked (a route forced there by ``decided_routes`` runs
        inside the linear instead: the same bytes)."""
        return x2.shape[0] >= W8A8_MIN_ROWS and fp8_weight_route(x2, *self.fp8_weights[name]) == "w8a8"

    def project_fp8_input(self, name: str, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The linear ``name`` of per-token e4m3 rows ``xq`` (scales ``x_scale``), in ``dtype``."""
        return fp8_input_linear(xq, x_scale, *self.fp8_weights[name], getattr(self, name).bias, dtype)

    def normed_projection(self, name: str, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                          fp8_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear name of add_rms_norm(x, residual, norm), the residual stream)``; where the
        FP8 copy runs W8A8, the norm writes its rows quantized."""
        eps = self.config.rms_norm_eps
        if fp8_weights and self.takes_fp8_input(name, x):
            hq, h_scale, residual = add_rms_norm_fp8(x, residual, norm, eps)
            return self.project_fp8_input(name, hq, h_scale, x.dtype), residual
        h, residual = add_rms_norm(x, residual, norm, eps)
        return self.project(name, h, fp8_weights), residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kv_cache: PagedKVCache,
                fused_rope: bool = True, fp8_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, residual)``: this layer's output, not yet added to the residual stream
        ``residual`` (the next norm adds it); ``x`` is the previous layer's output (the
        embeddings, with ``residual`` None, for the first layer). Overwrites ``x`` and ``residual``."""
        c = self.config
        t = x.shape[0]
        cos, sin, positions = rope
        qkv, residual = self.normed_projection("qkv", x, residual, self.attn_norm, fp8_weights)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], -1)
        q, k = q.view(1, t, c.num_heads, c.head_dim), k.view(1, t, c.num_kv_heads, c.head_dim)
        v = v.view(1, t, c.num_kv_heads, c.head_dim)
        window = self.window_left
        if fused_rope:  # rotary at the plan's cache positions, fused with the page write
            out = attention(q, k, v, kv_cache=kv_cache, layer_id=self.layer_id, rope=(cos, sin), rope_interleaved=False,
                            window_left=window)
        else:
            q, k = apply_rotary_emb_qk(q, k, (cos, sin), positions=positions, interleaved=False)
            out = attention(q, k, v, kv_cache=kv_cache, layer_id=self.layer_id, window_left=window)
        o = self.project("o", out.reshape(t, c.q_size), fp8_weights)
        gate_up, residual = self.normed_projection("gate_up", o, residual, self.mlp_norm, fp8_weights)
        if fp8_weights and self.takes_fp8_input("down", gate_up[:, :c.intermediate_size]):
            aq, a_scale = silu_and_mul_fp8(gate_up)
            return self.project_fp8_input("down", aq, a_scale, gate_up.dtype), residual
        return self.project("down", silu_and_mul(gate_up), fp8_weights), residual


class DecoderModel(nn.Module):
    """Embedding, ``num_layers`` decoder layers, final norm and LM head (inference only)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, device=None,
                 inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0,
                 linears_released: bool = False) -> None:
        """``linears_released``: the decoder linears start without 16-bit weights, for a loader
        that fills and quantizes them layer by layer (:func:`~astrai.serve.checkpoint.load_checkpoint`)."""
        super().__init__()
        c = config
        self.config = c
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, device, linears_released)
                                    for i in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size, **kw))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, **kw)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if inv_freq is None:
            inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        # cos/sin of every position, float32 [max_positions, head_dim // 2] (as transformers computes them)
        pos = torch.arange(c.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float().cpu()[None, :]
        self.register_buffer("rope_cos", (freqs.cos() * rope_scaling).to(device), persistent=False)
        self.register_buffer("rope_sin", (freqs.sin() * rope_scaling).to(device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @classmethod
    def random(cls, config: ModelConfig, *, dtype=torch.bfloat16, device=None, seed: int = 0,
               std: float = 0.02) -> DecoderModel:
        """Random weights like transformers' init (normal(0, std), norms 1), seeded."""
        model = cls(config, dtype=dtype, device=device)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.endswith("norm"):
                    p.normal_(0.0, std, generator=gen)
        return model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                logit_rows: torch.Tensor | None = None, *, fp8: bool = False, fused_rope: bool = True,
                fp8_weights: bool = False) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the packed ``tokens [T]`` at ``positions [T]`` (the rows
        ``logit_rows`` only, default all). ``kv_cache.plan(...)`` must describe these tokens.

        ``fp8``: the decoder layers' linears run under ``fp8_autocast`` with dynamic scaling
        (no state carried between steps, so graph replays and eager steps agree) and cached
        FP8 weight copies (serving never changes the weights; a CUDA graph then reads the
        copy made in its warm-up step instead of quantizing every weight on every replay).
        The LM head stays in the model's dtype.

        ``fused_rope``: rotary through ``attention(..., rope=(cos, sin))``, at the positions the
        cache's plan gives each token (they equal ``positions``), fused with the page write;
        False rotates with ``apply_rotary_emb_qk(positions=...)`` first.

        ``fp8_weights``: the decoder layers' linears read their FP8 weight copies
        (:meth:`quantize_weights_fp8`, made first) through ``fp8_weight_linear``.
        """
        if not fp8_weights and self.linears_released:
            raise RuntimeError("the decoder linears' 16-bit weights were released (quantize_weights_fp8(release="
                               "True)): only forward(..., fp8_weights=True) can run this model")
        x, residual = self.embed(tokens), None
        rope = (self.rope_cos, self.rope_sin, positions)
        with fp8_autocast(recipe=DynamicScaling(), cache_weights=True) if fp8 else contextlib.nullcontext():
            for layer in self.layers:
                x, residual = layer(x, residual, rope, kv_cache, fused_rope, fp8_weights)
        if logit_rows is not None:
            x, residual = x[logit_rows], None if residual is None else residual[logit_rows]
        return self.lm_head(add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)[0])

    def quantize_weights_fp8(self, dtype: torch.dtype = torch.float8_e4m3fn, *,
                             release: bool = False) -> DecoderModel:
        """Give the decoder layers' four linears FP8 copies of their weights, one scale per output
        channel (``quantize_weight``), which ``forward(..., fp8_weights=True)`` reads through
        ``fp8_weight_linear`` (one byte a weight at decode). The 16-bit weights stay (the LM head,
        a forward without ``fp8_weights``) unless ``release``: then they are freed, ``forward``
        needs ``fp8_weights=True``, and :func:`hf_state_dict` gives the copies dequantized. Returns the model."""
        for layer in self.layers:
            layer.quantize_weights_fp8(dtype, release=release)
        return self

    @property
    def linears_released(self) -> bool:
        """Whether the decoder linears' 16-bit weights were released (only their FP8 copies remain)."""
        return any(layer.linears_released for layer in self.layers)

    def weight_bytes(self) -> int:
        """Bytes the weights take on their device: parameters (released ones count nothing) and FP8 copies."""
        own = sum(p.nbytes for p in self.parameters() if not p.is_meta)  # a tied head counted once
        copies = sum(w.nbytes + s.nbytes for layer in self.layers for w, s in layer.fp8_weights.values())
        return own + copies

    def hidden_linears(self) -> list[nn.Linear]:
        """The linears of the decoder layers (those ``fp8_autocast`` runs in FP8; not the LM head)."""
        return [getattr(layer, name) for layer in self.layers for name in DecoderLayer.LINEARS]


# -- transformers' weight names --------------------------------------------------------------


def load_hf_state_dict(model: DecoderModel, state: dict[str, torch.Tensor]) -> None:
    """Copy transformers' Llama/Mistral/Qwen2 weights (``model.layers.N.self_attn.q_proj.weight``
    ...) into ``model``, fusing q/k/v and gate/up."""
    c = model.config

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"the transformers state dict has no {name!r}: is it a Llama, Mistral or Qwen2 model?")
        return state[name]

    with torch.no_grad():
        model.embed.weight.copy_(get("model.embed_tokens.weight"))
        model.norm.copy_(get("model.norm.weight"))
        if not c.tie_word_embeddings:
            model.lm_head.weight.copy_(get("lm_head.weight"))
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            q, k, v = (get(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            layer.qkv.weight.copy_(torch.cat([q, k, v]))
            if c.qkv_bias:
                qb, kb, vb = (get(p + f"self_attn.{n}_proj.bias") for n in "qkv")
                layer.qkv.bias.copy_(torch.cat([qb, kb, vb]))
            layer.o.weight.copy_(get(p + "self_attn.o_proj.weight"))
            layer.gate_up.weight.copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
            layer.down.weight.copy_(get(p + "mlp.down_proj.weight"))
            layer.attn_norm.copy_(get(p + "input_layernorm.weight"))
            layer.mlp_norm.copy_(get(p + "post_attention_layernorm.weight"))


def hf_state_dict(model: DecoderModel, *, raw: bool = False) -> dict[str, torch.Tensor]:
    """``model``'s weights under transformers' names (the inverse of :func:`load_hf_state_dict`);
    released linears give their FP8 copies dequantized (see :func:`hf_layer_state` for ``raw``)."""
    c = model.config
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        out.update(hf_layer_state(layer, f"model.layers.{i}.", raw=raw))
    return {k: v.detach() for k, v in out.items()}


def hf_layer_state(layer: DecoderLayer, prefix: str, *, raw: bool = False) -> dict[str, torch.Tensor]:
    """One decoder layer's weights under transformers' names starting with ``prefix``: views into
    its (fused) parameters, the linears' FP8 copies dequantized where released; ``raw``: the
    parameters even where released (meta tensors: the names and shapes a loader fills)."""
    c = layer.config
    weight = (lambda name: getattr(layer, name).weight) if raw else layer.linear_weight
    out = {}
    q, k, v = weight("qkv").split([c.q_size, c.kv_size, c.kv_size])
    out[prefix + "self_attn.q_proj.weight"], out[prefix + "self_attn.k_proj.weight"] = q, k
    out[prefix + "self_attn.v_proj.weight"] = v
    if c.qkv_bias:
        qb, kb, vb = layer.qkv.bias.split([c.q_size, c.kv_size, c.kv_size])
        out[prefix + "self_attn.q_proj.bias"], out[prefix + "self_attn.k_proj.bias"] = qb, kb
        out[prefix + "self_attn.v_proj.bias"] = vb
    out[prefix + "self_attn.o_proj.weight"] = weight("o")
    gate, up = weight("gate_up").chunk(2)
    out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
    out[prefix + "mlp.down_proj.weight"] = weight("down")
    out[prefix + "input_layernorm.weight"] = layer.attn_norm
    out[prefix + "post_attention_layernorm.weight"] = layer.mlp_norm
    return out
