"""Where training runs: device selection from `RunConfig.device` and the matching autocast.

`pick_device(cfg.device)` returns the torch device a worker trains on; wrap each forward pass
in `with autocast(device):` to get bf16 mixed precision on CUDA and plain float32 on CPU.
"""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any, Literal

import torch

__all__ = ["autocast", "device_info", "pick_device"]


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


def device_info(device: torch.device) -> dict[str, Any]:
    """What the status page shows of a device: kind, name, memory in bytes."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"kind": "cuda", "name": props.name, "memory_bytes": int(props.total_memory)}
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return {"kind": "cpu", "name": platform.processor() or platform.machine(),
            "memory_bytes": int(memory)}
