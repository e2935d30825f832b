"""Sans-IO state machine for one butterfly all-reduce round of one pseudo-gradient fragment.

`AllReduceRound` holds no sockets, tasks or clocks: the driver feeds it what arrived
(`receive`, `peer_error`) and the time (`tick`), and performs the `Action`s it returns. The
same object therefore runs over TCP in the daemon and over `memnet.MemNet` in tests.

Protocol (protocol/README.md is normative). The flat tensor of `numel` values is split by
`part_bounds(numel, weights, align=block_size)` (top-k: a multiple of its 4096-value chunk,
`codecs.part_align`); member j owns part j. Each part travels in
chunks of `chunk_numel` values. On `start`, every member encodes its values of every other
member's part, chunk by chunk, and sends them as `Contribution`s. An owner reduces chunk k
as soon as all N contributions of chunk k are in (its own one too, as decode(encode(own)),
so all members' values are treated alike): it sums the decoded contributions in ascending
member index with `reduce_mean`, encodes the mean, keeps decode(encode(mean)) for itself
and sends the encoded mean to everyone as a `Result` chunk. The last chunk of a part is
held back until the whole part is reduced, because it carries the `digest` of the owner's
decoded part (BLAKE3 over the chunk hashes, `part_digest`); receivers check it, so every
member ends with bit-identical values, and `Done` carries the round digest derived from the
part digests (`round_digest`; `result_digest` recomputes it from a result tensor).
With a robust `aggregator` (`dilonode.algo.robust`), the owner checks and combines each
chunk's contributions instead of taking their mean, and names the members it left out in
the result chunk's `rejected`; every member collects those names in `rejected`.
Only incomplete chunks are buffered (decoded float32, N-1 tensors of one chunk each).

States (one table, `_TRANSITIONS`): IDLE --start--> RUNNING --complete--> DONE, and
RUNNING --fail--> FAILED. Progress inside RUNNING is counted per chunk (contributions in)
and per part (result chunks in). A round is DONE only when every part arrived complete and
verified; there is never a partial average.

Actions returned to the driver:

* `Send(to, msg, frame)`: write `frame` (= `encode_frame_parts(msg)`: the frame's bytes
  in pieces, the payload uncopied; shared between the recipients of a broadcast) to `to`.
* `Done(digest)`: the round completed; `result` and `digest` are available.
* `Failed(failure)`: the round failed; `failure` names the reason and the culprits.

Failure rules. Anything wrong in a peer's message (envelope, layout, duplicate, payload
size, codec, non-finite values, contributors, digest, or an `attempt`/`group` that is not
ours: a membership mismatch) or reported by the transport via `peer_error` fails the round
naming that member, and we send `Abort` to all other members so they stop waiting; the
Abort lists our culprits. An `Abort` received fails the round naming its sender as culprit
and recording the members the Abort blames as `reported`; `RoundFailure.exclude` is what a
retry should leave out, so all members drop the same peers. `peer_gone` (the transport lost
the connection to a member) fails the round only if we still need data from that member:
a peer that finished and closed its connections is no reason to fail. At
`deadline = start + timeout`
(`tick`, or any call with a later `now`) a RUNNING round fails without sending `Abort`:
every live member times out on its own and blames, from its own view, the members whose
contributions are missing (or, when all contributions are in, the owners whose results
are), so their culprit lists agree. Messages after DONE/FAILED are counted and ignored.

Byte accounting: `bytes_sent` / `bytes_received` count whole frames (4-byte header plus
msgpack body, i.e. `len(encode_frame(msg))`) of every message sent / handed to `receive`;
`payload_bytes_sent` / `payload_bytes_received` count only the codec payload bytes of
Contribution and Result messages.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import blake3
import msgpack
import numpy as np
import torch

from dilonode import PROTOCOL_VERSION
from dilonode.algo.butterfly import part_bounds, reduction_steps
from dilonode.algo.codecs import (
    Codec,
    CodecError,
    CodecMeta,
    all_finite,
    get_codec,
    part_align,
)
from dilonode.algo.replay import EncodedResult
from dilonode.algo.robust import AggregatorSpec, aggregate, check_claims, convicted
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.allreduce.datapath import Accepted, DataPath, chunk_hash, make_path
from dilonode.wire.errors import LocalProtocolError, RemoteProtocolError, one_line
from dilonode.wire.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameParts,
    encode_frame,
    encode_frame_parts,
)
from dilonode.wire.messages import (
    ABORT_REASON_MAX,
    MAX_MEMBERS,
    MAX_WEIGHT,
    Abort,
    Contribution,
    Message,
    Result,
)

__all__ = [
    "Action",
    "AllReduceRound",
    "Done",
    "Failed",
    "GroupSpec",
    "RoundFailure",
    "RoundState",
    "Send",
    "chunk_hash",
    "group_digest",
    "part_digest",
    "result_digest",
    "round_digest",
    "tensor_digest",
]

# Room for the msgpack map around a chunk's payload; the real overhead is ~200 bytes.
_FRAME_OVERHEAD = 4096
_GROUP_DIGEST = re.compile(r"([0-9a-f]{64})?")


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 hex of a 1-D float32 tensor's values as little-endian bytes."""
    arr = np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f4")
    return hashlib.sha256(arr.data).hexdigest()


