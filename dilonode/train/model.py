"""The networks a run can train, and the loss every worker computes on them.

`build_model(cfg, vocab_size)` turns a `ModelConfig` into an `nn.Module`:

* ``builtin``: `Transformer`, a decoder-only Llama-style model (RMSNorm, rotary position
  embeddings, causal SDPA attention, SwiGLU MLP, pre-norm residual blocks, optional tied
  embeddings). Its parameter names are a contract with fragment assignment:
  ``tok_emb.weight``, ``blocks.{i}.<...>``, ``norm.weight`` and, only when untied,
  ``lm_head.weight``, registered in that order.
* ``factory``: ``package.module:function`` imported and called (with ``vocab_size=`` when the
  function accepts it).
* ``hf_llama``: a Hugging Face ``LlamaForCausalLM`` built from the same preset sizes, no download.
* ``hf``: a local Hugging Face model directory (``model.path``: config.json + safetensors)
  loaded with ``AutoModelForCausalLM`` and nothing downloaded; `model_identity` names it by
  the files' content, so volunteers may keep it at different paths.

`transformer_blocks(model)` lists the decoder layers FSDP2 shards one by one.

`lm_loss(model, x, y)` is the next-token cross entropy for any of them; `param_count` counts
unique parameters. Sizes come from `PRESETS`, with explicit `ModelConfig` fields winning
(`resolve_model_dims`). Initialisation draws only from torch's global RNG, so a caller's
`torch.manual_seed` makes every worker start from identical weights.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import re
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dilonode.config import ModelConfig
from dilonode.train.device import autocast
from dilonode.train.loss import chunked_cross_entropy

__all__ = [
    "PRESETS",
    "Attention",
    "Block",
    "RMSNorm",
    "SwiGLU",
    "Transformer",
    "build_model",
    "checkpoint_blocks",
    "lm_loss",
    "loss_chunk_of",
    "loss_sum",
    "mean_loss",
    "model_identity",
    "param_count",
    "resolve_model_dims",
    "transformer_blocks",
]

_DIM_KEYS = ("d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len")

PRESETS: dict[str, dict[str, int]] = {
    "nano": {"d_model": 32, "n_layers": 3, "n_heads": 2, "ffn_hidden": 64, "max_seq_len": 256},
    "tiny": {"d_model": 128, "n_layers": 6, "n_heads": 4, "ffn_hidden": 384, "max_seq_len": 512},
    "small": {"d_model": 256, "n_layers": 8, "n_heads": 8, "ffn_hidden": 768,
              "max_seq_len": 1024},
    "150m": {"d_model": 768, "n_layers": 18, "n_heads": 12, "ffn_hidden": 2048,
             "max_seq_len": 2048},
    "1b": {"d_model": 2048, "n_layers": 22, "n_heads": 16, "ffn_hidden": 5632,
           "max_seq_len": 2048},
}

# The chunked loss's tokens per chunk when `loss_chunk_tokens = "auto"`, from this vocabulary
# size up: a [1024, 32000] float32 chunk is 131 MB, where whole logits of 8 x 1024 tokens are
# 1 GB (and as much again for their gradient).
_AUTO_LOSS_CHUNK = 1024
_CHUNKED_VOCAB = 8192
_INIT_STD = 0.02
_NORM_EPS = 1e-5
_ROPE_BASE = 10000.0


def resolve_model_dims(cfg: ModelConfig) -> dict[str, int]:
    """The preset's sizes with every explicitly set `ModelConfig` field laid over them."""
    if cfg.preset not in PRESETS:
        raise ValueError(f"model.preset = {cfg.preset!r}: unknown, expected one of "
                         f"{', '.join(PRESETS)}")
    dims = dict(PRESETS[cfg.preset])
    for key in _DIM_KEYS:
        value = getattr(cfg, key)
        if value is not None:
            dims[key] = int(value)
    # Overriding d_model alone can break the preset's head split, which config.py cannot see.
    if dims["d_model"] % dims["n_heads"]:
        raise ValueError(f"model.d_model = {dims['d_model']}: must be divisible by "
                         f"model.n_heads = {dims['n_heads']} (preset {cfg.preset!r} merged)")
    if (dims["d_model"] // dims["n_heads"]) % 2:
        raise ValueError(f"model.d_model = {dims['d_model']}: head size d_model/n_heads = "
                         f"{dims['d_model'] // dims['n_heads']} must be even for rotary "
                         "embeddings")
    return dims


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = _NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: bf16 squares lose too much precision at large widths.
        xf = x.float()  # [..., D]
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def _rope_tables(head_dim: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] for the rotate-half rotary formulation."""
    inv_freq = 1.0 / (_ROPE_BASE ** (torch.arange(0, head_dim, 2).float() / head_dim))  # [Dh/2]
    pos = torch.arange(max_seq_len).float()  # [S]
    freqs = torch.outer(pos, inv_freq)  # [S, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, Dh]
    return emb.cos(), emb.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, Dh] by position; cos/sin are [T, Dh]. Math in float32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)  # [B, H, T, Dh]
    return (xf * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary embeddings on queries and keys."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim)  # [B, T, 3, H, Dh]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, Dh]
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        return self.proj(out.transpose(1, 2).reshape(b, t, d))  # [B, T, D]


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # [B, T, D]


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only Llama-style language model; `forward(idx [B, T]) -> logits [B, T, V]`."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
                 ffn_hidden: int, max_seq_len: int, tie_embeddings: bool = True,
                 loss_chunk: int = 0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # > 0: `forward(idx, targets)` returns the loss, `loss_chunk` tokens at a time
        # (`chunked_cross_entropy`), and the logits are never whole.
        self.loss_chunk = loss_chunk
        self.max_seq_len = max_seq_len
        self.n_layers = n_layers
        self.tie_embeddings = tie_embeddings
        # Registration order is part of the fragment contract: emb, blocks, norm, head.
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, ffn_hidden) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        cos, sin = _rope_tables(d_model // n_heads, max_seq_len)
        # Non-persistent: derived data, so it stays out of state_dict and off the wire.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2L)."""
        resid_std = _INIT_STD / math.sqrt(2 * self.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                param.normal_(0.0, resid_std)
            else:
                param.normal_(0.0, _INIT_STD)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V]; with `targets` [B, T] and `loss_chunk` set, the mean next-token
        cross entropy instead (the logits are then computed a chunk at a time)."""
        t = idx.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len = {self.max_seq_len}")
        x = self.tok_emb(idx)  # [B, T, D]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]  # [T, Dh]
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.norm(x)
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight  # [V, D]
        if targets is not None and self.loss_chunk:
            return chunked_cross_entropy(x.reshape(-1, x.shape[-1]), head, targets.reshape(-1),
                                         self.loss_chunk)
        return F.linear(x, head)  # [B, T, V]


def _import_factory(spec: str) -> Any:
    """Resolve 'package.module:function', also looking in the working directory."""
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        # Console scripts do not put the working directory on sys.path; users expect it.
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model.factory = {spec!r}: cannot import {module_name!r}: {exc}") \
            from None
    finally:
        if added:
            sys.path.remove(cwd)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"model.factory = {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def _accepts_vocab_size(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        (p.name == "vocab_size" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        or p.kind == p.VAR_KEYWORD
        for p in params
    )


def _build_factory(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    spec = cfg.factory or ""
    fn = _import_factory(spec)
    model = fn(vocab_size=vocab_size) if _accepts_vocab_size(fn) else fn()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.factory = {spec!r}: returned {type(model).__name__}, "
                         "expected a torch.nn.Module")
    return model


def _build_hf_llama(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ValueError("model.kind=hf_llama needs the 'hf' extra: "
                         "pip install 'dilonode[hf]'") from None
    dims = resolve_model_dims(cfg)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=dims["d_model"],
        intermediate_size=dims["ffn_hidden"],
        num_hidden_layers=dims["n_layers"],
        num_attention_heads=dims["n_heads"],
        num_key_value_heads=dims["n_heads"],
        max_position_embeddings=dims["max_seq_len"],
        rms_norm_eps=_NORM_EPS,
        initializer_range=_INIT_STD,
        tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(hf_cfg)


def _hf_files(path: Path) -> list[Path]:
    """The files that make a local HF model: config.json and its weights."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path = {str(path)!r}: no config.json there (expected a local "
                         "Hugging Face model directory)")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"model.path = {str(path)!r}: no *.safetensors weights there")
    index = sorted(path.glob("*.safetensors.index.json"))
    return [path / "config.json", *index, *weights]


