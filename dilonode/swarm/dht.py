"""`SwarmDHT`: the node's handle on the swarm's hivemind DHT (peer discovery, matchmaking board).

hivemind is used only for the DHT, the libp2p peer identity and connectivity; tensors never
travel through it. Usage::

    with SwarmDHT(run_id, initial_peers, identity_path=Path("ckpt/identity.key")) as dht:
        print(dht.peer_id, dht.visible_maddrs())    # give the maddrs to other nodes
        dht.publish(PeerRecord(peer_id=dht.peer_id, run_id=run_id, ...), ttl=30.0)
        peers = dht.fetch_peers(timeout=5.0)        # valid records of this run only

The constructor does no I/O; `start()` forks hivemind's DHT process (which runs a `p2pd`
child) and `close()` shuts both down within `shutdown_timeout` plus a second or two; calls
still waiting for the process then raise RuntimeError (it would never answer them, and a
thread waiting out a long timeout would hold up the interpreter's exit).
Every DHT call takes a timeout and raises `TimeoutError` when it runs out. Records that
fail `decode_record` are logged at WARNING (once per distinct record and reason, then at
DEBUG, so a heartbeat loop does not flood the log) and counted in `rejected_records`; those
failing authentication (bad or missing signature, an author outside the allowlist, a wrong
swarm secret) also in `unauthorized_records`.

Every subkey this node writes is owner-protected (hivemind's `RSASignatureValidator`
scheme): stored as `<peer id>[owner:<that peer's RSA key, OpenSSH form>]`, with the DHT
value signed by that key. Every SwarmDHT (the bootstrap's too) runs `_owner_validator`, so
its DHT process refuses to store, and drops from search answers, any record whose subkey is
not protected by the key of the peer id it names, or whose signature does not verify: no
one else can displace a node's entry with a later expiration. `store_raw`, `get_raw` and
`publish` speak plain subkeys (the peer id), so callers never see the marker.

The node's libp2p identity is ours, not p2pd's: `start()` loads the key at `identity_path`
(writing a new one there, in hivemind's format, when missing) or makes a fresh one, hands
the file to p2pd and keeps the key in `credentials` to sign records and data-plane
handshakes. The peer id the DHT reports is checked against the key's.

Supervision (`dilonode/node/supervisor.py`): `health(timeout)` raises `DHTUnavailable` naming what
is wrong (the DHT process exited or is stopped, its p2pd is gone, or a no-op call through
p2pd got no answer in time); `restart()` replaces the process and its p2pd in place (same
identity, same port, the initial peers plus the peers remembered) and fails the calls in
flight at once. While the process is gone every call raises `DHTUnavailable` at once,
instead of writing into a pipe nobody reads. `remember_peers()` keeps the DHT addresses of
the peers p2pd is connected to, and `reconnect(peers)` dials and pings them again (the
re-merge after a partition, `swarm/remerge.py`).

`import hivemind` costs seconds, so it happens in `start()`, never at module import. What it
takes to run hivemind's DHT process safely inside a node is `swarm/hivemind_process.py`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import msgpack

from dilonode.net.auth import AuthError, Credentials, Identity, peer_id_of_ssh_key
from dilonode.swarm import swarm_time
from dilonode.swarm.hivemind_process import (
    bound_maddr,
    ensure_fork_start_method,
    exit_text,
    host_maddr,
    import_hivemind,
    kill_p2pd,
    node_clock_samples,
    node_daemon_maddr,
    node_p2pd_pid,
    node_peer_addrs,
    node_peer_id,
    node_ping_p2pd,
    node_reconnect,
    node_visible_maddrs,
    orphan_safe,
    proc_state,
    unusable,
)
from dilonode.swarm.records import (
    RUN_ID_PATTERN,
    PeerRecord,
    Record,
    SignedRecord,
    VersionMismatch,
    decode_record,
    encode_record,
    peers_key,
)

__all__ = ["DHTUnavailable", "RawEntry", "SwarmDHT", "decode_entries", "owner_subkey",
           "plain_subkey", "read_records", "split_maddr", "store_record"]


log = logging.getLogger(__name__)

# Distinct (key, subkey, reason) triples remembered to log each at WARNING only once.
_MAX_REMEMBERED_REJECTIONS = 1024


# hivemind's marker, `RSASignatureValidator.PUBLIC_KEY_FORMAT`, at the end of the subkey.
_OWNER_SUBKEY = re.compile(r"(?P<plain>[^\[\]]*)\[owner:(?P<key>[^\[\]]+)\]", re.ASCII)


R = TypeVar("R", bound=Record)


class DHTUnavailable(RuntimeError):
    """The DHT process (or its p2pd) is gone, stopped, restarting or not answering.
    `certain` is False when it only did not answer in time (see `supervise.PartDown`)."""

    def __init__(self, reason: str, *, certain: bool = True) -> None:
        super().__init__(reason)
        self.certain = certain


_REFUSED_CLOCK = re.compile(r"local time must be within .*local: ([0-9.]+), peer: ([0-9.]+)")


def _clock_refusal(exc: BaseException) -> float | None:
    """The offset (peer minus local) hivemind named when it refused to join a peer whose
    clock is too far from ours, else None."""
    found = _REFUSED_CLOCK.search(str(exc))
    return float(found.group(2)) - float(found.group(1)) if found else None


class _Restarted(DHTUnavailable):
    """The process a request went to was replaced before it answered: send it again."""


def split_maddr(maddr: str) -> tuple[str, str]:
    """(peer id, address without `/p2p/<peer id>`) of a multiaddr that names its peer;
    ValueError if it does not."""
    addr, sep, peer = maddr.rpartition("/p2p/")
    if not sep or not peer or "/" in peer:
        raise ValueError(f"multiaddr {maddr!r} does not end with /p2p/<peer id>")
    return peer, addr


def decode_entries(board: Any, key: str, raw: dict[str, RawEntry], kind: type[R],
                   creds: Credentials) -> dict[str, R]:
    """Decode the subkey entries of one DHT key; an entry that does not decode or verify, or
    that names a peer other than its subkey, is dropped and reported through
    `board.note_rejected`."""
    out: dict[str, R] = {}
    for subkey, entry in raw.items():
        try:
            record = decode_record(kind, entry.value, creds)
        except ValueError as exc:
            # A peer of another protocol version fails every key's records alike: one
            # line per peer and version says it, not one per key.
            once = (f"version {exc.version!r}" if isinstance(exc, VersionMismatch) else None)
            board.note_rejected(key, subkey, str(exc), unauthorized=isinstance(exc, AuthError),
                                once_per=once)
            continue
        if record.peer_id != subkey:
            board.note_rejected(key, subkey, f"entry names peer {record.peer_id}")
        else:
            out[subkey] = record
    return out


def read_records(board: Any, key: str, kind: type[R],
                 timeout: float | None = None) -> dict[str, R]:
    """The valid signed records of `kind` under `key` on `board` (a `SwarmDHT` or anything
    with its raw calls), by peer id: one read, then `decode_entries`."""
    raw = board.get_raw(key, timeout=timeout)
    return decode_entries(board, key, raw, kind, board.credentials)


def store_record(board: Any, key: str, record: SignedRecord, ttl: float,
                 timeout: float | None = None) -> bool:
    """Store our signed `record` under `key`, our subkey, for `ttl` s; False if refused."""
    return bool(board.store_raw(key, board.peer_id, encode_record(record, board.credentials),
                                ttl, timeout=timeout))


def owner_subkey(identity: Identity) -> str:
    """The owner-protected form of `identity`'s own subkey: `<peer id>[owner:<ssh key>]`."""
    return f"{identity.peer_id}[owner:{identity.ssh_public_key.decode()}]"


