"""Fragment assignment: which parameters belong to which Streaming DiLoCo fragment, and the
flat float32 views a fragment travels as.

Parameters are grouped by transformer block (parsed from names such as `blocks.3.` or
`model.layers.3.`); parameters outside any block ride with the nearest block in registration
order (embeddings with the first, final norm and head with the last). A model without block
structure is treated as one unit per parameter. Pure: names and tensors in, indices out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Fragment", "assign_fragments", "block_index", "flatten", "unflatten_into"]

_BLOCK_RE = re.compile(r"(?:^|\.)(?:blocks|layers|layer|h)\.(\d+)\.")


@dataclass(frozen=True)
class Fragment:
    """One fragment: its index, the positions of its parameters, and its blocks."""

    index: int
    param_indices: tuple[int, ...]
    blocks: tuple[int, ...]


def block_index(name: str) -> int | None:
    """Block number encoded in a parameter name, or None for non-block parameters."""
    m = _BLOCK_RE.search(name)
    return int(m.group(1)) if m else None


def _units(names: Sequence[str]) -> list[int]:
    """Unit (block) of every parameter, non-block parameters attached to a neighbour."""
    raw = [block_index(n) for n in names]
    if all(b is None for b in raw):
        return list(range(len(names)))
    blocks = sorted({b for b in raw if b is not None})
    rank = {b: i for i, b in enumerate(blocks)}
    seen_block = False
    units = []
    for b in raw:
        if b is None:
            # Before any block: embeddings belong with the first block; after: with the last.
            units.append(0 if not seen_block else len(blocks) - 1)
        else:
            seen_block = True
            units.append(rank[b])
    return units


def assign_fragments(names: Sequence[str], num_fragments: int,
                     pattern: Literal["strided", "sequential"] = "strided") -> list[Fragment]:
    """Group parameters into `num_fragments` fragments of whole blocks.

    strided: block i -> fragment i mod P (the paper's better choice); sequential: P
    contiguous runs of blocks, sizes differing by at most one.
    """
    units = _units(names)
    n_units = max(units) + 1 if units else 0
    if num_fragments < 1 or num_fragments > n_units:
        raise ValueError(f"diloco.num_fragments = {num_fragments}: the model has {n_units} "
                         "blocks; need 1 <= num_fragments <= blocks")
    if pattern == "strided":
        frag_of_unit = [u % num_fragments for u in range(n_units)]
    elif pattern == "sequential":
        frag_of_unit = [u * num_fragments // n_units for u in range(n_units)]
    else:
        raise ValueError(f"diloco.fragment_pattern = {pattern!r}: use strided or sequential")
    out = []
    for p in range(num_fragments):
        idx = tuple(i for i, u in enumerate(units) if frag_of_unit[u] == p)
        blocks = tuple(u for u in range(n_units) if frag_of_unit[u] == p)
        out.append(Fragment(index=p, param_indices=idx, blocks=blocks))
    return out


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one new 1-D float32 CPU tensor (the fragment's wire view)."""
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a flat vector back into `tensors` in place (dtype/device of each target kept)."""
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"unflatten_into: flat has {flat.numel()} values, targets hold {total}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
