"""The decode step's HBM floor: the bytes one step must read over the GPU's memory bandwidth.

A decode step reads every weight but the embedding table (whose rows are gathered, a few
kilobytes; the LM head is read whole, also when it is tied to the embedding) and the KV cache
of every request in the batch, ``2 * layers * kv_heads * head_dim * itemsize`` bytes per
token of context (the cache's storage: one byte for an FP8 cache). With ``fp8`` the decoder
layers' linears are read as their FP8 copies (one byte per weight); norms, biases and the LM
head stay in the model's dtype. The floor is
those bytes over the device's peak memory bandwidth; a step can come near it but not under it.

The peak comes from the device's properties, ``2 x memory_clock_rate (kHz) x memory_bus_width (bits) / 8``
(double data rate): 3.35 TB/s on an H100 SXM, any card. Where torch does not report them (older
releases, or 0 where a CUDA runtime dropped the field) the vendors' figures in :data:`BANDWIDTH` stand in.
"""

from __future__ import annotations

import torch

from .config import ModelConfig

__all__ = ["BANDWIDTH", "decode_floor", "kv_bytes_per_token", "memory_bandwidth", "peak_bandwidth",
           "weight_bytes_per_step"]

# peak HBM / GDDR bandwidth in TB/s, by torch.cuda.get_device_name() without "NVIDIA ": the fallback
# where the device's properties give no memory clock
BANDWIDTH: dict[str, float] = {
    "B200": 8.0,
    "H200": 4.8,
    "H200 NVL": 4.8,
    "H100 80GB HBM3": 3.35,  # H100 SXM
    "H100 NVL": 3.9,
    "H100 PCIe": 2.0,
    "A100-SXM4-80GB": 2.039,
    "A100 80GB PCIe": 1.935,
    "A100-SXM4-40GB": 1.555,
    "A100-PCIE-40GB": 1.555,
    "L40S": 0.864,
    "L4": 0.3,
    "GeForce RTX 4090": 1.008,
}


def peak_bandwidth(properties) -> float | None:
    """Bytes/s from ``torch.cuda.get_device_properties()``'s memory clock and bus width, None without them."""
    clock_khz = getattr(properties, "memory_clock_rate", 0)
    bus_bits = getattr(properties, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def memory_bandwidth(device_name: str, properties=None) -> float | None:
    """Bytes/s of the GPU named ``device_name`` (as CUDA names it): from its ``properties`` where they
    give the memory clock, else from :data:`BANDWIDTH`; None when neither knows it."""
    peak = peak_bandwidth(properties)
    if peak:
        return peak
    name = device_name.removeprefix("NVIDIA ").strip()
    tb_s = BANDWIDTH.get(name)
    return None if tb_s is None else tb_s * 1e12


def weight_bytes_per_step(config: ModelConfig, dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes of the weights a decode step reads: all but the embedding table, the LM head always."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    linears = c.num_layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i)
    head = c.vocab_size * h
    rest = c.num_parameters() - c.vocab_size * h - (0 if c.tie_word_embeddings else head) - linears  # norms, biases
    return linears * (1 if fp8 else dtype.itemsize) + (head + rest) * dtype.itemsize


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over all layers."""
    return 2 * config.num_layers * config.kv_size * dtype.itemsize


def decode_floor(config: ModelConfig, dtype: torch.dtype, *, device: str, context_tokens_per_step: float,
                 step_ms: float, fp8: bool = False, kv_dtype: torch.dtype | None = None, properties=None) -> dict:
    """The floor of a decode step that attends over ``context_tokens_per_step`` tokens (summed over
    the batch) on ``device`` (``"cpu"`` or a CUDA device name), beside the measured ``step_ms``;
    ``kv_dtype``: the KV cache's storage (default ``dtype``); ``properties``: the device's
    ``torch.cuda.get_device_properties()`` (see :func:`memory_bandwidth`).

    ``floor_ms`` and ``step_over_floor`` are None where the floor is not known; ``note`` says why.
    """
    weights = weight_bytes_per_step(config, dtype, fp8)
    kv = int(kv_bytes_per_token(config, kv_dtype or dtype) * context_tokens_per_step)
    out = {"device": device, "weight_bytes": weights, "kv_bytes": kv, "bandwidth_tb_s": None, "floor_ms": None,
           "step_ms": step_ms, "step_over_floor": None, "note": None}
    if device == "cpu":
        out["note"] = "does not apply on the CPU (the torch fallbacks are not bound by memory bandwidth)"
        return out
    bandwidth = memory_bandwidth(device, properties)
    if bandwidth is None:
        out["note"] = f"unknown: no memory bandwidth on record for {device}"
        return out
    floor_ms = 1e3 * (weights + kv) / bandwidth
    out.update(bandwidth_tb_s=bandwidth / 1e12, floor_ms=floor_ms,
               step_over_floor=step_ms / floor_ms if step_ms else None)
    return out