def plain_subkey(subkey: str) -> str:
    """The peer id an owner-protected subkey stands for; AuthError unless `subkey` is exactly
    `<peer id>[owner:<that peer's key, canonical OpenSSH form>]` (one spelling per peer, so
    two stored subkeys never stand for the same plain one)."""
    match = _OWNER_SUBKEY.fullmatch(subkey)
    if match is None:
        raise AuthError("subkey is not owner-protected (no [owner:<key>] marker)")
    plain = match["plain"]
    owner = peer_id_of_ssh_key(match["key"].encode())
    if owner != plain:
        raise AuthError(f"subkey names peer {plain[:64]!r} but its owner key is {owner}'s")
    return plain


def _owner_validator(identity: Identity) -> Any:
    """hivemind's `RSASignatureValidator` signing with `identity`'s key, refusing any record
    that is not owner-protected by the peer its subkey names (see the module docstring)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    class NodeKey(RSAPrivateKey):  # type: ignore[misc]
        def __init__(self, key: Any) -> None:  # the node's key, not a freshly generated one
            self._private_key = key

    class OwnerValidator(RSASignatureValidator):  # type: ignore[misc]
        def validate(self, record: Any) -> bool:
            try:
                subkey = msgpack.unpackb(record.subkey, raw=False) if record.subkey else None
                if not isinstance(subkey, str):
                    return False  # a plain value, or a dictionary subkey of another type
                plain_subkey(subkey)
                return bool(super().validate(record))
            # Whatever a peer sends that does not parse is invalid, never an error here.
            except Exception:
                return False

    return OwnerValidator(NodeKey(identity.rsa_key))


class RawEntry(NamedTuple):
    """One subkey's value as read from the DHT, before any validation."""

    value: bytes
    expiration: float


