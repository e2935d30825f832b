"""The retry policy over all-reduce rounds: `SwarmRounds.reduce(request, local)`.

It asks the injected `form_group(GroupRequest(fragment, round, attempt, exclude, ...))` for
a group (the request also carries what the worker's `RoundRequest` says matchmaking
compares), runs the round (`driver.run_round`), and on failure retries with attempt+1,
excluding every peer the failures blamed, up to `max_attempts`; each failed attempt is an
`AttemptFailure` (no group formed, or the round failed) with a one-line reason. If no
attempt succeeds it returns the node's own quantized value (`decode(encode(local))`) as a
group of one, flagged `skipped`; never a partial average. In a grouped swarm (the group is
`mixing`, `algo/groups.py`) a round that `algo.groups.mixes` picks is followed, in the
same group, by a *state round*: the members' packed outer states (`algo/mixing.py`)
averaged in float32 under wire fragment `STATE_WIRE | fragment`. A state round that fails
leaves the pseudo-gradient round as it is (the node steps its own state); a "mix" key's
round is a state round alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from dilonode.algo.butterfly import CHUNKING, round_chunk_numel
from dilonode.algo.codecs import get_codec, part_align
from dilonode.algo.groups import mixes
from dilonode.algo.robust import AggregatorSpec, BanTracker
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.allreduce.driver import GRAD_FRAGMENT, STATE_WIRE, RoundOutcome, run_round
from dilonode.allreduce.round import (
    AllReduceRound,
    Failed,
    GroupSpec,
    RoundState,
    group_digest,
)
from dilonode.allreduce.transport import DataPlane
from dilonode.collective import (
    FormedGroup,
    FormGroup,
    GroupNotFormed,
    GroupRequest,
    RoundRequest,
    StateSource,
    SyncKey,
)
from dilonode.config import DEFAULT_CHUNK_NUMEL
from dilonode.wire.errors import one_line

__all__ = ['AttemptFailure', 'RoundPolicy', 'SwarmOutcome', 'SwarmRounds', 'wire_fragment']

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundPolicy:
    """How rounds are run: codec, chunking, per-attempt timeout, the number of attempts and
    how owners check and combine contributions (the same for every member of a run)."""

    codec: str = "int4"
    block_size: int = 64
    # Values per frame, as `NetworkConfig.chunk_numel` (its description has the figures).
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    timeout: float = 30.0
    max_attempts: int = 3
    aggregator: AggregatorSpec = AggregatorSpec()
    # Bounded groups: the most peers per group, and which rounds mix states (every n-th).
    max_group_size: int = 16
    mix_every: int = 1

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or not self.timeout > 0:
            raise ValueError(f"RoundPolicy: max_attempts={self.max_attempts}, "
                             f"timeout={self.timeout}: need >= 1 and > 0")

    def round_chunk(self, numel: int, members: int) -> int:
        """The chunk size of a round (`butterfly.round_chunk_numel`, capped by ours)."""
        align = part_align(get_codec(self.codec, self.block_size), self.block_size)
        return round_chunk_numel(numel, members, self.chunk_numel, align)

    def settings(self) -> dict[str, str | int | float]:
        """What every member of a group must share, as matchmaking compares it: the codec
        and chunking (the wire layout) and how owners check and combine contributions."""
        agg = self.aggregator
        return {"codec": self.codec, "block_size": self.block_size,
                "chunk_numel": self.chunk_numel, "chunking": CHUNKING,
                "aggregator": agg.name,
                "norm_bound": agg.norm_bound, "trim": agg.trim, "clip_tau": agg.clip_tau,
                "clip_iters": agg.clip_iters, "max_weight_ratio": agg.max_weight_ratio,
                "max_group_size": self.max_group_size, "mix_state_every": self.mix_every}


def wire_fragment(key: SyncKey) -> int:
    """The fragment index rounds of `key` use on the wire and in matchmaking: DDP gradients
    the reserved `GRAD_FRAGMENT`, the others their fragment's (a state round adds
    `STATE_WIRE` on the wire only)."""
    return GRAD_FRAGMENT if key.kind == "grad" else key.fragment


@dataclass(frozen=True)
class AttemptFailure:
    """Why one attempt of a round failed."""

    attempt: int
    """The attempt (0: the round's first)."""
    kind: Literal["no_group", "round_failed"]
    """"no_group": forming a group failed (no round ran); "round_failed": the round ran
    with a group and failed."""
    reason: str
    """One line saying what went wrong."""

    def line(self) -> str:
        """The failure as the log says it: "attempt 1: no group: <reason>"."""
        what = "no group: " if self.kind == "no_group" else ""
        return one_line(f"attempt {self.attempt}: {what}{self.reason}")


@dataclass(frozen=True)
class SwarmOutcome:
    """The final outcome (DONE, or a skipped group of one) and how we got there."""

    outcome: RoundOutcome
    attempts: tuple[RoundOutcome, ...]  # the rounds run, failed ones included
    excluded: Mapping[str, str] = field(default_factory=dict)  # peer id -> reason
    failures: tuple[AttemptFailure, ...] = ()  # one per failed attempt, in order
    diverged: tuple[str, ...] = ()  # see FormedGroup (the last group formed)
    outvoted: tuple[str, ...] = ()
    grouped: bool = False  # the group was one of a grouped swarm (FormedGroup.mixing)
    state: RoundOutcome | None = None  # the state round that followed, when DONE
    # What the swarm's clock may pace rounds by (ReduceResult.pace_s); None: nothing.
    pace_s: float | None = None
    forming_s: float = 0.0  # seconds spent forming groups, every attempt

    @property
    def skipped(self) -> bool:
        return self.outcome.skipped

    @property
    def tries(self) -> int:
        """Group formations tried: the rounds run and the attempts that formed no group."""
        return len(self.attempts) + sum(f.kind == "no_group" for f in self.failures)


class SwarmRounds:
    """Runs (fragment, round) reductions with retries; see the module docstring."""

    def __init__(self, plane: DataPlane, form_group: FormGroup,
                 policy: RoundPolicy | None = None, *,
                 clock: Callable[[], float] = time.monotonic, offload: bool = True,
                 bans: BanTracker | None = None, keep_encoded: bool = False) -> None:
        self.plane = plane
        self.keep_encoded = keep_encoded  # see RoundOutcome.encoded
        self.form_group = form_group
        self.policy = policy or RoundPolicy()
        self.clock = clock
        self.offload = offload
        # Peers rejected in too many rounds are left out of matchmaking (the `exclude` set
        # every FormGroup honours) until their ban ends.
        self.bans = bans

    async def reduce(self, request: RoundRequest, local: torch.Tensor,
                     out: torch.Tensor | None = None, *,
                     encoded: SplicedEncoding | None = None,
                     state: StateSource | None = None) -> SwarmOutcome:
        """Average `local` (1-D float32, trained on `request.weight` tokens) with a group,
        retrying without the culprits; every attempt hands the group former what
        `request` says of our state (`GroupRequest`). `out` (optional) receives a
        completed round's result (every attempt writes there). `encoded`: `local` as a
        node's ranks encoded it. `state` (called on a worker thread, only when a grouped
        round mixes) gives our packed outer state for the state round. A "mix" key's
        `local` is such a state, and the round averages it alone (float32, plain mean)."""
        fragment, round_no = wire_fragment(request.key), request.key.round
        mix_only = request.key.kind == "mix"
        excluded: dict[str, str] = {}
        attempts: list[RoundOutcome] = []
        failures: list[AttemptFailure] = []
        forming = 0.0
        for attempt in range(self.policy.max_attempts):
            t_attempt = self.clock()
            ask = GroupRequest(fragment, round_no, attempt, frozenset(excluded), request.chain,
                               request.tokens, request.start)
            try:
                spec, my_index, peers, formed = await self._prepare(ask, local, mix_only)
            except Exception as exc:  # a matchmaking failure must not kill the daemon
                forming += self.clock() - t_attempt
                failures.append(AttemptFailure(attempt, "no_group", one_line(str(exc))))
                log.warning("fragment %d round %d: %s", fragment, round_no, failures[-1].line())
                # A leader that never closed its group is left out of the next attempt.
                blame = exc.blame if isinstance(exc, GroupNotFormed) else None
                if blame is not None and blame != self.plane.peer_id:
                    excluded.setdefault(blame, one_line(str(exc)))
                continue
            forming += self.clock() - t_attempt
            got = await run_round(self.plane, spec, my_index, local, peers,
                                  self.policy.timeout, self.clock, offload=self.offload,
                                  aggregator=None if mix_only else self.policy.aggregator,
                                  out=out, keep_encoded=self.keep_encoded and not mix_only,
                                  weight=1.0 if mix_only else request.weight,
                                  encoded=None if mix_only else encoded)
            attempts.append(got)
            if got.state is RoundState.DONE:
                self._note_rejected(fragment, round_no, got.rejected, got.convicted)
                mixed = None
                if (formed.mixing and state is not None and not mix_only and spec.size > 1
                        and mixes(round_no, self.policy.mix_every)):
                    mixed = await self._state_round(spec, my_index, peers, state)
                # Only a whole group's attempt paces the clock (`SwarmOutcome.pace_s`).
                pace = None if formed.missing else self.clock() - t_attempt
                return SwarmOutcome(got, tuple(attempts), excluded, tuple(failures),
                                    tuple(formed.diverged), tuple(formed.outvoted),
                                    grouped=formed.mixing, state=mixed, pace_s=pace,
                                    forming_s=forming)
            failures.append(self._round_failed(ask, got, excluded))
        alone = self._alone(fragment, round_no, self.policy.max_attempts, local, mix_only)
        return SwarmOutcome(alone, tuple(attempts), excluded, tuple(failures),
                            forming_s=forming)

    def _round_failed(self, ask: GroupRequest, got: RoundOutcome,
                      excluded: dict[str, str]) -> AttemptFailure:
        """Log a failed round and exclude the peers it blamed from the next attempts."""
        assert got.failure is not None
        failure = AttemptFailure(ask.attempt, "round_failed", one_line(got.failure.reason))
        log.warning("fragment %d round %d: %s", ask.fragment, ask.round, failure.line())
        for peer_id in got.excluded_peers:
            if peer_id != self.plane.peer_id:
                excluded.setdefault(peer_id, got.failure.reason)
        return failure

    async def _state_round(self, spec: GroupSpec, my_index: int, peers: dict[int, str],
                           state: StateSource) -> RoundOutcome | None:
        """The state round after a grouped pseudo-gradient round, in the same group; None
        (no mixing for us this round) if it fails."""
        flat = await asyncio.to_thread(state)  # a copy: [2 * numel] float32
        sspec = dataclasses.replace(spec, fragment=STATE_WIRE | spec.fragment,
                                    numel=flat.numel(), codec="float32")
        got = await run_round(self.plane, sspec, my_index, flat, peers, self.policy.timeout,
                              self.clock, offload=self.offload)
        if got.state is RoundState.DONE:
            return got
        reason = got.failure.reason if got.failure else "?"
        log.warning("fragment %d round %d: state round failed (%s); stepping our own state",
                    spec.fragment, spec.round, one_line(reason))
        return None

    def _note_rejected(self, fragment: int, round_no: int, rejected: Sequence[str],
                       convicted: Sequence[str]) -> None:
        others = [p for p in rejected if p != self.plane.peer_id]
        if not others:
            return
        log.warning("fragment %d round %d: contributions rejected from %s (by a majority of "
                    "owners: %s)", fragment, round_no, ", ".join(others),
                    ", ".join(convicted) or "none")
        if self.bans is None:
            return
        now = self.clock()
        for peer in convicted:
            if peer == self.plane.peer_id:
                continue
            if self.bans.record(peer, now):
                log.warning("peer %s banned for %gs: rejected in %d rounds within %gs", peer,
                            self.bans.ban_seconds, self.bans.max_rejections,
                            self.bans.window)

    async def _prepare(self, ask: GroupRequest, local: torch.Tensor, mix_only: bool
                       ) -> tuple[GroupSpec, int, dict[int, str], FormedGroup]:
        if self.bans is not None:
            banned = self.bans.banned(self.clock()) - {self.plane.peer_id}
            ask = dataclasses.replace(ask, exclude=ask.exclude | banned)
        formed = self.form_group(ask)
        group = await formed if inspect.isawaitable(formed) else formed
        if not isinstance(group, FormedGroup):  # a bare tuple from a test's matchmaker
            group = FormedGroup(*group)
        if group.stream_only is not None:  # as the records just read say
            self.plane.stream_only = group.stream_only
        members = tuple(group.members)
        p = self.policy
        spec = GroupSpec(run_id=self.plane.run_id,
                         fragment=STATE_WIRE | ask.fragment if mix_only else ask.fragment,
                         round=ask.round, members=members, weights=tuple(group.weights),
                         numel=local.numel(), codec="float32" if mix_only else p.codec,
                         block_size=p.block_size,
                         chunk_numel=p.round_chunk(local.numel(), len(members)),
                         attempt=ask.attempt, group_digest=group.digest)
        me = group.my_index
        if not 0 <= me < len(members) or members[me] != self.plane.peer_id:
            raise ValueError(f"group {list(members)} does not hold us "
                             f"({self.plane.peer_id!r}) at index {group.my_index}")
        addrs = group.addrs
        if not isinstance(addrs, Mapping):
            addrs = dict(zip(members, addrs, strict=True))
        peers = {i: addrs[pid] for i, pid in enumerate(members) if i != group.my_index}
        return spec, group.my_index, peers, group

    def _alone(self, fragment: int, round_no: int, attempt: int,
               local: torch.Tensor, mix_only: bool = False) -> RoundOutcome:
        """Group of one: the node's own value, quantized like every contribution (a state
        of `mix_only` rounds travels in float32: it comes back exactly)."""
        me = (self.plane.peer_id,)
        p = self.policy
        spec = GroupSpec(run_id=self.plane.run_id, fragment=fragment, round=round_no,
                         members=me, weights=(1.0,), numel=local.numel(),
                         codec="float32" if mix_only else p.codec,
                         block_size=p.block_size, chunk_numel=p.round_chunk(local.numel(), 1),
                         attempt=min(attempt, 2**32 - 1), group_digest=group_digest(me))
        t0 = self.clock()
        rnd = AllReduceRound(spec, 0, local, timeout=p.timeout)
        actions = rnd.start(t0)
        assert not any(isinstance(a, Failed) for a in actions)
        return RoundOutcome(state=rnd.state, result=rnd.result, digest=rnd.digest,
                            failure=None, bytes_sent=0, bytes_received=0,
                            payload_bytes_sent=0, payload_bytes_received=0,
                            duration=self.clock() - t0, members=me, attempt=spec.attempt,
                            skipped=True)