@functools.lru_cache(maxsize=8)
def _content_digest(files: tuple[tuple[str, int, int], ...]) -> str:
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name, _size, _mtime in files:
        h.update(Path(name).name.encode() + b"\0")
        h.update_mmap(name)
    return h.hexdigest()


def model_identity(cfg: ModelConfig) -> str:
    """kind=hf: a BLAKE3 digest of the model directory's config and weights (its name in
    the run's config digest, wherever the directory lives); '' for other kinds."""
    if cfg.kind != "hf" or cfg.path is None:
        return ""
    files = _hf_files(Path(cfg.path))
    return _content_digest(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns)
                                 for f in files))


def _build_hf(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ValueError("model.kind=hf needs the 'hf' extra: pip install 'dilonode[hf]'") \
            from None
    assert cfg.path is not None  # ModelConfig checks it
    _hf_files(Path(cfg.path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(cfg.path), local_files_only=True, dtype=torch.float32)
    have = int(getattr(model.config, "vocab_size", 0) or 0)
    if have < vocab_size:
        raise ValueError(f"model.path = {str(cfg.path)!r}: vocabulary of {have} tokens, the "
                         f"data needs {vocab_size}")
    model.config.use_cache = False
    return model


_BLOCK_NAME = re.compile(r"(?:^|\.)(?:blocks|layers|layer|h)\.\d+$")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated decoder layers, in order: the classes a Hugging Face model
    names in `_no_split_modules`, else modules named like ``blocks.3`` or
    ``model.layers.3`` (the names fragment assignment reads)."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    if no_split:
        found = [m for _, m in model.named_modules() if type(m).__name__ in no_split]
        if found:
            return found
    return [m for name, m in model.named_modules() if _BLOCK_NAME.search(name)]


def loss_chunk_of(cfg: ModelConfig, vocab_size: int) -> int:
    """Tokens per chunk of the loss (`ModelConfig.loss_chunk_tokens`; 0: whole logits)."""
    chunk = cfg.loss_chunk_tokens
    if chunk == "auto":
        return _AUTO_LOSS_CHUNK if cfg.kind == "builtin" and vocab_size >= _CHUNKED_VOCAB else 0
    if chunk and cfg.kind != "builtin":
        raise ValueError(f"model.loss_chunk_tokens = {chunk}: the chunked loss is computed by "
                         f"the builtin model only (model.kind = {cfg.kind!r}); use 0 or auto")
    return int(chunk)


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Build the configured network for `vocab_size` tokens on the CPU, initialised from
    torch's global RNG. `cfg.vocab_size`, when set, may pad the vocabulary but not shrink it."""
    if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size = {cfg.vocab_size}: smaller than the data's "
                         f"vocab_size {vocab_size}")
    vocab = cfg.vocab_size or vocab_size
    chunk = loss_chunk_of(cfg, vocab)
    if cfg.kind == "factory":
        model = _build_factory(cfg, vocab)
    elif cfg.kind == "hf_llama":
        model = _build_hf_llama(cfg, vocab)
    elif cfg.kind == "hf":
        model = _build_hf(cfg, vocab)
    elif cfg.kind == "builtin":
        model = Transformer(vocab_size=vocab, tie_embeddings=cfg.tie_embeddings,
                            loss_chunk=chunk, **resolve_model_dims(cfg))
    else:
        raise ValueError(f"model.kind = {cfg.kind!r}: expected builtin, factory, hf_llama "
                         "or hf")
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    return model


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute every transformer block's activations in the backward pass instead of
    keeping them: each block keeps only its input (`torch.utils.checkpoint`, non-reentrant,
    so FSDP2's per-block hooks and autocast work inside). Parameter names do not change."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"model.activation_checkpointing: no transformer blocks found in "
                         f"{type(model).__name__} (expected modules named like blocks.0 or "
                         "model.layers.0, or a Hugging Face _no_split_modules class)")
    for block in blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)  # type: ignore[method-assign]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Bound per block (not a closure), so a deep copy of the model rebinds to the copy.
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, self, *args, use_reentrant=False,
                                             preserve_rng_state=False, **kwargs)