class SwarmDHT:
    """A hivemind DHT node joined to a run's swarm; thread-safe, blocking, bounded calls."""

    def __init__(
        self,
        run_id: str,
        initial_peers: Sequence[str] = (),
        identity_path: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        start_timeout: float = 30.0,
        op_timeout: float = 10.0,
        shutdown_timeout: float = 3.0,
        secret: bytes = b"",
        allowed: frozenset[str] | None = None,
        p2p_options: dict[str, Any] | None = None,
        p2pd_flags: dict[str, Any] | None = None,
        max_clock_offset: float = 3600.0,
    ) -> None:
        if not re.fullmatch(RUN_ID_PATTERN, run_id):
            raise ValueError(f"run_id {run_id!r} does not match {RUN_ID_PATTERN}")
        self.run_id = run_id
        self.initial_peers = list(initial_peers)
        self.identity_path = identity_path
        self.host_maddr = host_maddr(host, port)
        self.start_timeout = start_timeout
        self.op_timeout = op_timeout
        self.shutdown_timeout = shutdown_timeout
        self.rejected_records = 0
        self.unauthorized_records = 0
        self._secret = secret
        self._allowed = allowed
        # Reachability (swarm/reach.py): hivemind DHT/P2P keywords, extra p2pd flags.
        self.p2p_options = dict(p2p_options or {})
        self.p2pd_flags = dict(p2pd_flags or {})
        self.max_clock_offset = max_clock_offset  # refused beyond (swarm_time.py)
        self._credentials: Credentials | None = None
        self._owner_subkey = ""
        self._dht: Any = None
        self._peer_id: str | None = None
        self._p2pd_pid: int | None = None
        self._bound_maddr = self.host_maddr  # with the port p2pd got, once started
        self._closed = False
        # Peers p2pd was connected to: peer id -> (addresses, when last seen connected).
        self._known: dict[str, tuple[list[str], float]] = {}
        # A multiprocessing Connection is not safe for concurrent sends from several threads.
        self._send_lock = threading.Lock()
        # Notified when a new DHT process takes over (or the DHT closes): calls wait on it.
        self._replaced = threading.Condition(self._send_lock)
        # Calls waiting for the DHT process; close() fails them, since a process that is
        # gone never answers and their callers would wait out their whole timeout.
        self._in_flight: set[Any] = set()
        self._count_lock = threading.Lock()
        self._seen_rejections: set[tuple[str, str, str]] = set()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> SwarmDHT:
        """Start the DHT process and join `initial_peers`; raises if it is not ready in time."""
        if self._dht is not None:
            raise RuntimeError("SwarmDHT already started")
        self._closed = False  # a close() before start() closed nothing
        import_hivemind()
        swarm_time.install(self.max_clock_offset)
        ensure_fork_start_method()
        identity, key_path, fresh = self._identity()
        t0 = time.monotonic()
        try:
            self._spawn(identity, key_path, self.initial_peers, self.host_maddr,
                        check_free=not fresh, strict=True, timeout=self.start_timeout)
        except Exception as exc:
            if (far := _clock_refusal(exc)) is not None:
                raise swarm_time.ClockOffsetError(self._too_far(far, 1)) from None
            raise
        finally:
            if self.identity_path is None:  # p2pd has read the throwaway key file by now
                shutil.rmtree(key_path.parent, ignore_errors=True)
        if self.initial_peers:
            try:
                self._measure_clock()
            except BaseException:
                self.close()
                raise
        self._credentials = Credentials(identity, self.run_id, self._secret, self._allowed)
        self._owner_subkey = owner_subkey(identity)
        if self._allowed is not None and identity.peer_id not in self._allowed:
            log.warning("this node (%s) is not in auth.allowed_peers: peers will refuse it",
                        identity.peer_id)
        log.info("DHT up in %.2fs as %s (%d initial peers)", time.monotonic() - t0,
                 self._peer_id, len(self.initial_peers))
        return self

    def _measure_clock(self) -> None:
        """Set swarm time from pings of the initial peers we joined through (their clocks
        are the swarm's: swarm_time.py); a clock further off than `max_clock_offset` stops
        the node with one line."""
        references = sorted({split_maddr(m)[0] for m in self.initial_peers if "/p2p/" in m})
        samples = self._call("run_coroutine", functools.partial(
            node_clock_samples, peers=references, rounds=5, timeout=self.op_timeout / 2),
            timeout=3 * self.op_timeout)
        measured = swarm_time.estimate_offset(samples)
        if measured is None:
            log.warning("clock: no DHT peer answered a ping; reading this host's own clock")
            return
        if abs(measured) > self.max_clock_offset:
            raise swarm_time.ClockOffsetError(
                self._too_far(measured, len({p for p, _, _ in samples})))
        swarm_time.set_offset(measured)
        if abs(measured) >= 0.5:
            log.warning("clock: this host's clock is %+.2f s off its initial peers' (median "
                        "of %d); the node reads the swarm's time instead", -measured,
                        len({p for p, _, _ in samples}))

    def _too_far(self, measured: float, peers: int) -> str:
        return (f"this host's clock is {-measured:+.1f} s off its initial peers' (median of "
                f"{peers}), beyond network.max_clock_offset = {self.max_clock_offset:g} s: "
                "set the clock (NTP) or raise the limit")

    def now(self) -> float:
        """Swarm time (swarm_time.py): what the DHT, the peer records and the swarm clock
        read."""
        return swarm_time.now()

    def _spawn(self, identity: Identity, key_path: Path, initial_peers: Sequence[str],
               host_maddr: str, *, check_free: bool, strict: bool, timeout: float) -> None:
        """Fork a DHT process (and its p2pd) as `identity`; on success it is `self._dht`."""
        hivemind = import_hivemind()
        dht = orphan_safe(hivemind.DHT)(
            initial_peers=list(initial_peers) or None,
            start=False,
            host_maddrs=[host_maddr],
            identity_path=str(key_path),
            # A key made just now is nobody else's: skip hivemind's slow check of the swarm.
            # A restart is the same node: its old self may still be in peers' tables.
            check_if_identity_free=check_free,
            # A restart comes up even if no initial peer answers (a partition): the
            # re-merge keeps calling them, rather than the node giving up.
            ensure_bootstrap_success=strict,
            record_validators=[_owner_validator(identity)],
            shutdown_timeout=self.shutdown_timeout,
            startup_timeout=timeout,
            **self.p2p_options,  # reachability (swarm/reach.py)
        )
        dht._dilonode_p2pd_flags = self.p2pd_flags
        try:
            dht.run_in_background(await_ready=True, timeout=timeout)
            if self._closed:
                raise RuntimeError("SwarmDHT closed while the DHT process was starting")
            # Only the child reads this end: closed here, a write to a dead child fails
            # with EPIPE instead of filling the pipe and blocking.
            dht._inner_pipe.close()
            peer_id = self._call("run_coroutine", node_peer_id, timeout=self.op_timeout,
                                 dht=dht)
            if peer_id != identity.peer_id:
                raise RuntimeError(f"DHT runs as {peer_id}, but the key at {key_path} is "
                                   f"{identity.peer_id}")
            self._peer_id = peer_id
            self._p2pd_pid = self._call("run_coroutine", node_p2pd_pid,
                                        timeout=self.op_timeout, dht=dht)
            maddrs = self._call("run_coroutine", node_visible_maddrs,
                                timeout=self.op_timeout, dht=dht)
        except BaseException:
            self._stop_process(dht)
            raise
        self._bound_maddr = bound_maddr(host_maddr, maddrs)
        with self._send_lock:
            closed = self._closed
            if not closed:
                self._dht = dht
                self._replaced.notify_all()
        if closed:
            self._stop_process(dht)
            raise RuntimeError("SwarmDHT closed while the DHT process was starting")

    def _identity(self) -> tuple[Identity, Path, bool]:
        """(key, file for p2pd, whether the key is new): ours at `identity_path`, created
        there if missing, or a throwaway one in a private temporary directory."""
        if self.identity_path is not None:
            fresh = not self.identity_path.exists()
            return Identity.load_or_create(self.identity_path), self.identity_path, fresh
        identity = Identity.generate()
        path = Path(tempfile.mkdtemp(prefix="dilonode-id-")) / "identity.key"
        path.write_bytes(identity.to_bytes())
        return identity, path, True

    def close(self) -> None:
        """Shut the DHT process down; idempotent, returns within a few seconds. Calls still
        waiting for an answer then raise RuntimeError."""
        with self._send_lock:
            self._closed = True  # a restart under way must not leave a process behind
            dht, self._dht = self._dht, None
            self._replaced.notify_all()
        if dht is not None:
            self._stop_process(dht)
        self._fail_in_flight(RuntimeError("SwarmDHT closed during the call"))

    def _fail_in_flight(self, exc: BaseException) -> None:
        with self._send_lock:
            pending, self._in_flight = self._in_flight, set()
        for future in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # answered since
                future.set_exception(exc)

    def _stop_process(self, dht: Any) -> None:
        try:
            self._stop_dht(dht)
        finally:
            kill_p2pd(self._p2pd_pid)

    def _stop_dht(self, dht: Any) -> None:
        if not dht.is_alive():
            return
        # shutdown() asks the node to stop p2pd cleanly, waits shutdown_timeout, then SIGTERMs.
        with self._send_lock:
            try:
                dht.shutdown()
            except (OSError, ValueError) as exc:  # pipe already broken: fall through to kill
                log.debug("DHT shutdown request failed: %s", exc)
        dht.join(1.0)
        if dht.is_alive():
            log.warning("DHT process %s ignored SIGTERM; killing it", dht.pid)
            dht.kill()
            dht.join(1.0)

    # -- supervision -----------------------------------------------------------------------

    def health(self, timeout: float | None = None) -> None:
        """Return if the DHT process and its p2pd are up and answer a no-op call through
        p2pd within `timeout` (default `op_timeout`); else raise `DHTUnavailable` saying
        which of them is wrong."""
        dht = self._dht
        if dht is None:
            raise DHTUnavailable("DHT not running (not started, closed or restarting)")
        if not dht.is_alive():
            raise DHTUnavailable(f"DHT process {dht.pid} {exit_text(dht.exitcode)}")
        if proc_state(dht.pid) == "T":
            raise DHTUnavailable(f"DHT process {dht.pid} is stopped")
        pid = self._p2pd_pid
        if pid is not None and (state := proc_state(pid)) in (None, "Z", "X", "T"):
            raise DHTUnavailable(f"p2pd (pid {pid}) is {'stopped' if state == 'T' else 'gone'}")
        limit = self.op_timeout if timeout is None else timeout
        try:
            self._call("run_coroutine", node_ping_p2pd, timeout=limit, dht=dht)
        except TimeoutError:
            raise DHTUnavailable(f"DHT process {dht.pid} did not answer a call through p2pd "
                                 f"within {limit:g}s", certain=False) from None
        except DHTUnavailable:
            raise
        except Exception as exc:
            raise DHTUnavailable(f"p2pd (pid {pid}) did not answer: {exc or type(exc)}") \
                from None

    def restart(self, timeout: float | None = None) -> None:
        """Replace the DHT process and its p2pd (same identity and port), then dial and ping
        the initial peers and every peer remembered. Calls in flight are sent again to the
        new process; calls made meanwhile wait for it within their timeout. Raises if the
        new process is not up in `timeout` (default `start_timeout`), leaving no process
        behind (a later restart tries again). Comes up even when no peer answers (a
        partition): the re-merge keeps calling them."""
        if self._credentials is None:
            raise RuntimeError("SwarmDHT.restart: start() first")
        old = self._dht
        if old is not None:
            # Killed before taking the lock: a sender blocked on the old pipe holds it, and
            # only the process's death (EPIPE) frees it.
            self._kill(old)
        with self._send_lock:
            self._dht = None
        self._fail_in_flight(_Restarted("the DHT process was restarted during the call"))
        identity = self._credentials.identity
        key_dir = Path(tempfile.mkdtemp(prefix="dilonode-id-"))
        key_path = key_dir / "identity.key"
        t0 = time.monotonic()
        try:
            key_path.write_bytes(identity.to_bytes())
            # No bootstrap peers for p2pd and hivemind: p2pd refuses to start when none of
            # them can be reached, and hivemind waits for them. We dial them ourselves below.
            self._spawn(identity, key_path, [], self._bound_maddr, check_free=False,
                        strict=False, timeout=self.start_timeout if timeout is None else timeout)
        finally:
            shutil.rmtree(key_dir, ignore_errors=True)
        peers = self.known_peers()
        try:
            found = self.reconnect(peers, timeout=5.0)
        except (TimeoutError, DHTUnavailable) as exc:
            found = []
            log.warning("DHT restarted, but dialling its peers failed: %s", exc)
        log.info("DHT restarted in %.2fs as %s on %s; %d of %d known peers answered",
                 time.monotonic() - t0, self._peer_id, self._bound_maddr, len(found), len(peers))

    def _kill(self, dht: Any) -> None:
        """SIGKILL a DHT process (a stopped one too) and its p2pd, and reap it."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            dht.kill()
        dht.join(5.0)
        kill_p2pd(self._p2pd_pid)

    def remember_peers(self, timeout: float | None = None) -> dict[str, list[str]]:
        """Note the DHT addresses of the peers p2pd is connected to now; returns them."""
        now = time.monotonic()
        found = self._call("run_coroutine", node_peer_addrs, timeout=timeout)
        with self._count_lock:
            for peer, addrs in found.items():
                if peer != self._peer_id:
                    self._known[peer] = (addrs, now)
        return found

    def known_peers(self, max_age: float = math.inf) -> dict[str, list[str]]:
        """Remembered peers (peer id -> DHT addresses) seen connected within `max_age` s,
        plus the initial peers."""
        now = time.monotonic()
        with self._count_lock:
            out = {p: a for p, (a, t) in self._known.items() if now - t <= max_age}
        for maddr in self.initial_peers:
            with contextlib.suppress(ValueError):
                peer, addr = split_maddr(maddr)
                out.setdefault(peer, [])
                if addr not in out[peer]:
                    out[peer] = [*out[peer], addr]
        out.pop(self._peer_id or "", None)
        return out

    def reconnect(self, peers: dict[str, list[str]], timeout: float | None = None) -> list[str]:
        """Dial and ping `peers` (peer id -> DHT addresses); returns those that answered."""
        limit = self.op_timeout if timeout is None else timeout
        call = functools.partial(node_reconnect, peers=peers, timeout=limit)
        # Dials run concurrently; the neighbourhood lookup after them takes one more limit.
        return list(self._call("run_coroutine", call, timeout=3 * limit))

    def _remembered_maddrs(self) -> list[str]:
        with self._count_lock:
            known = dict(self._known)
        return [f"{addr}/p2p/{peer}" for peer, (addrs, _) in known.items() for addr in addrs]

    def __enter__(self) -> SwarmDHT:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- identity --------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._dht is not None

    @property
    def peer_id(self) -> str:
        """This node's libp2p peer id (base58); stable across restarts with `identity_path`."""
        if self._peer_id is None:
            raise RuntimeError("SwarmDHT not started")
        return self._peer_id

    @property
    def credentials(self) -> Credentials:
        """This node's identity with the run's secret and allowlist (signs, verifies)."""
        if self._credentials is None:
            raise RuntimeError("SwarmDHT not started")
        return self._credentials

    def p2p_daemon_maddr(self, timeout: float | None = None) -> Any:
        """Where the DHT's p2pd listens for clients (`dilonode.swarm.tunnel` attaches there)."""
        return self._call("run_coroutine", node_daemon_maddr, timeout=timeout)

    def visible_maddrs(self, timeout: float | None = None) -> list[str]:
        """Multiaddrs (with /p2p/<peer id>) other nodes can pass as `initial_peers`."""
        return self._call("run_coroutine", node_visible_maddrs, timeout=timeout)

    # -- raw access (also the matchmaking board) -------------------------------------------

    def store_raw(self, key: str, subkey: str, value: bytes, ttl: float,
                  timeout: float | None = None) -> bool:
        """Store `value` under (key, subkey) until DHT time now + ttl; False if refused.

        `subkey` must be this node's peer id: it is stored owner-protected, and the DHT
        refuses anything else. hivemind keeps, per subkey, the value with the latest
        expiration, so a store with an earlier expiration than the current one is refused
        (returns False).
        """
        from hivemind.utils import get_dht_time

        if subkey != self.peer_id:
            raise ValueError(f"subkey {subkey[:64]!r}: a node writes only under its own peer "
                             f"id {self.peer_id}")
        return self._store(key, value, get_dht_time() + ttl, timeout)

    def _store(self, key: str, value: bytes, expires_at: float, timeout: float | None) -> bool:
        return bool(self._call("store", key, value, expires_at, subkey=self._owner_subkey,
                               timeout=timeout))

    def get_raw(self, key: str, timeout: float | None = None) -> dict[str, RawEntry]:
        """The latest unexpired values of every subkey of `key` (empty if none), by plain
        subkey (the peer id); entries that are not owner-protected are dropped."""
        found = self._call("get", key, latest=True, timeout=timeout)
        if found is None:
            return {}
        if not isinstance(found.value, dict):
            self.note_rejected(key, "", "value stored without a subkey")
            return {}
        out: dict[str, RawEntry] = {}
        for subkey, item in found.value.items():
            if not isinstance(subkey, str) or not isinstance(item.value, bytes):
                self.note_rejected(key, repr(subkey)[:80], "subkey or value of the wrong type")
                continue
            # Our DHT process already refused these; a check here costs little and keeps
            # readers safe should a search ever hand back an unvalidated record.
            try:
                plain = plain_subkey(subkey)
            except AuthError as exc:
                self.note_rejected(key, subkey[:80], str(exc), unauthorized=True)
                continue
            out[plain] = RawEntry(item.value, float(item.expiration_time))
        return out

    def note_rejected(self, key: str, subkey: str, reason: str, *,
                      unauthorized: bool = False, once_per: str | None = None) -> None:
        """Count an unusable record; log it at WARNING the first time it is seen: per key,
        subkey and reason, or per subkey and `once_per` when that is given."""
        with self._count_lock:
            self.rejected_records += 1
            self.unauthorized_records += unauthorized
            seen = (key, subkey, reason) if once_per is None else ("", subkey, once_per)
            fresh = seen not in self._seen_rejections
            if fresh and len(self._seen_rejections) < _MAX_REMEMBERED_REJECTIONS:
                self._seen_rejections.add(seen)
        log.log(logging.WARNING if fresh else logging.DEBUG,
                "ignoring DHT record %s[%s]: %s", key, subkey, reason)

    # -- peer records ----------------------------------------------------------------------

    def publish(self, record: PeerRecord, ttl: float, timeout: float | None = None) -> bool:
        """Publish this node's PeerRecord for `ttl` seconds (stamps `expires_at`)."""
        from hivemind.utils import get_dht_time

        if record.run_id != self.run_id or record.peer_id != self.peer_id:
            raise ValueError(f"record of {record.peer_id}@{record.run_id} published by "
                             f"{self.peer_id}@{self.run_id}")
        expires_at = get_dht_time() + ttl
        stamped = record.model_copy(update={"expires_at": expires_at})
        return self._store(peers_key(self.run_id), encode_record(stamped, self.credentials),
                           expires_at, timeout)

    def fetch_peers(self, timeout: float | None = None) -> list[PeerRecord]:
        """Valid, unexpired PeerRecords of this run and protocol version, sorted by peer id."""
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        records = read_records(self, peers_key(self.run_id), PeerRecord, timeout)
        return [r for _, r in sorted(records.items()) if r.expires_at > now]

    # -- plumbing --------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, timeout: float | None, dht: Any = None,
              **kwargs: Any) -> Any:
        """Send one request (`method` of hivemind's DHT) and wait at most `timeout` for its
        answer. Without `dht`, to the current process; while there is none that can take it
        (restarting, dead, stopped), wait for one within the same `timeout`, so a round or
        a heartbeat rides out a restart instead of failing. With `dht`, to that process
        only, never waiting (start, health checks)."""
        limit = self.op_timeout if timeout is None else timeout
        deadline = time.monotonic() + max(limit, 0.0)
        while True:
            try:
                return self._send(method, args, kwargs, deadline, dht)
            except _Restarted:
                # Every request we send is safe to repeat (reads, stores of our own
                # records, our own coroutines): send it to the new process.
                if dht is not None or time.monotonic() >= deadline:
                    raise
            except (TimeoutError, concurrent.futures.TimeoutError):
                raise TimeoutError(f"DHT {method} got no answer within {limit:.1f}s") from None

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              deadline: float, dht: Any) -> Any:
        with self._send_lock:
            target = dht if dht is not None else self._usable(deadline)
            if (why := unusable(target)) is not None:
                raise DHTUnavailable(why)
            future = getattr(target, method)(*args, return_future=True, **kwargs)
            self._in_flight.add(future)
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise
        finally:
            with self._send_lock:
                self._in_flight.discard(future)

    def _usable(self, deadline: float) -> Any:
        """The current DHT process once it can take a request (send lock held), waiting
        until `deadline` for a restart; raises DHTUnavailable when closed or out of time."""
        while True:
            if self._closed:
                raise DHTUnavailable("SwarmDHT closed")
            why = ("SwarmDHT not started (or restarting)" if self._dht is None
                   else unusable(self._dht))
            if why is None:
                return self._dht
            left = deadline - time.monotonic()
            if left <= 0:
                raise DHTUnavailable(why)
            self._replaced.wait(min(left, 0.5))  # a dead process is noticed by polling
