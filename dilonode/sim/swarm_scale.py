"""A swarm of hundreds or thousands of nodes in one process: bounded groups at scale.

Each simulated round of one fragment runs what the daemon runs, minus the sockets:

1. **Views and keys.** Every live node reads the live set as peer records show it:
   everyone alive now, plus nodes that left less than `peer_ttl_s` ago (their records
   have not expired), each of those seen by a node with probability 1/2 (records expire
   and replicate unevenly). From its own count it derives the number of keys and its key
   (`algo.groups.num_keys`, `key_index`), and it reads only its key's registrations.
2. **Matchmaking.** The key's leader (smallest registered peer id) closes once every peer
   its view puts in the key has registered, else at the end of its window; it splits the
   registrations into groups of at most M (`algo.groups.split_members`). A leader that
   dies before closing costs its key a window plus a second, then a retry without it.
3. **Rounds.** Each group runs real `AllReduceRound`s over the in-memory network
   (`allreduce.memnet.MemNet`, real frames): the pseudo-gradient with the configured
   codec and, in mixing rounds (`algo.groups.mixes`), the packed outer state in float32.
   A member that dies mid-round is silenced: the round fails at its deadline and the
   others retry without it (as `SwarmRounds` does), up to `max_attempts`, then go alone.
   Bytes are the rounds' own counters (frames included), latency is matchmaking plus the
   network's virtual time plus the time to push the bytes through `link_mbps`.
4. **Outer step.** Each member steps its outer state (the group's mean state when mixed)
   with the group's mean pseudo-gradient (`algo.outer.OuterState`).

Pseudo-gradients are synthetic: `update_scale * (c_r + noise * xi_i)`, a direction shared
by the round plus per-node noise. Churn: per simulated minute a share `churn_per_min` of
the nodes leaves, each at a uniform moment of a round period (during matchmaking, during
the round, or after it), and as many join at round boundaries, adopting the outer state
of a live node (as state sync does: the first mixing round pulls it in).

`run_swarm(cfg)` returns one `RoundStats` per round. Deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

import torch

from dilonode.algo.groups import grouped, key_index, mixes, num_keys, split_members
from dilonode.algo.mixing import pack_state, spread, unpack_state
from dilonode.algo.outer import OuterState
from dilonode.allreduce.memnet import Faults, MemNet
from dilonode.allreduce.round import AllReduceRound, GroupSpec, RoundState

__all__ = ["RoundStats", "SwarmSimConfig", "run_swarm", "summarize"]

_RUN = "swarmsim"
_POLL_S = 0.25  # a group whose peers are all in closes about a poll after the last one


@dataclass(frozen=True)
class SwarmSimConfig:
    """One simulated swarm (see the module docstring for the model)."""

    nodes: int = 1000
    max_group_size: int = 16
    rounds: int = 20
    numel: int = 1024  # values of the synthetic fragment
    codec: str = "int4"
    block_size: int = 64
    mix_every: int = 1  # mixing rounds: every n-th (0: never)
    round_period_s: float = 30.0  # seconds between two rounds of the fragment
    churn_per_min: float = 0.0  # share of nodes leaving (and joining) per minute
    window_s: float = 2.0
    timeout_s: float = 30.0
    max_attempts: int = 3
    peer_ttl_s: float = 15.0
    link_latency_s: float = 0.025
    link_mbps: float = 100.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    update_scale: float = 1e-3
    noise: float = 1.0
    init_spread: float = 0.0  # relative spread of the nodes' initial outer weights
    seed: int = 0


@dataclass
class RoundStats:
    """What one round of the swarm did; per-node figures over the nodes that took part."""

    round: int
    live: int
    keys: int
    groups: int
    group_max: int
    group_mean: float
    spread_max: float  # max over live nodes of ||g_i - mean|| / ||mean|| after the round
    spread_mean: float
    bytes_mean: float  # bytes a node sent this round (frames included)
    bytes_max: float
    peers_mean: float  # data-plane peers a node exchanged frames with this round
    peers_max: int
    reads_mean: float  # registrations a node read from its key
    latency_p50: float  # seconds from the round's start to a node's result
    latency_max: float
    failed_attempts: int = 0
    alone: int = 0  # nodes that ended the round in a group of one
    left: int = 0
    joined: int = 0
    mixed: bool = False
    # Mean over nodes of ||g_after - g_before|| / ||g_before||: one round's outer update,
    # the unit the spread compares with (a spread of 0.1 update is a tenth of a step).
    update_rel: float = 0.0


@dataclass
class _Node:
    peer_id: str
    outer: OuterState
    alive: bool = True


@dataclass
class _Outcome:
    """One group's result for its members."""

    members: tuple[str, ...]
    mean: torch.Tensor | None
    state: torch.Tensor | None
    latency: float
    bytes_sent: dict[str, int] = field(default_factory=dict)
    failed: int = 0