def _logits_of(output: Any) -> torch.Tensor:
    """Logits from a plain tensor, an HF ModelOutput (`.logits`) or a tuple (first item)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(f"model output of type {type(output).__name__}: expected logits tensor "
                     "or an object with .logits")


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of `model(x)` against targets y (both [B, T]), in float32.
    A builtin model with a loss chunk computes it itself (`Transformer.forward(x, y)`), so
    its full logits never exist; `model` may be wrapped (DDP keeps it in `.module`)."""
    if getattr(getattr(model, "module", model), "loss_chunk", 0):
        return model(x, targets=y)  # type: ignore[no-any-return]
    logits = _logits_of(model(x))  # [B, T, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def loss_sum(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device | str,
             rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Sum of `lm_loss` of `model` (on `device`) over (x, y) batches, under the device's
    autocast; `rows` cuts each batch first (a rank's share of a node's batch)."""
    total = 0.0
    for x, y in batches:
        if rows is not None:
            x, y = rows(x), rows(y)
        with autocast(device):
            total += float(lm_loss(model, x.to(device), y.to(device)))
    return total


def mean_loss(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
              device: torch.device | str) -> float:
    """Mean `lm_loss` over (x, y) batches: `benchmarks/testbed/reeval.py`'s evaluation, the same
    sum a node's `Worker.evaluate` takes of its outer weights."""
    return loss_sum(model, batches, device) / max(len(batches), 1)


def param_count(model: nn.Module) -> int:
    """Number of distinct parameter values (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