def _all_finite(t: torch.Tensor) -> bool:
    return all_finite(t)


def part_digest(chunk_hashes: Sequence[bytes]) -> str:
    """The `digest` of a part: blake3 hex of its chunks' `chunk_hash`es in chunk order.

    Hashing chunk by chunk lets every member hash each decoded chunk while it is still in
    cache, in whatever order chunks complete; an empty part hashes the empty string.
    """
    return blake3.blake3(b"".join(chunk_hashes)).hexdigest()


def round_digest(part_digests: Sequence[str]) -> str:
    """A round's result digest: blake3 hex of the parts' digests (raw bytes), member order."""
    return blake3.blake3(b"".join(bytes.fromhex(d) for d in part_digests)).hexdigest()


def result_digest(result: torch.Tensor, spec: GroupSpec) -> str:
    """The digest `Done` carries for `result` (1-D float32, `spec.numel` values)."""
    digests = []
    for j, (start, _) in enumerate(spec.parts):
        spans = (spec.chunk_span(j, k) for k in range(spec.n_chunks(j)))
        digests.append(part_digest([chunk_hash(result[start + off:start + off + numel])
                                    for off, numel in spans]))
    return round_digest(digests)


def group_digest(members: Sequence[str]) -> str:
    """sha256 hex of the agreed member list (peer ids in member order), for `GroupSpec`.

    The ids are hashed as the msgpack array of their UTF-8 strings, so no separator can be
    forged by a peer id that contains it.
    """
    return hashlib.sha256(msgpack.packb(list(members), use_bin_type=True)).hexdigest()


