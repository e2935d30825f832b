"""Where training runs: device selection from `RunConfig.device` and the matching autocast.

`pick_device(cfg.device)` returns the torch device a worker trains on; wrap each forward pass
in `with autocast(device):` to get bf16 mixed precision on CUDA and plain float32 on CPU.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

__all__ = ["autocast", "pick_device"]


def pick_device(name: Literal["auto", "cpu", "cuda"] | str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cuda' without a GPU is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device = 'cuda': no CUDA GPU is available to torch "
                             f"{torch.__version__}; use device = 'auto' or 'cpu'")
        return torch.device("cuda")
    raise ValueError(f"device = {name!r}: expected 'auto', 'cpu' or 'cuda'")


def autocast(device: torch.device | str) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA; a no-op on CPU, where bf16 matmuls are slow and gain nothing."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
