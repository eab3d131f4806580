"""The decode step's HBM floor `astrai generate` prints: the bytes a step reads (weights but the
embedding table, the batch's KV cache) over the GPU's bandwidth, and the context it counts."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from astrai.cli.generate_report import floor_line
from astrai.serve import LLM, preset
from astrai.serve.hbm import (BANDWIDTH, decode_floor, kv_bytes_per_token, memory_bandwidth, peak_bandwidth,
                              weight_bytes_per_step)
from astrai.serve.model import DecoderModel

LLAMA3_8B = preset("llama3-8b")


def test_llama3_8b_bytes_match_the_issue():
    # 8.03 B parameters, the 0.53 B embedding table not read: 15.0 GB in bf16; 128 KiB of KV per token
    assert LLAMA3_8B.num_parameters() == pytest.approx(8.03e9, rel=1e-3)
    assert weight_bytes_per_step(LLAMA3_8B, torch.bfloat16) == 2 * (LLAMA3_8B.num_parameters() - 128256 * 4096)
    assert weight_bytes_per_step(LLAMA3_8B, torch.bfloat16) == pytest.approx(15.0e9, rel=2e-3)
    assert kv_bytes_per_token(LLAMA3_8B, torch.bfloat16) == 128 * 1024
    # FP8 linears: one byte per decoder-layer weight; the LM head (1.05 GB) and norms stay bf16
    fp8 = weight_bytes_per_step(LLAMA3_8B, torch.bfloat16, fp8=True)
    assert fp8 == pytest.approx(15.0e9 / 2 + 128256 * 4096, rel=2e-3)


@pytest.mark.parametrize(("batch", "floor_ms"), [(1, 3.14), (16, 3.38), (64, 4.13)])
def test_h200_floor_of_the_issue_table(batch, floor_ms):
    # prompts 512, 128 new tokens: a decode step attends over 576 keys per request on average
    floor = decode_floor(LLAMA3_8B, torch.bfloat16, device="NVIDIA H200", context_tokens_per_step=576 * batch,
                         step_ms=2 * floor_ms)
    assert floor["bandwidth_tb_s"] == 4.8 and floor["floor_ms"] == pytest.approx(floor_ms, abs=0.01)
    assert floor["step_over_floor"] == pytest.approx(2.0, rel=0.01)
    line = floor_line(floor, batch)
    assert f"HBM floor {floor['floor_ms']:.2f} ms" in line and "at 4.8 TB/s" in line and "2.00x the floor" in line


def test_bandwidth_table_and_unknown_devices():
    assert memory_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12  # H100 SXM
    assert memory_bandwidth("NVIDIA A100-SXM4-80GB") == pytest.approx(2.039e12)
    assert memory_bandwidth("NVIDIA L4") == 0.3e12 and memory_bandwidth("NVIDIA L40S") == 0.864e12
    assert memory_bandwidth("NVIDIA Imaginary 9000") is None
    unknown = decode_floor(LLAMA3_8B, torch.bfloat16, device="NVIDIA Imaginary 9000", context_tokens_per_step=1,
                           step_ms=5.0)
    assert unknown["floor_ms"] is None and unknown["step_over_floor"] is None
    assert "unknown" in floor_line(unknown) and "Imaginary 9000" in floor_line(unknown)
    cpu = decode_floor(LLAMA3_8B, torch.bfloat16, device="cpu", context_tokens_per_step=1, step_ms=5.0)
    assert cpu["floor_ms"] is None and "does not apply on the CPU" in floor_line(cpu)


# torch.cuda.get_device_properties()'s memory clock (kHz) and bus width (bits), as CUDA reports them
H100_SXM = SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2619000, memory_bus_width=5120)
A100_80GB = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", memory_clock_rate=1593000, memory_bus_width=5120)
L40S = SimpleNamespace(name="NVIDIA L40S", memory_clock_rate=9001000, memory_bus_width=384)
RTX_6000_ADA = SimpleNamespace(name="NVIDIA RTX 6000 Ada Generation", memory_clock_rate=10001000,
                               memory_bus_width=384)


@pytest.mark.parametrize("card", [H100_SXM, A100_80GB, L40S])
def test_device_properties_give_the_table_figures(card):
    table = BANDWIDTH[card.name.removeprefix("NVIDIA ")] * 1e12
    assert peak_bandwidth(card) == pytest.approx(table, rel=2e-3)
    assert memory_bandwidth(card.name, card) == peak_bandwidth(card)


def test_a_card_off_the_table_gets_its_floor_from_its_properties():
    assert RTX_6000_ADA.name.removeprefix("NVIDIA ") not in BANDWIDTH
    assert memory_bandwidth(RTX_6000_ADA.name) is None
    floor = decode_floor(LLAMA3_8B, torch.bfloat16, device=RTX_6000_ADA.name, context_tokens_per_step=576,
                         step_ms=40.0, properties=RTX_6000_ADA)
    assert floor["bandwidth_tb_s"] == pytest.approx(0.960, rel=1e-3)
    assert floor["floor_ms"] == pytest.approx(1e3 * (floor["weight_bytes"] + floor["kv_bytes"]) / 0.96e12, rel=1e-3)
    assert "at 0.96 TB/s" in floor_line(floor)


@pytest.mark.parametrize("missing", [SimpleNamespace(name="NVIDIA L40S"),  # torch without the fields
                                     SimpleNamespace(name="NVIDIA L40S", memory_clock_rate=0, memory_bus_width=384)])
def test_properties_without_a_memory_clock_fall_back_to_the_table(missing):
    assert peak_bandwidth(missing) is None
    assert memory_bandwidth(missing.name, missing) == 0.864e12


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_context_is_every_key_each_step_attends_over(overlap):
    config = replace(preset("tiny"), eos_token_ids=())  # no EOS: every request runs its max_new_tokens
    llm = LLM(DecoderModel.random(config, dtype=torch.float32, device="cpu"), overlap=overlap)
    lengths, new = [3, 10, 6], 5
    llm.generate([[1] * n for n in lengths], max_new_tokens=new)
    stats = llm.last_stats
    # the first token comes from the prefill; the decode step making token j (2..new) attends over n + j - 1 keys
    want = sum(n + j - 1 for n in lengths for j in range(2, new + 1))
    assert stats.decode_steps == new - 1 and stats.decode_context_tokens == want
    assert stats.summary()["decode_context_per_step"] == want / (new - 1)
    assert stats.summary()["decode_batch_mean"] == 3


def test_an_fp8_kv_cache_halves_the_kv_bytes_of_the_floor():
    common = dict(device="NVIDIA H200", context_tokens_per_step=576 * 64, step_ms=5.0)
    bf16 = decode_floor(LLAMA3_8B, torch.bfloat16, **common)
    fp8 = decode_floor(LLAMA3_8B, torch.bfloat16, kv_dtype=torch.float8_e4m3fn, **common)
    assert fp8["kv_bytes"] == bf16["kv_bytes"] // 2 == 64 * 1024 * 576 * 64
    assert fp8["weight_bytes"] == bf16["weight_bytes"] and fp8["floor_ms"] < bf16["floor_ms"]
