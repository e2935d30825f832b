"""A round's averaged pseudo-gradient as the codec carried it, and replaying it on an outer
state: how a joiner that holds a fragment one round old catches up without fetching it again.

Every member of a round ends with decode(encoded result) for every chunk, bit for bit the
same values (the round's digest checks it). Keeping those encoded chunks costs a fraction of
the fragment (int4: an eighth of its float32 values, scales included a little more), and
anyone who holds the fragment's outer weights and momentum from before the round can apply
the same float32 outer step and land exactly where the members did. Whether they did is
checked by the caller against the new state's chunk digests, so a replay that comes out
different (other arithmetic, a peer lying) costs a fetch, never a wrong state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dilonode.algo.codecs import CodecMeta, get_codec
from dilonode.algo.outer import OuterState

__all__ = ["EncodedResult", "replay_round"]


@dataclass(frozen=True)
class EncodedResult:
    """A result as pieces of codec output, in value order: piece i holds `pieces[i][0]`
    values, encoded as `pieces[i][1]`. Decoding them one by one and concatenating gives the
    result exactly (block boundaries are those the round used)."""

    codec: str
    block_size: int
    pieces: tuple[tuple[int, bytes], ...]

    @property
    def numel(self) -> int:
        return sum(n for n, _ in self.pieces)

    @property
    def numels(self) -> list[int]:
        return [n for n, _ in self.pieces]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for _, b in self.pieces)

    def blob(self) -> bytes:
        return b"".join(b for _, b in self.pieces)

    @classmethod
    def from_blob(cls, codec: str, block_size: int, numels: Sequence[int],
                  blob: bytes | memoryview) -> EncodedResult:
        """Cut `blob` into pieces of `numels` values; ValueError when the sizes disagree."""
        c = get_codec(codec, block_size)
        sizes = [c.encoded_size(n) for n in numels]
        if sum(sizes) != len(blob):
            raise ValueError(f"encoded result: {len(blob)} bytes, {codec}/{block_size} needs "
                             f"{sum(sizes)} for {sum(numels)} values in {len(numels)} pieces")
        pieces, at = [], 0
        for n, size in zip(numels, sizes, strict=True):
            pieces.append((n, bytes(blob[at:at + size])))
            at += size
        return cls(codec, block_size, tuple(pieces))

    def decode(self) -> torch.Tensor:
        """The result values, float32 [numel]; CodecError on a malformed or non-finite piece."""
        c = get_codec(self.codec, self.block_size)
        out = torch.empty(self.numel, dtype=torch.float32)
        at = 0
        for n, payload in self.pieces:
            c.decode_into(payload, CodecMeta(codec=c.name, numel=n, block_size=c.block_size),
                          out[at:at + n])
            at += n
        return out


def replay_round(weights: torch.Tensor, momentum: torch.Tensor, result: EncodedResult, *,
                 lr: float, momentum_coef: float, nesterov: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fragment's (weights, momentum) after the outer step with `result`, computed by
    `OuterState.step` itself (the members' arithmetic); the inputs are left as they are."""
    if result.numel != weights.numel():
        raise ValueError(f"replay: result has {result.numel} values, the fragment "
                         f"{weights.numel()}")
    state = OuterState(weights, lr, momentum_coef, nesterov)
    state.momentum_buf = momentum.detach().to(torch.float32).clone()
    state.step(result.decode())
    return state.weights, state.momentum_buf