class _Swarm:
    def __init__(self, cfg: SwarmSimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.base = torch.randn(cfg.numel, generator=self.gen)  # [numel] initial weights
        self.nodes: dict[str, _Node] = {}
        self.ghosts: dict[str, float] = {}  # left, record alive: peer -> seconds it has left
        self._next_id = 0
        self._live: list[str] | None = None  # cached until membership changes
        for _ in range(cfg.nodes):
            self._add(None)

    # -- membership ----------------------------------------------------------------------
    def _add(self, adopt: _Node | None) -> str:
        peer = f"P{self.rng.getrandbits(48):012x}{self._next_id:06d}"
        self._next_id += 1
        c = self.cfg
        if adopt is None:
            noise = torch.randn(c.numel, generator=self.gen) * (c.init_spread
                                                                 * self.base.norm()
                                                                 / math.sqrt(c.numel))
            outer = OuterState(self.base + noise, c.outer_lr, c.outer_momentum)
        else:  # a joiner fetches a live peer's outer state (weights and momentum)
            outer = OuterState(adopt.outer.weights, c.outer_lr, c.outer_momentum)
            outer.momentum_buf.copy_(adopt.outer.momentum_buf)
        self.nodes[peer] = _Node(peer, outer)
        self._live = None
        return peer

    def live(self) -> list[str]:
        if self._live is None:
            self._live = sorted(p for p, n in self.nodes.items() if n.alive)
        return self._live

    def churn(self) -> tuple[dict[str, float], int]:
        """Who leaves during the coming round period (peer -> moment) and how many join."""
        c = self.cfg
        rate = c.churn_per_min * len(self.live()) * c.round_period_s / 60.0
        leave = _poisson(self.rng, rate)
        join = _poisson(self.rng, rate)
        leaving = self.rng.sample(self.live(), min(leave, len(self.live()) - 1))
        return {p: self.rng.uniform(0.0, c.round_period_s) for p in leaving}, join

    def view(self, me: str) -> list[str]:
        """The peers `me` believes alive: the live set plus unexpired records of the
        departed, each seen with probability 1/2."""
        seen = [p for p in self.ghosts if self.rng.random() < 0.5]
        return self.live() + seen


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _spec(members: tuple[str, ...], numel: int, codec: str, block: int, r: int,
          attempt: int, wire_fragment: int) -> GroupSpec:
    return GroupSpec(run_id=_RUN, fragment=wire_fragment, round=r, members=members,
                     weights=(1.0,) * len(members), numel=numel, codec=codec,
                     block_size=block, chunk_numel=max(block, -(-numel // block) * block),
                     attempt=attempt)


def _run_rounds(spec: GroupSpec, values: dict[str, torch.Tensor], dead: set[str],
                cfg: SwarmSimConfig) -> tuple[torch.Tensor | None, float, dict[str, int]]:
    """One all-reduce among `spec.members` over `MemNet`, members in `dead` silent: (the
    result, None if it failed; virtual seconds, the link time included; bytes each sent)."""
    rounds = [AllReduceRound(spec, i, values[p], timeout=cfg.timeout_s)
              for i, p in enumerate(spec.members)]
    faults = Faults()
    for i, p in enumerate(spec.members):
        if p in dead:
            faults.silence(i)
    # Messages cross as objects (frames are exercised by the round tests); `bytes_sent`
    # counts the frames the rounds encode either way.
    net = MemNet(rounds, faults, latency=cfg.link_latency_s, wire=False)
    net.run()
    sent = {p: rounds[i].bytes_sent for i, p in enumerate(spec.members)}
    busiest = max(max(r.bytes_sent, r.bytes_received) for r in rounds)
    seconds = net.now + busiest * 8 / (cfg.link_mbps * 1e6)
    live = [i for i, p in enumerate(spec.members) if p not in dead]
    done = bool(live) and all(rounds[i].state is RoundState.DONE for i in live)
    return (rounds[live[0]].result if done else None), seconds, sent


class _RoundRunner:
    """One round r of the swarm: matchmaking per key, rounds per group, outer steps."""

    def __init__(self, swarm: _Swarm, r: int, leaving: dict[str, float]) -> None:
        self.swarm, self.r, self.cfg = swarm, r, swarm.cfg
        self.leaving = leaving
        # Only a swarm larger than M averages in groups and mixes states (else: one group).
        self.mixing = grouped(len(swarm.live()), self.cfg.max_group_size) and \
            mixes(r, self.cfg.mix_every)
        self.pgs: dict[str, torch.Tensor] = {}
        common = torch.randn(self.cfg.numel, generator=swarm.gen)
        for p in swarm.live():
            xi = torch.randn(self.cfg.numel, generator=swarm.gen)
            self.pgs[p] = self.cfg.update_scale * (common + self.cfg.noise * xi)

    def keys(self) -> tuple[dict[int, list[str]], dict[str, tuple[int, int, list[str]]]]:
        """Registrations per key, and per node (keys it counts, its key, its view)."""
        c, reg, per_node = self.cfg, {}, {}
        for p in self.swarm.live():
            view = self.swarm.view(p)
            k = num_keys(len(view), c.max_group_size)
            idx = key_index(_RUN, 0, self.r, p, k)
            per_node[p] = (k, idx, view)
            reg.setdefault(idx, []).append(p)  # the departed of earlier periods: ghosts
        return reg, per_node

    def matchmaking_s(self, idx: int, members: list[str], leader_view: tuple[int, int,
                                                                           list[str]]) -> float:
        """The leader closes at once when every peer its view puts in the key is in."""
        k, _, view = leader_view
        wanted = {q for q in view if key_index(_RUN, 0, self.r, q, k) == idx}
        return _POLL_S if wanted <= set(members) else self.cfg.window_s

    def run_key(self, idx: int, members: list[str],
                per_node: dict[str, tuple[int, int, list[str]]]) -> list[_Outcome]:
        c = self.cfg
        t = 0.0
        attempt = 0
        members = sorted(members)
        leader = members[0]
        t += self.matchmaking_s(idx, members, per_node[leader])
        if self.leaving.get(leader, math.inf) < t:  # died before closing: blamed
            t += c.window_s + 1.0 + _POLL_S
            members, attempt = members[1:], 1
        out = []
        for group in split_members(members, c.max_group_size, _RUN, 0, self.r):
            out += self.run_group(tuple(group), t, attempt)
        return out

    def run_group(self, members: tuple[str, ...], t: float, attempt: int) -> list[_Outcome]:
        """Pseudo-gradient (and state) rounds with retries, as `SwarmRounds` runs them: a
        retry re-registers under attempt + 1 and expects the failed group's members minus
        the blamed (peers dead since do not register: a window), then runs again."""
        c, failed = self.cfg, 0
        sent: dict[str, int] = {}
        while attempt < c.max_attempts and len(members) > 1:
            # Leaving within the round's first second: silent (a round takes less here).
            dead = {p for p in members if self.leaving.get(p, math.inf) < t + 1.0}
            mean, state, t = self._attempt(members, dead, t, attempt, sent)
            if mean is not None:
                return [_Outcome(members, mean, state, t, sent, failed)]
            failed += 1
            attempt += 1
            expected = [p for p in members if p not in dead]  # the blamed are not waited for
            members = tuple(p for p in expected if self.leaving.get(p, math.inf) >= t)
            t += _POLL_S if len(members) == len(expected) else c.window_s
        return [_Outcome((p,), None, None, t, sent if i == 0 else {}, failed)
                for i, p in enumerate(members)]

    def _attempt(self, members: tuple[str, ...], dead: set[str], t: float, attempt: int,
                 sent: dict[str, int]) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                float]:
        """One attempt: the pseudo-gradient round, then (mixing rounds) the state round;
        (mean or None, mean state or None, the time it ended)."""
        c = self.cfg
        spec = _spec(members, c.numel, c.codec, c.block_size, self.r, attempt, 0)
        mean, secs, got = _run_rounds(spec, self.pgs, dead, c)
        _add(sent, got)
        t += secs
        if mean is None or not self.mixing:
            return mean, None, t
        states = {p: pack_state(self.swarm.nodes[p].outer.weights,
                                self.swarm.nodes[p].outer.momentum_buf) for p in members}
        spec = _spec(members, 2 * c.numel, "float32", c.block_size, self.r, attempt, 1 << 31)
        state, secs, got = _run_rounds(spec, states, dead, c)
        _add(sent, got)
        return mean, state, t + secs


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for p, b in more.items():
        total[p] = total.get(p, 0) + b


def _apply(swarm: _Swarm, runner: _RoundRunner, outcome: _Outcome) -> None:
    """Every member of a finished group steps its outer state (the group's mean state in a
    mixing round) with the group's mean pseudo-gradient; a lone node uses its own."""
    for p in outcome.members:
        node = swarm.nodes[p]
        if not node.alive or runner.leaving.get(p, math.inf) < outcome.latency:
            continue
        if outcome.state is not None:
            g, m = unpack_state(outcome.state)
            node.outer.weights.copy_(g)
            node.outer.momentum_buf.copy_(m)
        node.outer.step(outcome.mean if outcome.mean is not None else runner.pgs[p])


def _one_round(swarm: _Swarm, r: int) -> RoundStats:
    leaving, joining = swarm.churn()
    runner = _RoundRunner(swarm, r, leaving)
    registered, per_node = runner.keys()
    outcomes: list[_Outcome] = []
    for idx in sorted(registered):
        outcomes += runner.run_key(idx, registered[idx], per_node)
    before = {p: swarm.nodes[p].outer.weights.clone() for p in swarm.live()}
    for o in outcomes:
        _apply(swarm, runner, o)
    stats = _stats(swarm, r, outcomes, registered, per_node)
    stats.update_rel = statistics.fmean(
        float((swarm.nodes[p].outer.weights - w).norm() / w.norm()) for p, w in before.items())
    _advance(swarm, leaving, joining)
    stats.left, stats.joined = len(leaving), joining
    stats.mixed = runner.mixing
    return stats


def _advance(swarm: _Swarm, leaving: dict[str, float], joining: int) -> None:
    """The round period ends: the departed become ghosts until their records expire,
    joiners arrive with a live node's state."""
    c = swarm.cfg
    swarm.ghosts = {p: s + c.round_period_s for p, s in swarm.ghosts.items()
                    if s + c.round_period_s < c.peer_ttl_s}
    swarm._live = None
    for p, at in leaving.items():
        swarm.nodes[p].alive = False
        since = c.round_period_s - at
        if since < c.peer_ttl_s:
            swarm.ghosts[p] = since
    for p in [p for p, n in swarm.nodes.items() if not n.alive and p not in swarm.ghosts]:
        del swarm.nodes[p]
    live = swarm.live()
    for _ in range(joining):
        swarm._add(swarm.nodes[swarm.rng.choice(live)])


def _stats(swarm: _Swarm, r: int, outcomes: list[_Outcome],
           registered: dict[int, list[str]],
           per_node: dict[str, tuple[int, int, list[str]]]) -> RoundStats:
    live = swarm.live()
    worst, mean = spread([swarm.nodes[p].outer.weights for p in live])
    sent: dict[str, int] = {}
    peers: dict[str, int] = {}
    latency: dict[str, float] = {}
    for o in outcomes:
        _add(sent, o.bytes_sent)
        for p in o.members:
            peers[p] = len(o.members) - 1
            latency[p] = o.latency
    sizes = [len(o.members) for o in outcomes]
    byte_counts = [sent.get(p, 0) for p in per_node]
    lat = list(latency.values())
    return RoundStats(
        round=r, live=len(live), keys=max(k for k, _, _ in per_node.values()),
        groups=len(outcomes), group_max=max(sizes), group_mean=statistics.fmean(sizes),
        spread_max=worst, spread_mean=mean, bytes_mean=statistics.fmean(byte_counts),
        bytes_max=max(byte_counts), peers_mean=statistics.fmean(peers.values()),
        peers_max=max(peers.values()),
        reads_mean=statistics.fmean(len(registered.get(idx, ())) for _, idx, _ in
                                    per_node.values()),
        latency_p50=statistics.median(lat), latency_max=max(lat),
        failed_attempts=sum(o.failed for o in outcomes), alone=sum(s == 1 for s in sizes))


def run_swarm(cfg: SwarmSimConfig) -> list[RoundStats]:
    """Simulate `cfg.rounds` rounds of one fragment; one `RoundStats` per round."""
    swarm = _Swarm(cfg)
    return [_one_round(swarm, r) for r in range(cfg.rounds)]


def summarize(stats: list[RoundStats]) -> dict[str, float]:
    """The figures the targets are about, over a run."""
    return {"rounds": len(stats), "live_min": min(s.live for s in stats),
            "group_max": max(s.group_max for s in stats),
            "bytes_per_node_mean": statistics.fmean(s.bytes_mean for s in stats),
            "bytes_per_node_max": max(s.bytes_max for s in stats),
            "peers_per_node_max": max(s.peers_max for s in stats),
            "reads_per_node_mean": statistics.fmean(s.reads_mean for s in stats),
            "latency_p50": statistics.median(s.latency_p50 for s in stats),
            "latency_max": max(s.latency_max for s in stats),
            "spread_max_last": stats[-1].spread_max,
            "update_rel_mean": statistics.fmean(s.update_rel for s in stats),
            "failed_attempts": sum(s.failed_attempts for s in stats),
            "alone": sum(s.alone for s in stats)}
