"""In-memory network that runs N `AllReduceRound`s against each other, for tests.

`MemNet(rounds, faults).run()` starts every round at the fake clock's start time, then
delivers each `Send` after `latency` simulated seconds, in time order, until nothing is in
flight; whenever the next round deadline comes before the next delivery, the clock jumps
to it and every round is ticked. No threads, sockets or sleeping: a 30 s timeout costs
nothing. `Faults` is consulted on every delivery and can drop a link, silence a crashed
peer, corrupt messages (as a model or as raw frame bytes), delay a link and reorder
deliveries with a seeded RNG, so fault tests are deterministic.

With `wire=True` (the default) every frame goes through `FrameDecoder`, so messages cross
the real msgpack encoding; a frame the decoder rejects is reported with `peer_error`.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dilonode.allreduce.round import Action, AllReduceRound, Done, Failed, RoundState, Send
from dilonode.wire.errors import RemoteProtocolError
from dilonode.wire.framing import FrameDecoder, FrameParts, encode_frame_parts
from dilonode.wire.messages import Message

__all__ = ["Corruption", "Faults", "MemNet"]

# Returns a (possibly invalid) message, or raw frame bytes to push through the decoder.
Corruption = Callable[[Message], Message | bytes]


@dataclass
class Faults:
    """Fault plan consulted for every delivery; builder methods return self for chaining."""

    reorder: bool = False
    reorder_window: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._dropped: set[tuple[int, int]] = set()
        self._silenced: set[int] = set()
        self._corrupt: dict[tuple[int, int], Corruption] = {}
        self._delay: dict[tuple[int, int], float] = {}

    def drop(self, src: int, dst: int) -> Faults:
        """Lose every message from `src` to `dst`."""
        self._dropped.add((src, dst))
        return self

    def silence(self, peer: int) -> Faults:
        """`peer` crashed: it sends and receives nothing."""
        self._silenced.add(peer)
        return self

    def corrupt(self, src: int, dst: int, fn: Corruption, *, once: bool = False) -> Faults:
        """Pass messages from `src` to `dst` through `fn` (only the first one if `once`)."""
        if once:
            def first_only(msg: Message, _fn: Corruption = fn) -> Message | bytes:
                self._corrupt.pop((src, dst), None)
                return _fn(msg)
            self._corrupt[(src, dst)] = first_only
        else:
            self._corrupt[(src, dst)] = fn
        return self

    def delay(self, src: int, dst: int, seconds: float) -> Faults:
        """Add `seconds` to every delivery from `src` to `dst`."""
        self._delay[(src, dst)] = seconds
        return self

    def apply(self, src: int, dst: int, msg: Message) -> Message | bytes | None:
        """What reaches `dst`: the message, a corrupted version or raw bytes, or None."""
        if src in self._silenced or dst in self._silenced or (src, dst) in self._dropped:
            return None
        fn = self._corrupt.get((src, dst))
        return msg if fn is None else fn(msg)

    def extra_delay(self, src: int, dst: int) -> float:
        jitter = self.rng.uniform(0.0, self.reorder_window) if self.reorder else 0.0
        return self._delay.get((src, dst), 0.0) + jitter


@dataclass(order=True)
class _InFlight:
    at: float
    tiebreak: float
    seq: int
    src: int = field(compare=False)
    dst: int = field(compare=False)
    what: Message | FrameParts = field(compare=False)  # a message, or a frame's bytes


class MemNet:
    """Runs rounds (index = member index) over a fake clock; see the module docstring."""

    def __init__(self, rounds: Sequence[AllReduceRound], faults: Faults | None = None, *,
                 start: float = 0.0, latency: float = 0.001, wire: bool = True) -> None:
        self.rounds = list(rounds)
        self.faults = faults or Faults()
        self.now = start
        self.latency = latency
        self.wire = wire
        self.delivered = 0
        self.dropped = 0
        self.outcomes: dict[int, Done | Failed] = {}
        self._queue: list[_InFlight] = []
        self._seq = itertools.count()

    def run(self, *, max_events: int = 10_000_000) -> dict[int, Done | Failed]:
        """Run until every round has finished or nothing can happen; member -> outcome."""
        for i, rnd in enumerate(self.rounds):
            if rnd.state is RoundState.IDLE:
                self._handle(i, rnd.start(self.now))
        for _ in range(max_events):
            deadlines = [r.deadline for r in self.rounds
                         if r.state is RoundState.RUNNING and r.deadline is not None]
            next_deadline = min(deadlines, default=float("inf"))
            if not self._queue and not deadlines:
                return self.outcomes
            if next_deadline <= (self._queue[0].at if self._queue else float("inf")):
                self.now = next_deadline
                for i, rnd in enumerate(self.rounds):
                    self._handle(i, rnd.tick(self.now))
            else:
                self._deliver(heapq.heappop(self._queue))
        raise RuntimeError(f"MemNet.run: still busy after {max_events} events")

    def _handle(self, src: int, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._enqueue(src, action)
            else:
                self.outcomes[src] = action

    def _enqueue(self, src: int, send: Send) -> None:
        what = self.faults.apply(src, send.to, send.msg)
        if what is None:
            self.dropped += 1
            return
        at = self.now + self.latency + self.faults.extra_delay(src, send.to)
        tiebreak = self.faults.rng.random() if self.faults.reorder else 0.0
        if what is send.msg and self.wire:
            what = send.frame
        elif isinstance(what, bytes):
            what = (what,)
        elif self.wire:
            what = encode_frame_parts(what)
        heapq.heappush(self._queue, _InFlight(at, tiebreak, next(self._seq), src, send.to, what))

    def _deliver(self, item: _InFlight) -> None:
        self.now = max(self.now, item.at)
        self.delivered += 1
        rnd = self.rounds[item.dst]
        if not isinstance(item.what, tuple):
            self._handle(item.dst, rnd.receive(item.src, item.what, self.now))
            return
        # A fresh decoder per frame stands in for a connection that is dropped on error; the
        # pieces are fed one by one, as a socket would deliver them.
        decoder, msgs = FrameDecoder(), []
        try:
            for piece in item.what:
                msgs += decoder.feed(piece)
        except RemoteProtocolError as exc:
            self._handle(item.dst, rnd.peer_error(item.src, exc.reason, self.now))
            return
        size = sum(len(p) for p in item.what)
        for msg in msgs:
            self._handle(item.dst, rnd.receive(item.src, msg, self.now, frame_bytes=size))
