"""A round's averaged pseudo-gradient as the codec carried it, and replaying it on an outer
state: how a joiner that holds a fragment (or chunks of it) a few rounds old catches up
without fetching it again.

Every member of a round ends with decode(encoded result) for every chunk, bit for bit the
same values (the round's digest checks it). Keeping those encoded chunks costs a fraction of
the fragment (int4: an eighth of its float32 values, scales included a little more), and
anyone who holds the fragment's outer weights and momentum from before the round can apply
the same float32 outer step and land exactly where the members did. Whether they did is
checked by the caller against the new state's chunk digests, so a replay that comes out
different (other arithmetic, a peer lying) costs a fetch, never a wrong state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dilonode.algo.codecs import CodecMeta, get_codec
from dilonode.algo.outer import OuterState

__all__ = ["EncodedResult", "Replayer", "keep_replay", "kept_rounds", "replay_budget",
           "replay_round", "replayer"]


@dataclass(frozen=True)
class EncodedResult:
    """A result as codec output, in value order: piece i holds `numels[i]` values, encoded
    in `data` right after piece i - 1. Decoding the pieces one by one and concatenating
    gives the result exactly (block boundaries are those the round used). One buffer, so a
    server keeps and serves it without copies."""

    codec: str
    block_size: int
    numels: tuple[int, ...]
    data: bytes

    @classmethod
    def of_pieces(cls, codec: str, block_size: int,
                  pieces: Sequence[tuple[int, bytes | memoryview]]) -> EncodedResult:
        """From (values, encoded bytes) pieces in order."""
        return cls(codec, block_size, tuple(n for n, _ in pieces),
                   b"".join(b for _, b in pieces))

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def blob(self) -> bytes:
        return self.data

    @classmethod
    def from_blob(cls, codec: str, block_size: int, numels: Sequence[int],
                  blob: bytes | memoryview) -> EncodedResult:
        """`blob` as pieces of `numels` values; ValueError when the sizes disagree."""
        c = get_codec(codec, block_size)
        size = sum(c.encoded_size(n) for n in numels)
        if size != len(blob):
            raise ValueError(f"encoded result: {len(blob)} bytes, {codec}/{block_size} needs "
                             f"{size} for {sum(numels)} values in {len(numels)} pieces")
        return cls(codec, block_size, tuple(numels), bytes(blob))

    def decode(self) -> torch.Tensor:
        """The result values, float32 [numel]; CodecError on a malformed or non-finite piece."""
        c = get_codec(self.codec, self.block_size)
        out = torch.empty(self.numel, dtype=torch.float32)
        view, at, pos = memoryview(self.data), 0, 0
        for n in self.numels:
            size = c.encoded_size(n)
            c.decode_into(view[pos:pos + size],
                          CodecMeta(codec=c.name, numel=n, block_size=c.block_size),
                          out[at:at + n])
            at, pos = at + n, pos + size
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


# (fragment, round, weights, momentum, encoded result) -> (weights, momentum) after the round
Replayer = Callable[[int, int, torch.Tensor, torch.Tensor, EncodedResult],
                    tuple[torch.Tensor, torch.Tensor]]


def replayer(lr_at: Callable[[int, int], float], momentum_coef: float,
             nesterov: bool) -> Replayer:
    """The run's outer step as a `Replayer`: round r of fragment p at rate `lr_at(p, r)`
    (the rate its members stepped with, by the reference step the round started at)."""
    def run(fragment: int, round_no: int, weights: torch.Tensor, momentum: torch.Tensor,
            result: EncodedResult) -> tuple[torch.Tensor, torch.Tensor]:
        return replay_round(weights, momentum, result, lr=lr_at(fragment, round_no),
                            momentum_coef=momentum_coef, nesterov=nesterov)
    return run


def keep_replay(kept: Sequence[tuple[int, EncodedResult]], round_no: int,
                result: EncodedResult, max_rounds: int, max_bytes: int
                ) -> list[tuple[int, EncodedResult]]:
    """The results a server keeps for a fragment after round `round_no` landed with
    `result`: the consecutive rounds before it that `kept` holds, then it; the oldest go
    first beyond `max_rounds` or `max_bytes` in all (a replay needs every round from the
    version a joiner holds, so a gap empties the list)."""
    out = list(kept) if kept and kept[-1][0] == round_no - 1 else []
    out.append((round_no, result))
    while out and (len(out) > max_rounds or sum(e.nbytes for _, e in out) > max_bytes):
        out.pop(0)
    return out


def replay_budget(numel: int) -> int:
    """The most bytes of results a server keeps for a fragment of `numel` values: as many
    as its outer state (weights and momentum, float32)."""
    return 8 * numel


def kept_rounds(max_rounds: int, numel: int, result_bytes: int) -> int:
    """How many rounds' results `keep_replay` keeps for a fragment of `numel` values whose
    results are `result_bytes` each, at `max_rounds` (statesync.replay_rounds)."""
    return min(max_rounds, replay_budget(numel) // max(result_bytes, 1))
