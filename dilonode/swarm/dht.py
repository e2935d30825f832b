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

`import hivemind` costs seconds, so it happens in `start()`, never at module import.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import msgpack

from dilonode.auth import AuthError, Credentials, Identity, peer_id_of_ssh_key
from dilonode.swarm.records import (
    RUN_ID_PATTERN,
    PeerRecord,
    Record,
    decode_record,
    encode_record,
    peers_key,
)

__all__ = ["RawEntry", "SwarmDHT", "decode_entries", "owner_subkey", "plain_subkey"]

log = logging.getLogger(__name__)

# Distinct (key, subkey, reason) triples remembered to log each at WARNING only once.
_MAX_REMEMBERED_REJECTIONS = 1024
_hivemind_ready = False
_hivemind_lock = threading.Lock()
# hivemind's marker, `RSASignatureValidator.PUBLIC_KEY_FORMAT`, at the end of the subkey.
_OWNER_SUBKEY = re.compile(r"(?P<plain>[^\[\]]*)\[owner:(?P<key>[^\[\]]+)\]", re.ASCII)


R = TypeVar("R", bound=Record)


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
            board.note_rejected(key, subkey, str(exc), unauthorized=isinstance(exc, AuthError))
            continue
        if record.peer_id != subkey:
            board.note_rejected(key, subkey, f"entry names peer {record.peer_id}")
        else:
            out[subkey] = record
    return out


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


def _import_hivemind() -> Any:
    """Import hivemind once and undo its process-wide logging side effects."""
    global _hivemind_ready
    with _hivemind_lock:
        import hivemind
        from hivemind.utils.logging import use_hivemind_log_handler

        if not _hivemind_ready:
            # hivemind renames WARNING to "WARN" for every logger in the process and installs
            # its own INFO-level handler; route its records through the application's logging
            # instead and keep only its warnings (its INFO lines are p2pd chatter).
            logging.addLevelName(logging.WARNING, "WARNING")
            use_hivemind_log_handler("nowhere")
            logging.getLogger("hivemind").setLevel(logging.WARNING)
            _hivemind_ready = True
        return hivemind


def _ensure_fork_start_method() -> None:
    # The DHT is a ForkProcess, but hivemind's MPFuture locks and pipes come from the default
    # context; hivemind is only tested with "fork" there, so make it the default in
    # spawn-started processes (e.g. torch.multiprocessing workers) before the first DHT.
    if mp.get_start_method() != "fork":
        log.info("switching the multiprocessing start method to 'fork' for hivemind")
        mp.set_start_method("fork", force=True)


async def _node_peer_id(_dht: Any, node: Any) -> str:
    return node.peer_id.to_base58()


async def _node_daemon_maddr(_dht: Any, node: Any) -> Any:
    return node.p2p.daemon_listen_maddr


async def _node_visible_maddrs(_dht: Any, node: Any) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs()]


def _host_maddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"