@dataclass(frozen=True)
class GroupSpec:
    """What every member of a group agreed on before the round starts.

    `members` are peer ids in the agreed order (index = member index), `weights` their
    bandwidth weights for `part_bounds`; `block_size` is both the codec block size and the
    part alignment (`align`: with top-k a multiple of its chunk too); `chunk_numel` (a
    multiple of `align`) is the values per message.
    `attempt` numbers the retries of one (fragment, round) and `group_digest` (see
    `group_digest()`, or "" when not used) identifies the agreed member list; a message
    carrying another attempt or group digest fails the round (membership mismatch).
    """

    run_id: str
    fragment: int
    round: int
    members: tuple[str, ...]
    weights: tuple[float, ...]
    numel: int
    codec: str
    block_size: int
    chunk_numel: int
    attempt: int = 0
    group_digest: str = ""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("GroupSpec: " + "; ".join(problems))
        _ = self.parts  # part_bounds raises ValueError on unusable weights
        # get_codec raises CodecError (a ValueError) for an unknown codec or bad block size.
        bound = self.codec_obj.encoded_size(self.chunk_numel) + _FRAME_OVERHEAD
        if bound > DEFAULT_MAX_FRAME_BYTES:
            raise ValueError(f"GroupSpec: chunk_numel={self.chunk_numel} makes {self.codec} "
                             f"frames of ~{bound} bytes > {DEFAULT_MAX_FRAME_BYTES}")

    def _problems(self) -> list[str]:
        out = []
        if not 1 <= len(self.run_id) <= 128:
            out.append(f"run_id={self.run_id!r}: need 1..128 characters")
        if (not 0 <= self.fragment < 2**32 or not 0 <= self.round < 2**63
                or not 0 <= self.attempt < 2**32):
            out.append(f"fragment={self.fragment}, round={self.round}, "
                       f"attempt={self.attempt}: out of range")
        if not _GROUP_DIGEST.fullmatch(self.group_digest):
            out.append(f"group_digest={self.group_digest!r}: need '' or 64 lowercase hex")
        if not 1 <= len(self.members) <= MAX_MEMBERS or len(set(self.members)) != len(
                self.members):
            out.append(f"members={self.members!r}: need 1..{MAX_MEMBERS} distinct peer ids")
        if len(self.weights) != len(self.members):
            out.append(f"weights: {len(self.weights)} given for {len(self.members)} members")
        if self.numel < 0 or self.block_size < 1:
            out.append(f"numel={self.numel}, block_size={self.block_size}: need >= 0, >= 1")
        elif self.chunk_numel < 1 or self.chunk_numel % self.align:
            of = (f"block_size={self.block_size}" if self.align == self.block_size
                  else f"{self.align} (block_size={self.block_size} and the {self.codec} chunk)")
            out.append(f"chunk_numel={self.chunk_numel}: must be a positive multiple of {of}")
        return out

    @property
    def size(self) -> int:
        """N, the number of members."""
        return len(self.members)

    @cached_property
    def codec_obj(self) -> Codec:
        return get_codec(self.codec, self.block_size)

    @cached_property
    def align(self) -> int:
        """Part and chunk boundaries are multiples of this (`codecs.part_align`)."""
        return part_align(self.codec_obj, self.block_size)

    @cached_property
    def parts(self) -> list[tuple[int, int]]:
        """[start, end) of each member's part, in member order."""
        return part_bounds(self.numel, self.weights, align=self.align)

    def n_chunks(self, owner: int) -> int:
        start, end = self.parts[owner]
        return -(-(end - start) // self.chunk_numel)

    def chunk_span(self, owner: int, chunk: int) -> tuple[int, int]:
        """(offset within the part, numel) of chunk `chunk` of `owner`'s part."""
        start, end = self.parts[owner]
        offset = chunk * self.chunk_numel
        return offset, min(self.chunk_numel, end - start - offset)

    def describe(self, member: int) -> str:
        return f"peer {self.members[member]!r} (member {member})"


def _check_out(out: torch.Tensor | None, local: torch.Tensor, numel: int) -> None:
    """ValueError unless `out` (if given) can hold the result without touching `local`."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out: need a torch.Tensor, got {type(out).__name__}")
    if (out.dtype != torch.float32 or out.shape != (numel,) or out.device != local.device
            or not out.is_contiguous()):
        raise ValueError(f"out: need a contiguous float32 tensor of shape ({numel},) on "
                         f"{local.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    lo, hi = out.data_ptr(), out.data_ptr() + 4 * numel
    l_lo = local.data_ptr()
    if numel and lo < l_lo + 4 * local.numel() and l_lo < hi:
        raise ValueError("out: overlaps local, whose values the round still reads")


class RoundState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class _Event(enum.Enum):
    START = "start"
    COMPLETE = "complete"
    FAIL = "fail"


_TRANSITIONS: dict[tuple[RoundState, _Event], RoundState] = {
    (RoundState.IDLE, _Event.START): RoundState.RUNNING,
    (RoundState.RUNNING, _Event.COMPLETE): RoundState.DONE,
    (RoundState.RUNNING, _Event.FAIL): RoundState.FAILED,
}


@dataclass(frozen=True)
class RoundFailure:
    """Why a round failed (one line) and whom to blame.

    `culprits` are the members blamed from this member's own view (for an Abort received:
    its sender); `reported` are the members that Abort blamed. `exclude` is the set a retry
    should leave out.
    """

    reason: str
    culprits: tuple[int, ...]
    reported: tuple[int, ...] = ()

    @property
    def exclude(self) -> tuple[int, ...]:
        """Members to leave out of the retry.

        The culprits an Abort reported when there are any, else our own: the member that
        detected a fault names it in its Abort, and following that report lets every member
        exclude the same peers instead of each excluding whoever told it the news.
        """
        return self.reported or self.culprits


@dataclass(frozen=True)
class Send:
    """Write `frame` (the encoding of `msg`, in pieces to write in order) to member `to`."""

    to: int
    msg: Message
    frame: FrameParts = field(repr=False)


@dataclass(frozen=True)
class Done:
    """The round completed; `digest` is the round digest of the result (`result_digest`)."""

    digest: str


@dataclass(frozen=True)
class Failed:
    """The round failed; no result exists."""

    failure: RoundFailure


Action = Send | Done | Failed


class AllReduceRound:
    """One member's side of one all-reduce round (see the module docstring).

    `local` (1-D float32, `spec.numel` values) is read lazily while the round runs, and a
    float32 round's contributions are views of it that stay queued until written, so the
    caller must not modify it in place afterwards either. `out`, if given, receives
    the result (it is `result` once DONE; after FAILED it holds garbage): a caller that runs
    rounds of one size again and again saves the page faults of a fresh buffer per round
    (decoding into a fresh buffer took about twice the CPU of a reused one in an ad-hoc
    test on the shared 2-core box).

    `local` may live on any device: a CPU tensor takes the host path, any other the torch
    path (`datapath.py`: codecs and reduction on that device; `data_path` forces one), and
    the result lives on `local`'s device. Both paths give the same bits.
    """

    def __init__(self, spec: GroupSpec, my_index: int, local: torch.Tensor, *,
                 timeout: float = 30.0, aggregator: AggregatorSpec | None = None,
                 out: torch.Tensor | None = None, keep_encoded: bool = False,
                 weight: float = 1.0, data_path: str | None = None,
                 encoded: SplicedEncoding | None = None) -> None:
        if not 0 <= my_index < spec.size:
            raise ValueError(f"my_index={my_index}: not in 0..{spec.size - 1}")
        if local.dtype != torch.float32 or local.shape != (spec.numel,):
            raise ValueError(f"local: need float32 of shape ({spec.numel},), got "
                             f"{local.dtype} {tuple(local.shape)}")
        if not _all_finite(local):
            raise ValueError("local: holds NaN/Inf; refusing to contribute it")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout}: must be > 0")
        if not (0.0 <= weight <= MAX_WEIGHT):
            raise ValueError(f"weight={weight}: need 0 <= weight <= {MAX_WEIGHT:g} (tokens)")
        _check_out(out, local, spec.numel)
        self._out_buffer = out
        self.spec = spec
        self.my_index = my_index
        self.timeout = timeout
        self.aggregator = aggregator or AggregatorSpec()
        self.weight = float(weight)
        # Each member's token weight, as its first contribution to us carried it (ours too).
        self._weights: dict[int, float] = {my_index: self.weight}
        self._local = local.detach().contiguous()
        self._codec = spec.codec_obj
        # `encoded`: `local` already encoded slice by slice (a node's ranks, in parallel).
        self._path: DataPath = make_path(self._codec, self._local, data_path, encoded)
        self._state = RoundState.IDLE
        self._deadline: float | None = None
        self._out: torch.Tensor | None = None
        self._digest: str | None = None
        self._failure: RoundFailure | None = None
        n = spec.size
        # My part: accepted contributions of incomplete chunks only (checked payloads on the
        # host path, decoded values on the torch path), keyed chunk -> sender.
        self._pending: dict[int, dict[int, Accepted]] = {}
        self._chunk_done = [False] * spec.n_chunks(my_index)
        self._mine_reduced = 0
        self._held_last: tuple[bytes | memoryview, tuple[int, ...]] | None = None
        self._rejected_by: dict[int, set[int]] = {}  # owner -> members it left out
        # Other parts: result chunks received and the digest announced on the last chunk.
        self._results_got: list[set[int]] = [set() for _ in range(n)]
        self._announced: dict[int, str] = {}
        self._parts_verified = 0
        # Per part, the `chunk_hash` of each decoded result chunk (ours too), for digests.
        self._chunk_hashes = [[b""] * spec.n_chunks(j) for j in range(n)]
        # (owner, chunk) -> the encoded result chunk, when asked to keep them (`encoded`).
        self._encoded: dict[tuple[int, int], bytes] | None = {} if keep_encoded else None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.payload_bytes_sent = 0
        self.payload_bytes_received = 0
        self.messages_ignored = 0

    # ------------------------------------------------------------------ public surface

    @property
    def state(self) -> RoundState:
        return self._state

    @property
    def deadline(self) -> float | None:
        """start + timeout, once started."""
        return self._deadline

    @property
    def result(self) -> torch.Tensor:
        """The averaged 1-D float32 tensor; only in DONE."""
        if self._state is not RoundState.DONE or self._out is None:
            raise LocalProtocolError(f"result: round is {self._state.value}, not done")
        return self._out

    @property
    def digest(self) -> str:
        """`result_digest(result, spec)`, derived from the part digests; only in DONE."""
        if self._digest is None:
            raise LocalProtocolError(f"digest: round is {self._state.value}, not done")
        return self._digest

    @property
    def encoded(self) -> EncodedResult | None:
        """The result as the codec carried it (joiners replay it: algo/replay.py); only in
        DONE, and None unless the round was made with `keep_encoded=True`."""
        if self._state is not RoundState.DONE:
            raise LocalProtocolError(f"encoded: round is {self._state.value}, not done")
        if self._encoded is None:
            return None
        s = self.spec
        pieces = tuple((s.chunk_span(j, k)[1], self._encoded[j, k])
                       for j in range(s.size) for k in range(s.n_chunks(j)))
        return EncodedResult.of_pieces(s.codec, s.block_size, pieces)

    @property
    def rejected(self) -> tuple[int, ...]:
        """Members whose contribution an owner (us included) left out of some chunk so far;
        complete once DONE, and then the same on every member."""
        return tuple(sorted(set().union(*self._rejected_by.values())))

    @property
    def convicted(self) -> tuple[int, ...]:
        """Members a majority of the other owners rejected (`robust.convicted`): what a ban
        may count, since a single owner's list cannot be checked."""
        owners = [j for j in range(self.spec.size) if self.spec.n_chunks(j)]
        return tuple(sorted(convicted(self._rejected_by, owners)))

    @property
    def failure(self) -> RoundFailure:
        """Reason and culprits; only in FAILED."""
        if self._failure is None:
            raise LocalProtocolError(f"failure: round is {self._state.value}, not failed")
        return self._failure

    def start(self, now: float) -> list[Action]:
        """Begin the round at time `now`: the contributions to send, or Done for N=1."""
        self._transition(_Event.START)
        self._deadline = now + self.timeout
        self._out = (self._path.empty(self.spec.numel)
                     if self._out_buffer is None else self._out_buffer)
        if self.spec.size == 1:
            for k in range(self.spec.n_chunks(0)):
                offset, numel = self.spec.chunk_span(0, k)
                payload = self._path.encode(self._local[offset:offset + numel])
                self._keep(0, k, payload, self._path.meta(numel))
            return self._complete()
        actions = self._send_contributions()
        return actions + self._maybe_complete()

    def receive(self, sender: int, msg: Message, now: float, *,
                frame_bytes: int | None = None) -> list[Action]:
        """Handle `msg` that the transport got from member `sender`.

        `frame_bytes` is the frame's size on the wire for accounting; when omitted it is
        recomputed from `msg`.
        """
        self._check_sender(sender)
        self.bytes_received += len(encode_frame(msg)) if frame_bytes is None else frame_bytes
        if isinstance(msg, Contribution | Result):
            self.payload_bytes_received += len(msg.payload)
        if self._state is not RoundState.RUNNING:
            self.messages_ignored += 1
            return []
        if now >= self._deadline_value():
            self.messages_ignored += 1
            return self._timeout()
        try:
            return self._handle(sender, msg)
        except RemoteProtocolError as exc:
            return self._fail(f"{self.spec.describe(sender)}: {exc.reason}", (sender,),
                              abort=True)

    def peer_error(self, sender: int, reason: str, now: float) -> list[Action]:
        """The transport found member `sender` at fault (bad frame, connection lost...)."""
        self._check_sender(sender)
        if self._state is not RoundState.RUNNING:
            return []
        if now >= self._deadline_value():
            return self._timeout()
        return self._fail(f"{self.spec.describe(sender)}: {reason}", (sender,), abort=True)

    def peer_gone(self, sender: int, reason: str, now: float) -> list[Action]:
        """The transport lost member `sender` (connection closed, send failed).

        Fails the round naming it only if we still wait for a contribution or a result
        chunk from it; a member that has given us everything may leave early.
        """
        self._check_sender(sender)
        if self._state is not RoundState.RUNNING:
            return []
        if now >= self._deadline_value():
            return self._timeout()
        if sender not in self._missing_contributors() + self._missing_owners():
            return []
        return self._fail(f"{self.spec.describe(sender)}: {reason}", (sender,), abort=True)

    def tick(self, now: float) -> list[Action]:
        """Let time pass: fails a RUNNING round once `now >= deadline`."""
        if self._state is RoundState.RUNNING and now >= self._deadline_value():
            return self._timeout()
        return []

    # ------------------------------------------------------------------ state and sending

    def _transition(self, event: _Event) -> None:
        new = _TRANSITIONS.get((self._state, event))
        if new is None:
            raise LocalProtocolError(f"cannot {event.value} a round that is {self._state.value}")
        self._state = new

    def _deadline_value(self) -> float:
        if self._deadline is None:
            raise LocalProtocolError("round not started")
        return self._deadline

    def _check_sender(self, sender: int) -> None:
        if self._state is RoundState.IDLE:
            raise LocalProtocolError("call start() before feeding the round")
        if not 0 <= sender < self.spec.size or sender == self.my_index:
            raise LocalProtocolError(f"transport declared sender {sender}: not another member")

    def _envelope(self) -> dict[str, object]:
        s = self.spec
        return {"version": PROTOCOL_VERSION, "run_id": s.run_id, "fragment": s.fragment,
                "round": s.round, "attempt": s.attempt, "group": s.group_digest,
                "sender": self.my_index}

    def _send(self, targets: list[int], msg: Message) -> list[Action]:
        frame = encode_frame_parts(msg)
        payload = len(msg.payload) if isinstance(msg, Contribution | Result) else 0
        self.bytes_sent += sum(len(p) for p in frame) * len(targets)
        self.payload_bytes_sent += payload * len(targets)
        return [Send(to, msg, frame) for to in targets]

    def _others(self) -> list[int]:
        # Rotated so that members do not all start by sending to member 0.
        n, me = self.spec.size, self.my_index
        return [(me + d) % n for d in range(1, n)]

    def _send_contributions(self) -> list[Action]:
        spec, actions = self.spec, []
        owners = self._others()
        self._path.prepare([(spec.parts[j][0] + spec.chunk_span(j, k)[0],
                             spec.chunk_span(j, k)[1])
                            for j in owners for k in range(spec.n_chunks(j))])
        # Chunk-major, so every owner gets its chunk 0 first and can start reducing.
        for k in range(max(spec.n_chunks(j) for j in owners)):
            for j in owners:
                if k >= spec.n_chunks(j):
                    continue
                offset, numel = spec.chunk_span(j, k)
                start = spec.parts[j][0] + offset
                payload = self._encode_local(start, numel)
                msg = Contribution(**self._envelope(), owner=j, chunk=k,
                                   n_chunks=spec.n_chunks(j), offset=offset, numel=numel,
                                   codec=spec.codec, block_size=spec.block_size,
                                   weight=self.weight, payload=payload)
                actions += self._send([j], msg)
        return actions

    def _encode_local(self, start: int, numel: int) -> bytes | memoryview:
        """Our encoded values [start, start + numel) of `local`, as a contribution (for
        float32 on the host, a read-only view of `local`: `HostPath.contribution`)."""
        return self._path.contribution(start, numel)

    # ------------------------------------------------------------------ incoming messages

    def _handle(self, sender: int, msg: Message) -> list[Action]:
        if not isinstance(msg, Contribution | Result | Abort):
            # Any handshake message (hello, hello_ack, auth) is out of place here.
            raise RemoteProtocolError(f"{msg.type} message inside a round")
        self._check_envelope(sender, msg)
        if isinstance(msg, Abort):
            reason = one_line(msg.reason, ABORT_REASON_MAX) or "(no reason given)"
            # Indices outside the group cannot be excluded; a hostile list stays harmless.
            reported = tuple(i for i in msg.culprits if 0 <= i < self.spec.size)
            return self._fail(f"{self.spec.describe(sender)} aborted the round: [{reason}]",
                              (sender,), abort=False, reported=reported)
        if isinstance(msg, Contribution):
            return self._on_contribution(sender, msg)
        if isinstance(msg, Result):
            return self._on_result(sender, msg)
        raise LocalProtocolError(f"receive: not a message: {type(msg).__name__}")

    def _check_envelope(self, sender: int, msg: Contribution | Result | Abort) -> None:
        s = self.spec
        if msg.version != PROTOCOL_VERSION:
            raise RemoteProtocolError(f"{msg.type}: protocol version mismatch: expected "
                                      f"{PROTOCOL_VERSION}, got {msg.version}")
        got = (msg.run_id, msg.fragment, msg.round)
        if got != (s.run_id, s.fragment, s.round):
            raise RemoteProtocolError(
                f"{msg.type} for run/fragment/round {one_line(repr(got), 200)}, expected "
                f"{(s.run_id, s.fragment, s.round)!r}")
        if (msg.attempt, msg.group) != (s.attempt, s.group_digest):
            raise RemoteProtocolError(
                f"membership mismatch: {msg.type} for attempt {msg.attempt} of group "
                f"{msg.group[:12] or '-'}, expected attempt {s.attempt} of group "
                f"{s.group_digest[:12] or '-'}")
        if msg.sender != sender:
            raise RemoteProtocolError(f"{msg.type} claims sender {msg.sender}, but arrived "
                                      f"from member {sender}")

    def _check_layout(self, msg: Contribution | Result, owner: int) -> None:
        """Raise unless msg is a well-formed chunk of `owner`'s part (payload not decoded)."""
        s, what = self.spec, f"{msg.type} chunk {msg.chunk} of part {owner}"
        expected_chunks = s.n_chunks(owner)
        # Models built without validation (model_copy) reach here too, so recheck the range.
        if msg.n_chunks != expected_chunks or not 0 <= msg.chunk < expected_chunks:
            raise RemoteProtocolError(f"{what}: n_chunks {msg.n_chunks}, expected "
                                      f"{expected_chunks}")
        offset, numel = s.chunk_span(owner, msg.chunk)
        if (msg.offset, msg.numel) != (offset, numel):
            raise RemoteProtocolError(f"{what}: offset/numel {msg.offset}/{msg.numel}, "
                                      f"expected {offset}/{numel}")
        if (msg.codec, msg.block_size) != (s.codec, s.block_size):
            raise RemoteProtocolError(
                f"{what}: codec {one_line(msg.codec, 40)}/{msg.block_size}, expected "
                f"{s.codec}/{s.block_size}")
        size = self._codec.encoded_size(numel)
        if len(msg.payload) != size:
            raise RemoteProtocolError(f"{what}: payload is {len(msg.payload)} bytes, expected "
                                      f"{size}")

    def _decode(self, msg: Result, into: torch.Tensor) -> torch.Tensor:
        """The payload's values, decoded into `into` (a slice of the output).

        Every codec's decode refuses NaN/Inf, block scales whose multiples overflow
        included (the `Codec` contract, tested per codec), so the values are finite.
        """
        try:
            self._path.decode_into(msg.payload, self._path.meta(msg.numel), into)
        except CodecError as exc:
            raise RemoteProtocolError(f"{msg.type} chunk {msg.chunk}: bad payload: "
                                      f"{exc}") from None
        return into

    def _accept(self, msg: Contribution) -> Accepted:
        """Check a contribution's payload now (a bad one fails the round naming its sender
        at once) and keep what the path reduces later: `DataPath.accept`."""
        try:
            return self._path.accept(msg.payload, self._path.meta(msg.numel))
        except CodecError as exc:
            raise RemoteProtocolError(f"{msg.type} chunk {msg.chunk}: bad payload: "
                                      f"{exc}") from None

    def _on_contribution(self, sender: int, msg: Contribution) -> list[Action]:
        if msg.owner != self.my_index:
            raise RemoteProtocolError(f"contribution for the part of member {msg.owner} sent "
                                      f"to member {self.my_index}")
        self._check_layout(msg, self.my_index)
        waiting = self._pending.setdefault(msg.chunk, {})
        if self._chunk_done[msg.chunk] or sender in waiting:
            raise RemoteProtocolError(f"duplicate contribution chunk {msg.chunk}")
        claimed = self._weights.setdefault(sender, msg.weight)
        if claimed != msg.weight:
            raise RemoteProtocolError(f"contribution chunk {msg.chunk} claims weight "
                                      f"{msg.weight:g}, earlier chunks {claimed:g}")
        waiting[sender] = self._accept(msg)
        if len(waiting) < self.spec.size - 1:
            return []
        return self._reduce_chunk(msg.chunk)

    def _on_result(self, sender: int, msg: Result) -> list[Action]:
        if msg.owner != sender:
            raise RemoteProtocolError(f"result for the part of member {msg.owner} sent by "
                                      f"member {sender}, not its owner")
        self._check_layout(msg, sender)
        everyone = tuple(range(self.spec.size))
        if msg.contributors != everyone:
            raise RemoteProtocolError(f"result chunk {msg.chunk} averages members "
                                      f"{list(msg.contributors)}, expected all {list(everyone)}")
        if msg.rejected is not None:
            # Only the owner saw the contributions; the result names whom it left out.
            self._rejected_by.setdefault(sender, set()).update(msg.rejected)
        got = self._results_got[sender]
        if msg.chunk in got:
            raise RemoteProtocolError(f"duplicate result chunk {msg.chunk}")
        start = self.spec.parts[sender][0] + msg.offset
        # Straight into the output: if anything is wrong the round fails and drops it.
        values = self._decode(msg, self._output()[start:start + msg.numel])
        self._chunk_hashes[sender][msg.chunk] = self._path.hash_chunk(values, msg.payload)
        if self._encoded is not None:
            self._encoded[sender, msg.chunk] = bytes(msg.payload)
        got.add(msg.chunk)
        if msg.digest is not None:
            self._announced[sender] = msg.digest
        if len(got) == self.spec.n_chunks(sender):
            self._verify_part(sender)
        return self._maybe_complete()

    def _verify_part(self, owner: int) -> None:
        actual = part_digest(self._chunk_hashes[owner])
        if actual != self._announced.get(owner):
            raise RemoteProtocolError(f"result digest mismatch for part {owner}: announced "
                                      f"{self._announced.get(owner)}, decoded {actual}")
        self._parts_verified += 1

    # ------------------------------------------------------------------ reduction and ending

    def _output(self) -> torch.Tensor:
        if self._out is None:
            raise LocalProtocolError("round buffers already released")
        return self._out

    def _reduce_chunk(self, k: int) -> list[Action]:
        spec, me = self.spec, self.my_index
        offset, numel = spec.chunk_span(me, k)
        start = spec.parts[me][0] + offset
        contribs = self._pending.pop(k)
        contribs[me] = self._own_contribution(start, numel)
        ordered = [contribs[i] for i in range(spec.size)]
        weights = [self._weights[i] for i in range(spec.size)]
        target = self._output()[start:start + numel]
        plain = self.aggregator.name == "mean" and not self.aggregator.norm_bound
        encoded: bytes | memoryview | None = None
        if plain and not check_claims(weights, self.aggregator.max_weight_ratio):
            # The plain (token-weighted) mean, folded contribution by contribution straight
            # into the output slice (no temporaries), where the decoded mean goes anyway:
            # `reduce_weighted`'s operations in its order (`reduction_steps`), and encoded.
            steps = reduction_steps(weights, len(ordered))
            try:
                value, encoded = self._path.combine_encode(ordered, steps, target)
            except CodecError as exc:  # as `encode` below
                return self._unencodable(k, ordered, numel, exc)
            rejected: tuple[int, ...] = ()
        else:
            # Every contribution was checked on arrival (ours at construction), except
            # float32 values on the host path, which `values` checks now.
            try:
                chunks = [self._path.values(c, numel) for c in ordered]
            except CodecError:
                if (bad := self._bad_contribution(k, ordered, numel)) is None:
                    raise
                return bad
            combined = aggregate(chunks, self.aggregator, weights=weights,
                                 assume_finite=True)
            value, rejected = combined.value, combined.rejected
        self._rejected_by.setdefault(me, set()).update(rejected)
        try:
            payload = self._path.encode(value) if encoded is None else encoded
        except CodecError as exc:
            return self._unencodable(k, ordered, numel, exc)
        meta = self._path.meta(numel)
        # float32 decodes to exactly what it encoded: a mean already in place stays.
        in_place = value is target and self._path.lossless
        self._keep(me, k, payload, meta, in_place=in_place)
        self._chunk_done[k] = True
        self._mine_reduced += 1
        actions: list[Action] = []
        last = len(self._chunk_done) - 1
        if k == last:
            # Sent once the digest of the whole part is known.
            self._held_last = (payload, rejected)
        else:
            actions += self._send(self._others(), self._result_msg(k, payload, None, rejected))
        if self._mine_reduced == len(self._chunk_done) and self._held_last is not None:
            msg = self._result_msg(last, self._held_last[0], part_digest(self._chunk_hashes[me]),
                                   self._held_last[1])
            self._held_last = None
            actions += self._send(self._others(), msg)
        return actions + self._maybe_complete()

    def _unencodable(self, k: int, ordered: list[Accepted], numel: int,
                     exc: CodecError) -> list[Action]:
        """The mean of my chunk k does not encode: a NaN/Inf summed unchecked (fail naming
        its sender), or finite sums overflowing."""
        if (bad := self._bad_contribution(k, ordered, numel)) is not None:
            return bad
        return self._fail(f"cannot encode the mean of my chunk {k}: {exc}", (), abort=True)

    def _bad_contribution(self, k: int, ordered: list[Accepted],
                          numel: int) -> list[Action] | None:
        """Fail naming the member whose contribution to chunk k holds values `accept` left
        unchecked that are bad (`DataPath.culprit`), as `accept` would have; None if none
        does."""
        found = self._path.culprit(ordered, numel)
        if found is None:
            return None
        i, why = found
        return self._fail(f"{self.spec.describe(i)}: contribution chunk {k}: bad payload: "
                          f"{why}", (i,), abort=True)

    def _own_contribution(self, start: int, numel: int) -> Accepted:
        """local[start:start + numel] treated as every contribution is: encoded (decoded
        on the torch path); `DataPath.own`."""
        return self._path.own(start, numel)

    def _keep(self, owner: int, k: int, payload: bytes | memoryview, meta: CodecMeta, *,
              in_place: bool = False) -> None:
        """Decode the result chunk k of `owner`'s part that we produced into the output
        (unless `in_place`: the output already holds exactly the decoded values)."""
        start = self.spec.parts[owner][0] + self.spec.chunk_span(owner, k)[0]
        values = self._output()[start:start + meta.numel]
        if not in_place:
            self._path.decode_into(payload, meta, values)
        self._chunk_hashes[owner][k] = self._path.hash_chunk(values, payload)
        if self._encoded is not None:
            self._encoded[owner, k] = bytes(payload)

    def _result_msg(self, k: int, payload: bytes | memoryview, digest: str | None,
                    rejected: tuple[int, ...] = ()) -> Result:
        spec, me = self.spec, self.my_index
        offset, numel = spec.chunk_span(me, k)
        return Result(**self._envelope(), owner=me, chunk=k, n_chunks=spec.n_chunks(me),
                      offset=offset, numel=numel, codec=spec.codec, block_size=spec.block_size,
                      contributors=tuple(range(spec.size)), rejected=rejected or None,
                      payload=payload, digest=digest)

    def _maybe_complete(self) -> list[Action]:
        mine_done = self._mine_reduced == len(self._chunk_done) and self._held_last is None
        others = sum(1 for j in range(self.spec.size)
                     if j != self.my_index and self.spec.n_chunks(j) == 0)
        if mine_done and self._parts_verified + others == self.spec.size - 1:
            return self._complete()
        return []

    def _complete(self) -> list[Action]:
        self._transition(_Event.COMPLETE)
        self._digest = round_digest([part_digest(h) for h in self._chunk_hashes])
        self._pending.clear()
        return [Done(self._digest)]

    def _fail(self, reason: str, culprits: tuple[int, ...], *, abort: bool,
              reported: tuple[int, ...] = ()) -> list[Action]:
        self._transition(_Event.FAIL)
        self._failure = RoundFailure(one_line(reason), tuple(sorted(set(culprits))),
                                     tuple(sorted(set(reported))))
        self._pending.clear()
        self._out = None  # never expose a partial average
        actions: list[Action] = []
        if abort:
            note = one_line(f"member {self.my_index} gives up: {self._failure.reason}",
                            ABORT_REASON_MAX)
            actions += self._send(self._others(), Abort(**self._envelope(), reason=note,
                                                        culprits=self._failure.culprits))
        return actions + [Failed(self._failure)]

    def _timeout(self) -> list[Action]:
        culprits = self._missing_contributors() or self._missing_owners()
        names = ", ".join(self.spec.describe(i) for i in culprits)
        return self._fail(f"timed out after {self.timeout:g}s waiting for {names}",
                          culprits, abort=False)

    def _missing_contributors(self) -> tuple[int, ...]:
        missing: set[int] = set()
        for k, done in enumerate(self._chunk_done):
            if not done:
                got = self._pending.get(k, {})
                missing.update(i for i in self._others() if i not in got)
        return tuple(sorted(missing))

    def _missing_owners(self) -> tuple[int, ...]:
        return tuple(j for j in range(self.spec.size) if j != self.my_index
                     and len(self._results_got[j]) < self.spec.n_chunks(j))
