"""What a `Worker` holds of one fragment: its parameters, its outer state, its round counter,
the tokens it has trained on since its last round, the hash chain of the rounds applied, the
results joiners may replay, its error-feedback residual, and its round in flight.

`Worker` keeps one `FragmentState` per fragment (`Worker.frags`, by fragment index) and
its methods loop over them; the per-fragment bookkeeping lives here. Tensor work that
depends on the node's ranks (slices, merges into the inner model) stays in the Worker,
which goes through `Ranks`. No networking, no ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dilonode.algo.chain import chain_next
from dilonode.algo.fragments import Fragment
from dilonode.algo.mixing import mixed_chain, pack_state, unpack_state
from dilonode.algo.outer import NonFiniteError, OuterState
from dilonode.algo.replay import EncodedResult, keep_replay, replay_budget
from dilonode.collective import PendingReduce, ReduceResult

__all__ = ["FragmentState", "InFlight"]


@dataclass(frozen=True)
class InFlight:
    """A fragment's round that has started and not landed yet."""

    round: int
    handle: PendingReduce
    launched_at: int  # the worker's own step it started at
    # An end-of-run mixing round (`Worker.start_mix`): it claims no round counter.
    mix: bool = False


@dataclass
class FragmentState:
    """One fragment of a worker (see the module docstring)."""

    index: int
    fragment: Fragment
    params: list[nn.Parameter]  # the inner model's parameters of this fragment
    outer: OuterState  # this rank's slice of the fragment (one rank: all of it)
    chain: str  # hash chain of the rounds applied (algo/chain.py); moves when a round lands
    next_round: int = 0  # the next round to start
    tokens_since: int = 0  # tokens trained since its last round started
    # The last rounds applied, consecutive: (round, its result as the codec carried it),
    # when the collective keeps encoded results; served so that joiners a few rounds behind
    # replay them (`keep_replay`).
    replays: list[tuple[int, EncodedResult]] = field(default_factory=list)
    pending: InFlight | None = None  # the round in flight
    # Error feedback (algo/error_feedback.py): what this node has not sent yet of its
    # pseudo-gradients, [slice] float32, None before its first round or after an adoption
    # (the local weights hold it; the landing merge and a resume keep it in them); and the
    # residual from before the round in flight (restored if it is abandoned).
    residual: torch.Tensor | None = None
    residual_before: torch.Tensor | None = None
    # A sparse round in flight: the positions its values sit at (algo/sparse.py).
    sparse_positions: torch.Tensor | None = None

    def landed(self) -> int:
        """Rounds whose result is in the outer state: those started, less one in flight (a
        mixing round claims no counter)."""
        return self.next_round - (self.pending is not None and not self.pending.mix)

    def claim(self, r: int) -> tuple[int, int]:
        """Round r starts: the counter moves past it and the tokens trained since the last
        start go with it. Returns (rounds jumped over, tokens it carries)."""
        missed, tokens = max(r - self.next_round, 0), self.tokens_since
        self.tokens_since, self.next_round = 0, r + 1
        return missed, tokens

    def launched(self, r: int, handle: PendingReduce, step: int, mix: bool = False) -> None:
        """Round r is in flight from own step `step` on."""
        self.pending = InFlight(r, handle, step, mix)

    def take_landing(self) -> InFlight:
        """The round in flight, which is landing now: the fragment has none in flight after
        this."""
        landing = self.pending
        assert landing is not None, f"fragment {self.index}: no round in flight to land"
        self.pending = None
        self.residual_before = None
        return landing

    def hold_residual(self, residual: torch.Tensor) -> None:
        """The round starting now leaves `residual` unsent (kept until it lands or is
        abandoned)."""
        self.residual_before, self.residual = self.residual, residual

    def abandon(self) -> None:
        """Give the round in flight up unapplied (a node that is stopping): the counter goes
        back to its round, which the outer state never had."""
        before = self.residual_before
        landing = self.take_landing()
        self.sparse_positions = None
        if not landing.mix:
            self.next_round = landing.round
            self.residual = before  # the round never carried anything

    def outer_step(self, r: int, result: ReduceResult, keep_rounds: int,
                   lr: float | None = None,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
        """Round r's outer step on its (localized) result: the new global weights [slice].
        A mixing result's mean state is adopted first. The chain records the round, applied
        or refused: `NonFiniteError` propagates with the outer state unchanged. A round
        averaged with others whose result the collective kept encoded is kept for joiners,
        after the rounds kept before it (`keep_rounds` at most). `lr`: the round's outer rate
        (default: the outer state's own). `positions`: a sparse round's, the only values it
        steps (algo/outer.py)."""
        kept, self.replays = self.replays, []
        if result.state_mean is not None:  # the group's mean state: every member steps it
            self.load_packed(result.state_mean)
            self.chain = mixed_chain(result.state_digest)
        try:
            new_global = self.outer.step(result.mean, lr, positions)
        except NonFiniteError:
            self.chain = chain_next(self.chain, r, result.digest, applied=False)
            raise
        self.chain = chain_next(self.chain, r, result.digest, applied=True)
        if (result.encoded is not None and result.report.group_size > 1
                and result.state_mean is None):
            self.replays = keep_replay(kept, r, result.encoded, keep_rounds,
                                       replay_budget(result.encoded.numel))
        return new_global

    def adopt_mixed(self, packed: torch.Tensor, digest: str) -> None:
        """An end-of-run mixing round landed: its group's mean packed state is ours."""
        self.load_packed(packed)
        self.chain = mixed_chain(digest)

    def adopt_counters(self, rounds: int, chain: str | None) -> None:
        """After importing a state of this fragment: its round counter and (when it knows
        it) chain; the replays kept and the tokens counted belong to the state left."""
        self.next_round, self.tokens_since = rounds, 0
        self.replays = []
        self.residual = None  # a debt against the state left (a resume restores its own)
        if chain is not None:
            self.chain = chain

    def replayable(self) -> tuple[EncodedResult, ...]:
        """The results joiners may replay onto the landed state: the rounds kept, if the
        last of them is the last landed."""
        if self.replays and self.replays[-1][0] == self.landed() - 1:
            return tuple(enc for _, enc in self.replays)
        return ()

    def packed(self) -> torch.Tensor:
        """The outer state as one flat vector (mixing rounds, algo/mixing.py)."""
        return pack_state(self.outer.weights, self.outer.momentum_buf)

    def load_packed(self, packed: torch.Tensor) -> None:
        weights, momentum = unpack_state(packed)
        self.outer.weights.copy_(weights)
        self.outer.momentum_buf.copy_(momentum)
