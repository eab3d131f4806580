"""The shape of a Llama-family decoder (Llama, Mistral, Qwen2) and the built-in presets."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["PRESETS", "ModelConfig", "preset"]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model; :meth:`from_hf` reads a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 8192
    sliding_window: int | None = None  # keys a query sees, itself included (transformers' convention)
    # the layers that slide (None: all of them, when sliding_window is set); Qwen2's
    # max_window_layers and transformers' layer_types say which
    sliding_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary rotates pairs), got {self.head_dim}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {self.sliding_window!r}")

    def window_left(self, layer_id: int) -> int:
        """``attention()``'s ``window_left`` for layer ``layer_id``: -1 where it attends to the whole
        context, ``sliding_window - 1`` where it slides (a query sees itself and the
        ``sliding_window - 1`` keys before it)."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer_id not in self.sliding_layers):
            return -1
        return self.sliding_window - 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Weights of the whole model (embedding and head counted once each unless tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * layer + self.vocab_size * h + head + h

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Read a transformers ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config``."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not served: expected llama, mistral or qwen2")
        window = getattr(hf_config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            window = None
        layer_types = getattr(hf_config, "layer_types", None)
        sliding = None
        if window is not None and layer_types is not None:
            sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        eos = hf_config.eos_token_id
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        rope = getattr(hf_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(theta),
            qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos,
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_window=window,
            sliding_layers=sliding,
        )

    def to_hf(self):
        """The matching transformers ``LlamaConfig`` (``Qwen2Config`` with q/k/v bias)."""
        from transformers import LlamaConfig, Qwen2Config

        common = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            eos_token_id=list(self.eos_token_ids) or None, bos_token_id=None, pad_token_id=None,
        )
        if self.qkv_bias:
            return Qwen2Config(**common)
        return LlamaConfig(head_dim=self.head_dim, **common)


# Llama-3-8B: hidden 4096, 32 query / 8 kv heads of 128, MLP 14336, vocab 128256.
_LLAMA3_8B = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, eos_token_ids=(128001,),
    max_position_embeddings=8192,
)

PRESETS: dict[str, ModelConfig] = {
    # small enough for a CPU in seconds; GQA 4/2 so the grouped path is exercised
    "tiny": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=32, rope_theta=10000.0, eos_token_ids=(2,),
                        max_position_embeddings=2048),
    "llama3-8b": _LLAMA3_8B,
}


def preset(name: str, num_layers: int | None = None) -> ModelConfig:
    """The preset ``name`` (``tiny`` or ``llama3-8b``), optionally with ``num_layers`` layers.

    ``llama3-8b-8l`` style names (``-<N>l`` suffix) set the layer count too.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    base, layers = name, num_layers
    if name not in PRESETS and name.endswith("l") and "-" in name:
        head, _, tail = name.rpartition("-")
        if tail[:-1].isdigit() and head in PRESETS:
            base, layers = head, int(tail[:-1]) if num_layers is None else num_layers
    if base not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown: expected one of {sorted(PRESETS)} (llama3-8b-<N>l sets layers)")
    config = PRESETS[base]
    return config if layers is None else replace(config, num_layers=layers)
