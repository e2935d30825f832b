"""Model FLOPs per token and model FLOPs utilization (MFU), the figure GPU owners compare.

`flops_per_token(model, seq_len)` counts what one trained token costs the model, forward and
backward, by the usual convention (PaLM, nanoGPT, torchtitan): 6 x the parameters of every
matrix multiply (the output head included, the embedding lookup not) plus 12 x layers x width
x sequence length for attention's scores and weighted sum. Recomputation (activation
checkpointing, the chunked loss) does not count: MFU measures useful work.

`peak_flops(device_name)` is the dense bf16 tensor peak of common GPUs from their vendors'
sheets (`PEAK_FLOPS`, matched by name); `status.peak_tflops` overrides it, and a device that
is not in the table (a CPU) has no MFU unless it is set (`status.snapshot.mfu` is the share
of the peak a run reaches).
"""

from __future__ import annotations

from torch import nn

__all__ = ["PEAK_FLOPS", "flops_per_token", "matmul_params", "peak_flops"]

# Dense bf16 (fp16 where the card has no bf16) tensor-core peak, FLOP/s, by name fragment;
# the first fragment found in the device's name wins, so longer names come first.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12),
    ("L4", 121e12), ("A6000", 155e12), ("A5000", 111e12), ("A4000", 77e12), ("A40", 150e12),
    ("A30", 165e12), ("A10G", 70e12), ("A10", 125e12), ("RTX 6000 Ada", 365e12),
    ("RTX 4090", 165e12), ("RTX 4080", 97e12), ("RTX 4070", 58e12), ("RTX 3090", 71e12),
    ("RTX 3080", 60e12), ("V100", 125e12), ("T4", 65e12), ("MI300X", 1307e12),
    ("MI250", 362e12),
)


def matmul_params(model: nn.Module) -> int:
    """Weights of every matrix multiply: each `nn.Linear` once, and a tied output head that
    multiplies by the embedding (the builtin model's) once more."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    head_is_embedding = getattr(model, "lm_head", False) is None
    emb = getattr(model, "tok_emb", None)
    if head_is_embedding and isinstance(emb, nn.Embedding):
        total += emb.weight.numel()
    return total


def _layers_and_width(model: nn.Module) -> tuple[int, int]:
    from dilonode.train.model import transformer_blocks

    layers = len(transformer_blocks(model))
    config = getattr(model, "config", None)
    width = getattr(config, "hidden_size", None)
    if width is None and isinstance(getattr(model, "tok_emb", None), nn.Embedding):
        width = model.tok_emb.embedding_dim
    return layers, int(width or 0)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Model FLOPs of one trained token at `seq_len` tokens per sequence (module docstring);
    the attention term is left out for a model whose layers or width cannot be read."""
    layers, width = _layers_and_width(model)
    return 6.0 * matmul_params(model) + 12.0 * layers * width * seq_len


def peak_flops(device_name: str, override_tflops: float = 0.0) -> float | None:
    """The device's dense bf16 peak in FLOP/s: `override_tflops` when set, else the table's
    entry for the first name fragment in `device_name`; None when neither says."""
    if override_tflops > 0:
        return override_tflops * 1e12
    for fragment, peak in PEAK_FLOPS:
        if fragment.lower() in device_name.lower():
            return peak
    return None