def _die_with_parent(parent_pid: int) -> None:
    """In a forked child: get SIGKILL when the parent dies (Linux), so a SIGKILLed node
    leaves no DHT process behind still answering for its peer id."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the parent's close() is the only way down
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _orphan_safe(dht_class: Any) -> Any:
    """hivemind.DHT subclass whose process dies with the process that started it."""

    class OrphanSafeDHT(dht_class):  # type: ignore[misc, valid-type]
        _dilonode_p2pd_flags: dict[str, Any] = {}

        def run(self) -> None:
            _die_with_parent(self._dilonode_parent)
            if self._dilonode_p2pd_flags:  # before the node starts its p2pd
                from dilonode.swarm.reach import add_p2pd_flags

                add_p2pd_flags(self._dilonode_p2pd_flags)
            super().run()

        def run_in_background(self, *args: Any, **kwargs: Any) -> Any:
            self._dilonode_parent = os.getpid()
            return super().run_in_background(*args, **kwargs)

    return OrphanSafeDHT


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
    ) -> None:
        if not re.fullmatch(RUN_ID_PATTERN, run_id):
            raise ValueError(f"run_id {run_id!r} does not match {RUN_ID_PATTERN}")
        self.run_id = run_id
        self.initial_peers = list(initial_peers)
        self.identity_path = identity_path
        self.host_maddr = _host_maddr(host, port)
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
        self._credentials: Credentials | None = None
        self._owner_subkey = ""
        self._dht: Any = None
        self._peer_id: str | None = None
        # A multiprocessing Connection is not safe for concurrent sends from several threads.
        self._send_lock = threading.Lock()
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
        hivemind = _import_hivemind()
        _ensure_fork_start_method()
        identity, key_path, fresh = self._identity()
        dht = _orphan_safe(hivemind.DHT)(
            initial_peers=self.initial_peers or None,
            start=False,
            host_maddrs=[self.host_maddr],
            identity_path=str(key_path),
            # A key made just now is nobody else's: skip hivemind's slow check of the swarm.
            check_if_identity_free=not fresh,
            record_validators=[_owner_validator(identity)],
            shutdown_timeout=self.shutdown_timeout,
            startup_timeout=self.start_timeout,
            **self.p2p_options,
        )
        dht._dilonode_p2pd_flags = self.p2pd_flags
        t0 = time.monotonic()
        try:
            dht.run_in_background(await_ready=True, timeout=self.start_timeout)
            self._dht = dht
            self._peer_id = self._call(dht.run_coroutine, _node_peer_id, timeout=self.op_timeout)
            if self._peer_id != identity.peer_id:
                raise RuntimeError(f"DHT runs as {self._peer_id}, but the key at {key_path} "
                                   f"is {identity.peer_id}")
        except BaseException:
            self._dht = None
            self._stop_process(dht)
            raise
        finally:
            if self.identity_path is None:  # p2pd has read the throwaway key file by now
                shutil.rmtree(key_path.parent, ignore_errors=True)
        self._credentials = Credentials(identity, self.run_id, self._secret, self._allowed)
        self._owner_subkey = owner_subkey(identity)
        if self._allowed is not None and identity.peer_id not in self._allowed:
            log.warning("this node (%s) is not in auth.allowed_peers: peers will refuse it",
                        identity.peer_id)
        log.info("DHT up in %.2fs as %s (%d initial peers)", time.monotonic() - t0,
                 self._peer_id, len(self.initial_peers))
        return self

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
        dht, self._dht = self._dht, None
        if dht is not None:
            self._stop_process(dht)
        with self._send_lock:
            pending, self._in_flight = self._in_flight, set()
        for future in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # answered since
                future.set_exception(RuntimeError("SwarmDHT closed during the call"))

    def _stop_process(self, dht: Any) -> None:
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
        return self._call(self._running().run_coroutine, _node_daemon_maddr, timeout=timeout)

    def visible_maddrs(self, timeout: float | None = None) -> list[str]:
        """Multiaddrs (with /p2p/<peer id>) other nodes can pass as `initial_peers`."""
        return self._call(self._running().run_coroutine, _node_visible_maddrs, timeout=timeout)

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
        dht = self._running()
        return bool(self._call(dht.store, key, value, expires_at, subkey=self._owner_subkey,
                               timeout=timeout))

    def get_raw(self, key: str, timeout: float | None = None) -> dict[str, RawEntry]:
        """The latest unexpired values of every subkey of `key` (empty if none), by plain
        subkey (the peer id); entries that are not owner-protected are dropped."""
        found = self._call(self._running().get, key, latest=True, timeout=timeout)
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
                      unauthorized: bool = False) -> None:
        """Count an unusable record; log it at WARNING the first time it is seen."""
        with self._count_lock:
            self.rejected_records += 1
            self.unauthorized_records += unauthorized
            fresh = (key, subkey, reason) not in self._seen_rejections
            if fresh and len(self._seen_rejections) < _MAX_REMEMBERED_REJECTIONS:
                self._seen_rejections.add((key, subkey, reason))
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

        key = peers_key(self.run_id)
        now = get_dht_time()
        records = decode_entries(self, key, self.get_raw(key, timeout=timeout), PeerRecord,
                                 self.credentials)
        return [r for _, r in sorted(records.items()) if r.expires_at > now]

    # -- plumbing --------------------------------------------------------------------------

    def _running(self) -> Any:
        if self._dht is None:
            raise RuntimeError("SwarmDHT not started (or closed)")
        return self._dht

    def _call(self, method: Any, *args: Any, timeout: float | None, **kwargs: Any) -> Any:
        """Send one request to the DHT process and wait at most `timeout` for its answer."""
        limit = self.op_timeout if timeout is None else timeout
        with self._send_lock:
            if self._dht is None:  # closed while this call waited for the lock
                raise RuntimeError("SwarmDHT not started (or closed)")
            future = method(*args, return_future=True, **kwargs)
            self._in_flight.add(future)
        try:
            return future.result(timeout=max(limit, 0.0))
        # Distinct classes on Python 3.10, aliases from 3.11 on.
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            name = getattr(method, "__name__", "call")
            raise TimeoutError(f"DHT {name} got no answer within {limit:.1f}s") from None
        finally:
            with self._send_lock:
                self._in_flight.discard(future)
