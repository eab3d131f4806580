"""A local transformers checkpoint folder, loaded straight into the engine's :class:`DecoderModel`.

``config.json`` is read with transformers' ``AutoConfig`` (a config, no model; nothing is
downloaded); the weights come from ``model.safetensors`` or the shards that
``model.safetensors.index.json`` names, one tensor at a time: each is read from its file,
checked against the engine's parameter, and copied (cast) into it on the target device, the
q/k/v and gate/up projections into their slices of the fused linears. No transformers model
is built, so the host holds one tensor at a time and the device the engine's weights alone.

    >>> model = load_checkpoint("./Meta-Llama-3-8B", dtype=torch.bfloat16, device="cuda")

Supported: :data:`ARCHITECTURES` (``model_type`` llama, mistral, qwen2) with SiLU MLPs without
bias, and the rotary types of :data:`ROPE_TYPES`. Anything else is refused with a
:class:`CheckpointError` that names the folder, the file and what is supported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .model import DecoderModel, hf_layer_state, hf_state_dict

__all__ = ["ARCHITECTURES", "ROPE_TYPES", "CheckpointError", "load_checkpoint", "read_config", "weight_files"]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# static rotary tables (transformers' ROPE_INIT_FUNCTIONS); "dynamic" and "longrope" depend on the length
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# saved by some checkpoints, recomputed here
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint folder the engine cannot serve; the message names the path and what is supported."""


def _supported() -> str:
    return f"supported: {', '.join(ARCHITECTURES)} in safetensors (rotary {', '.join(ROPE_TYPES)})"


def read_config(path) -> tuple[ModelConfig, object]:
    """The engine's :class:`ModelConfig` of the folder ``path`` and transformers' config it was read from."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (a local transformers model folder: config.json and "
                              "safetensors weights; nothing is downloaded)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json (a local transformers model folder)")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{folder / 'config.json'}: transformers cannot read it: {exc}") from None
    arch = [a for a in (getattr(hf_config, "architectures", None) or []) if a not in ARCHITECTURES]
    problems = [f"architecture {', '.join(arch)}"] if arch else []
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf_config.hidden_act!r} (the engine's MLP is SiLU-gated)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True")
    rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_type {rope_type!r}")
    try:
        config = ModelConfig.from_hf(hf_config)
    except ValueError as exc:
        problems.append(str(exc))
        config = None
    if problems:
        raise CheckpointError(f"{folder / 'config.json'}: not served: {'; '.join(problems)} ({_supported()})")
    eos = _generation_eos(folder)
    return (config if eos is None else replace(config, eos_token_ids=eos)), hf_config


def _generation_eos(folder: Path) -> tuple[int, ...] | None:
    """``generation_config.json``'s EOS tokens (what transformers' ``generate`` stops at), if it has any."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a JSON object: {exc}") from None
    if eos is None:
        return None
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def weight_files(path) -> dict[str, Path]:
    """Every weight name of the folder ``path`` and the safetensors file that holds it."""
    folder = Path(path)
    index, single = folder / INDEX, folder / SINGLE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: no weight_map: {exc}") from None
        files = {name: folder / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"{index} names shards that are not there: {', '.join(missing)}")
        return files
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    found = f" (found {', '.join(others[:3])}: PyTorch pickles are not read)" if others else ""
    raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX}{found}; {_supported()}")


def _default_dtype(hf_config) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype)
    return dtype if dtype in _DTYPES.values() else torch.bfloat16


def _rotary(hf_config) -> tuple[torch.Tensor | None, float]:
    """``inv_freq`` and the cos/sin scale of the config's rotary type (None: the engine's default table)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind == "default":
        return None, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf_config, None)
    return inv_freq, float(scale)


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Build the model without its random init (every parameter is then loaded, or the load fails)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def load_checkpoint(path, *, dtype: torch.dtype | None = None, device=None,
                    fp8_weights: torch.dtype | None = None) -> DecoderModel:
    """The :class:`DecoderModel` of the local folder ``path``, its weights in ``dtype`` (default
    the checkpoint's, else bfloat16) on ``device`` (default CUDA when available).

    ``fp8_weights`` (``torch.float8_e4m3fn`` / ``float8_e5m2``): the decoder linears keep only
    FP8 copies (``quantize_weights_fp8(release=True)``), made layer by layer as the layer is
    read, so the device never holds more than one layer's 16-bit linears: a model whose 16-bit
    weights would not fit loads when its FP8 ones do."""
    if fp8_weights not in (None, torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_weights must be None, torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_weights!r}")
    config, hf_config = read_config(path)
    files = weight_files(path)
    dtype = _default_dtype(hf_config) if dtype is None else dtype
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    inv_freq, scale = _rotary(hf_config)
    with _no_random_init():
        model = DecoderModel(config, dtype=dtype, device=device, inv_freq=inv_freq, rope_scaling=scale,
                             linears_released=fp8_weights is not None)
    targets = hf_state_dict(model, raw=True)  # views into the (fused) parameters, under transformers' names
    ignored = {n for n in files if n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        ignored.add("lm_head.weight")  # transformers ties it to the embedding too
    unknown = sorted(set(files) - set(targets) - ignored)
    if unknown:
        raise CheckpointError(f"{Path(path)}: weights the engine has no place for: {_listed(unknown)} "
                              f"({_supported()})")
    missing = sorted(set(targets) - set(files))
    if missing:
        raise CheckpointError(f"{Path(path)}: the checkpoint lacks {_listed(missing)}")
    released = {n for n, t in targets.items() if t.is_meta}  # the linears of an fp8_weights load
    with _reader(files) as copy:
        copy({n: t for n, t in targets.items() if n not in released})
        for i, layer in enumerate(model.layers if released else ()):
            layer.materialize_linears()
            copy({n: t for n, t in hf_layer_state(layer, f"model.layers.{i}.", raw=True).items() if n in released})
            layer.quantize_weights_fp8(fp8_weights, release=True)
    return model.eval().requires_grad_(False)


def _listed(names: list[str], most: int = 5) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


@contextlib.contextmanager
def _reader(files: dict[str, Path]) -> Iterator:
    """``copy(targets)``: each target filled from its file, one tensor in host memory at a time
    (every file open for the block's length)."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(file, framework="pt")) for file in set(files.values())}

        def copy(targets: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                for name in sorted(targets, key=lambda n: str(files[n])):  # file by file
                    tensor, target = opened[files[name]].get_tensor(name), targets[name]
                    if tensor.shape != target.shape:
                        raise CheckpointError(f"{files[name]}: {name} has shape {tuple(tensor.shape)}, the config "
                                              f"gives {tuple(target.shape)}")
                    target.copy_(tensor)

        yield copy
