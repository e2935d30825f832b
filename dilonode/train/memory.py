"""What a node's training needs in device memory and host RAM, from its config.

`estimate_memory(cfg, vocab_size)` adds up, for one rank of one node:

* weights (float32), their gradients (float32, one buffer however many micro-batches add up
  into it) and AdamW's two moments: 16 bytes per parameter;
* what autograd keeps for the backward pass of one micro-batch, *measured*: the distinct
  non-parameter tensors saved under bf16 autocast (`torch.autograd.graph.saved_tensors_hooks`)
  by 1- and 2-block models of the config's width and vocabulary at two sequence lengths, on
  the CPU, fitted as fixed + per block + per token + per token and block, and extrapolated
  to the config's blocks and tokens. With activation checkpointing the blocks save only their
  inputs (measured so), and one block's full activations exist again while it is recomputed;
* the loss: the gradient of the logits in the backward pass, [tokens, vocab] float32 whole,
  or one chunk's logits, their float32 copy and gradient with the chunked loss;
* the AdamW step: the fused implementation (CUDA) needs no temporaries; the per-parameter
  loop (CPU) two of the largest parameter;
* the outer state (global weights and Nesterov momentum, float32: 8 bytes per parameter) in
  host RAM, or on the device when `diloco.outer_state_on_cpu` is false.

Attention is taken to keep O(tokens) memory (flash or memory-efficient SDPA kernels); the
CUDA context (a few hundred MB) and the allocator's slack come on top of `device_bytes`
(`torch.cuda.max_memory_allocated` measures the same sum). benchmarks/gpu/memory.py checks the
estimate against a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dilonode.config import ModelConfig, RunConfig
from dilonode.train.model import (
    build_model,
    lm_loss,
    loss_chunk_of,
    resolve_model_dims,
)

__all__ = ["MemoryEstimate", "estimate_memory", "saved_bytes"]

_PROBE_TOKENS = (64, 128)  # sequence lengths of the measurement (the slope is per token)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs; `device_bytes` sums what lives on the training device."""

    params: int
    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved for the backward pass of one micro-batch
    loss: int  # the logits' gradient (whole), or one chunk's logits and gradient
    optimizer_step: int  # temporaries of the AdamW step
    outer_state: int
    outer_on_device: bool
    micro_batch_tokens: int
    loss_chunk: int
    activation_checkpointing: bool

    @property
    def device_bytes(self) -> int:
        outer = self.outer_state if self.outer_on_device else 0
        return (self.weights + self.gradients + self.optimizer + self.activations + self.loss
                + self.optimizer_step + outer)

    @property
    def host_bytes(self) -> int:
        """Host RAM beyond the process itself: the outer state when it lives there."""
        return 0 if self.outer_on_device else self.outer_state

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"device_bytes": self.device_bytes, "host_bytes": self.host_bytes}


def saved_bytes(model: torch.nn.Module, vocab_size: int, seq_len: int, batch: int = 1) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in one forward of `model`
    under bf16 autocast on the CPU."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, vocab_size, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, x, x)
    del loss
    return sum(seen.values())


def _probe_models(cfg: ModelConfig, vocab_size: int) -> dict[int, torch.nn.Module]:
    """Models of the config's width with 1 and 2 blocks (the second the first plus one)."""
    torch.manual_seed(0)
    probe = cfg.model_copy(update={"n_layers": 2, "max_seq_len": max(_PROBE_TOKENS)})
    return {n: build_model(probe.model_copy(update={"n_layers": n}), vocab_size)
            for n in (1, 2)}


def _activation_model(cfg: ModelConfig, vocab_size: int) -> tuple[float, float, float, float]:
    """(fixed, per block, per token, per token and block) saved bytes, from 4 probes."""
    t1, t2 = _PROBE_TOKENS
    models = _probe_models(cfg, vocab_size)
    s = {(n, t): saved_bytes(models[n], vocab_size, t) for n in (1, 2) for t in (t1, t2)}
    per_token_1 = (s[1, t2] - s[1, t1]) / (t2 - t1)
    per_token_2 = (s[2, t2] - s[2, t1]) / (t2 - t1)
    per_token_block = per_token_2 - per_token_1
    per_token = per_token_1 - per_token_block
    at_zero_1 = s[1, t1] - t1 * per_token_1
    at_zero_2 = s[2, t1] - t1 * per_token_2
    per_block = at_zero_2 - at_zero_1
    return at_zero_1 - per_block, per_block, per_token, per_token_block


def estimate_memory(cfg: RunConfig, vocab_size: int, ranks: int = 1,
                    fused_optimizer: bool = True) -> MemoryEstimate:
    """One rank's memory for `cfg` at `vocab_size` tokens (module docstring). `ranks`
    splits the batch (DDP: every rank holds the whole model); `fused_optimizer`: the AdamW
    step of a CUDA device (no temporaries)."""
    if cfg.model.kind not in ("builtin", "hf_llama"):
        raise ValueError(f"model.kind = {cfg.model.kind!r}: the memory estimate measures "
                         "builtin and hf_llama models (their block count can be cut for the "
                         "probe)")
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    layers = resolve_model_dims(cfg.model)["n_layers"]
    per_rank = max(cfg.data.batch_size // ranks, 1)
    micro = min(cfg.data.micro_batch_size or per_rank, per_rank)
    tokens = micro * cfg.data.seq_len
    fixed, per_block, per_token, per_token_block = _activation_model(cfg.model, vocab_size)
    activations = fixed + layers * per_block + tokens * (per_token + layers * per_token_block)
    if cfg.model.activation_checkpointing:  # one block's full activations, recomputed
        plain = cfg.model.model_copy(update={"activation_checkpointing": False})
        _, block_fixed, _, block_per_token = _activation_model(plain, vocab_size)
        activations += block_fixed + tokens * block_per_token
    chunk = loss_chunk_of(cfg.model, vocab_size)
    # Whole: the logits' float32 gradient. Chunked: a chunk's bf16 logits, float32 copy and
    # gradient (the float32 copy of the whole logits is in the saved tensors measured above).
    loss = tokens * vocab_size * 4 if not chunk else min(chunk, tokens) * vocab_size * 10
    largest = max(p.numel() for p in params)
    step = 0 if fused_optimizer else 2 * 4 * largest
    outer_on_device = not cfg.diloco.outer_state_on_cpu and cfg.diloco.mode != "ddp"
    return MemoryEstimate(
        params=n, weights=4 * n, gradients=4 * n, optimizer=8 * n,
        activations=int(max(activations, 0)), loss=loss, optimizer_step=step,
        outer_state=8 * n if cfg.diloco.mode != "ddp" else 0,
        outer_on_device=outer_on_device, micro_batch_tokens=tokens, loss_chunk=chunk,
        activation_checkpointing=cfg.model.activation_checkpointing)
