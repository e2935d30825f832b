"""`dilonode memory`: the estimate's parts add up, its activation figure matches a direct
measurement of a model it did not probe (other depth, batch and length), and every memory
option moves it the way it should; model FLOPs per token follow the convention for the
builtin and the Hugging Face models alike."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from dilonode.config import ModelConfig, load_config
from dilonode.status.snapshot import mfu
from dilonode.train.flops import flops_per_token, matmul_params, peak_flops
from dilonode.train.memory import estimate_memory, saved_bytes
from dilonode.train.model import build_model


def _cfg(**over: object):
    model = {"preset": "nano", "n_layers": 3, "loss_chunk_tokens": 0, **over.pop("model", {})}
    data = {"batch_size": 2, "seq_len": 96, **over.pop("data", {})}
    return load_config(overrides={"model": model, "data": data, **over})


def test_the_activation_estimate_matches_a_measurement_it_did_not_probe():
    cfg = _cfg()
    est = estimate_memory(cfg, 256)
    torch.manual_seed(0)
    measured = saved_bytes(build_model(cfg.model, 256), 256, 96, batch=2)
    assert est.activations == pytest.approx(measured, rel=0.1)
    assert est.weights == est.gradients == 4 * est.params and est.optimizer == 8 * est.params
    assert est.device_bytes == (est.weights + est.gradients + est.optimizer + est.activations
                                + est.loss + est.optimizer_step)
    assert est.host_bytes == est.outer_state == 8 * est.params


def test_each_option_moves_the_estimate_the_right_way():
    base = estimate_memory(_cfg(), 4096)
    micro = estimate_memory(_cfg(data={"micro_batch_size": 1}), 4096)
    ckpt = estimate_memory(_cfg(model={"activation_checkpointing": True}), 4096)
    chunked = estimate_memory(_cfg(model={"loss_chunk_tokens": 32}), 4096)
    outer_on_gpu = estimate_memory(_cfg(diloco={"outer_state_on_cpu": False}), 4096)
    assert micro.activations < 0.6 * base.activations and micro.micro_batch_tokens == 96
    assert ckpt.activations < base.activations
    assert chunked.loss < base.loss
    assert outer_on_gpu.device_bytes == base.device_bytes + base.outer_state
    unfused = estimate_memory(_cfg(), 4096, fused_optimizer=False)
    assert unfused.optimizer_step > 0 == base.optimizer_step


def test_the_command_prints_the_estimate_and_refuses_what_it_cannot_measure():
    ok = subprocess.run([sys.executable, "-m", "dilonode.cli", "memory", "--set",
                         "model.preset=nano", "--vocab", "1000", "--json"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["device_bytes"] > doc["weights"] > 0 and doc["params"] > 0
    bad = subprocess.run([sys.executable, "-m", "dilonode.cli", "memory", "--set",
                          "model.kind=factory", "--set", "model.factory=x:y"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "memory estimate measures builtin" in bad.stderr


def test_flops_per_token_counts_matmuls_and_attention():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="nano"), 256)  # tied: the head is the embedding
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_params(model) == linear + 256 * 32
    layers, width, seq = 3, 32, 64
    assert flops_per_token(model, seq) == 6 * (linear + 256 * 32) + 12 * layers * width * seq


def test_a_hugging_face_llama_costs_what_the_builtin_model_of_its_preset_does():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = build_model(ModelConfig(preset="nano"), 256)
    hf = build_model(ModelConfig(kind="hf_llama", preset="nano"), 256)
    assert flops_per_token(hf, 128) == flops_per_token(ours, 128)


def test_peaks_by_device_name_and_the_share_of_them():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops("Intel(R) Xeon(R) Processor") is None
    assert peak_flops("Intel(R) Xeon(R) Processor", override_tflops=2.0) == 2e12
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert mfu(1000.0, 1e9, None) is None
