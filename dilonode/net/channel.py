"""Sans-IO authenticated connections of the data plane: the handshake and per-frame MACs.

A connection is opened by the peer that will write on it (the connector) and accepted by
the one that will read (the acceptor). Before any round frame the two run a three-message
handshake (protocol/README.md section 9):

    connector -> acceptor   Hello     peer id, public key, ephemeral X25519 key (`nonce`)
    acceptor  -> connector  HelloAck  its peer id, public key, ephemeral key, signature, MAC
    connector -> acceptor   HelloAuth signature, MAC

Both signatures (each side's libp2p identity key) and both MACs (the swarm key, bound to the
run id and the swarm secret) cover the transcript hash of every field above, with the role
in the signed bytes so one side's proof cannot be reflected as the other's. The session key
mixes the X25519 shared secret with the swarm key, so neither a relay in the middle nor a
member who knows the secret can compute it. Every later frame on the connection is followed
by a 16-byte tag: the GMAC (AES-256-GCM over no plaintext, the frame as associated data)
of the frame under the session key, with the frame's sequence number as nonce
(`_FrameMac`; keyed BLAKE2b, then keyed BLAKE3 before protocol version 5, were slower).

`OutboundHandshake` is the connector's side, `InboundChannel` the acceptor's (it turns bytes
into authenticated round messages). With `creds=None` a side runs in *trust mode*: it sends
no public key or signature and accepts peers that do not either; only tests and benchmarks
with made-up peer ids use it (a node started by `dilonode run` always has credentials, and
then a peer without a valid signature for its claimed peer id is refused).

Every refusal raises `HandshakeError` (a `RemoteProtocolError`), one line, for the
transport to log and count as an unauthorized attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterator

import msgpack
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dilonode.net.auth import AuthError, Credentials, peer_id_of, swarm_key, verify
from dilonode.wire.errors import RemoteProtocolError, one_line
from dilonode.wire.framing import HEADER_BYTES, FrameDecoder, decode_message, encode_frame
from dilonode.wire.messages import Hello, HelloAck, HelloAuth, Message, RoundMessage

__all__ = [
    "HANDSHAKE_FRAME_MAX",
    "TAG_BYTES",
    "FrameSealer",
    "HandshakeError",
    "InboundChannel",
    "OutboundHandshake",
    "StreamOpener",
    "TaggedFrameReader",
    "read_handshake_frame",
]

# peer id -> a byte stream to that peer's listener by another path than a direct dial (a
# libp2p stream, `dilonode.swarm.tunnel`): the fallback of the data plane and of state sync.
StreamOpener = Callable[[str], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]

TAG_BYTES = 16
NONCE_BYTES = 32  # an X25519 public key
HANDSHAKE_FRAME_MAX = 4096  # a handshake frame is ~1 KB; refuse more before buffering it
_DOMAIN = "dilonode/v3/handshake"
_ROLE_ACCEPTOR = b"dilonode/v3/handshake/acceptor\0"
_ROLE_CONNECTOR = b"dilonode/v3/handshake/connector\0"
_NONCE = 12  # bytes of the big-endian frame counter that is each tag's GCM nonce


class HandshakeError(RemoteProtocolError):
    """A peer failed authentication or authorization (counted as an unauthorized attempt)."""


def _swarm_key(creds: Credentials | None, run_id: str) -> bytes:
    return creds.secret_key if creds is not None else swarm_key(run_id, b"")


def _transcript(hello: Hello, ack_peer: str, ack_key: bytes, ack_nonce: bytes) -> bytes:
    fields = [_DOMAIN, hello.version, hello.run_id, hello.peer_id, hello.public_key,
              hello.nonce, ack_peer, ack_key, ack_nonce]
    return hashlib.sha256(msgpack.packb(fields, use_bin_type=True)).digest()


def _session_key(swarm_key: bytes, shared: bytes, transcript: bytes) -> bytes:
    return hmac.digest(swarm_key, b"session\0" + shared + transcript, "sha256")


def _check_peer(creds: Credentials | None, peer_id: str, public_key: bytes, who: str) -> None:
    """The claimed peer id must be the key's; with credentials a key is required and the
    allowlist applies."""
    if not public_key:
        if creds is not None:
            raise HandshakeError(f"{who} {one_line(peer_id, 64)} sent no public key")
        return
    try:
        if creds is not None:
            creds.check_identity(peer_id, public_key)
        elif peer_id_of(public_key) != peer_id:
            raise AuthError(f"public key does not belong to peer {one_line(peer_id, 64)}")
    except AuthError as exc:
        raise HandshakeError(f"{who}: {exc}") from None


def _check_proof(swarm_key: bytes, role: bytes, transcript: bytes, public_key: bytes,
                 signature: bytes, mac: bytes, who: str) -> None:
    expected = hmac.digest(swarm_key, role + transcript, "sha256")
    if not hmac.compare_digest(expected, mac):
        raise HandshakeError(f"{who}: swarm secret mismatch (handshake MAC does not verify)")
    if public_key:
        try:
            verify(public_key, role + transcript, signature)
        except AuthError as exc:
            raise HandshakeError(f"{who}: cannot prove its peer id: {exc}") from None
    elif signature:
        raise HandshakeError(f"{who}: a signature without a public key")


def _proof(creds: Credentials | None, swarm_key: bytes, role: bytes,
           transcript: bytes) -> tuple[bytes, bytes]:
    signature = creds.identity.sign(role + transcript) if creds is not None else b""
    return signature, hmac.digest(swarm_key, role + transcript, "sha256")


def _ephemeral(seed: bytes | None) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(seed or os.urandom(32))


def _exchange(private: X25519PrivateKey, peer_nonce: bytes, who: str) -> bytes:
    if len(peer_nonce) != NONCE_BYTES:
        raise HandshakeError(f"{who}: nonce is {len(peer_nonce)} bytes, need {NONCE_BYTES}")
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_nonce))
    except ValueError:  # a low-order point gives an all-zero secret, which X25519 refuses
        raise HandshakeError(f"{who}: unusable ephemeral key") from None


def _public(private: X25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _check_creds(creds: Credentials | None, run_id: str, peer_id: str) -> None:
    if creds is not None and (creds.peer_id != peer_id or creds.run_id != run_id):
        raise ValueError(f"credentials of {creds.peer_id}@{creds.run_id} used as "
                         f"{peer_id}@{run_id}")


# ---------------------------------------------------------------------- per-frame MAC


class _FrameMac:
    """GMAC of frame number `seq` under a 32-byte key: AES-256-GCM with the frame as
    associated data, nothing encrypted, nonce = `seq` (96 bits, big-endian).

    Each key tags one direction of one connection and `seq` never repeats there, so no
    nonce is used twice. AES-NI and carry-less multiply run it at 11-17 GB/s on one core
    of the benchmark machine, against 5 GB/s for keyed BLAKE3 (protocol version 4), which
    took a tenth of a float32 round's CPU.
    """

    def __init__(self, key: algorithms.AES, seq: int) -> None:
        self._ctx = Cipher(key, modes.GCM(seq.to_bytes(_NONCE, "big"))).encryptor()

    @staticmethod
    def key(key: bytes) -> algorithms.AES:
        """The AES key object for `key`, made once per connection and direction: making it
        for every frame cost a few microseconds of Python each (key checks)."""
        if len(key) != 32:
            raise ValueError(f"frame MAC key: need 32 bytes, got {len(key)}")
        return algorithms.AES(key)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._ctx.authenticate_additional_data(data)

    def digest(self) -> bytes:
        self._ctx.finalize()
        return self._ctx.tag[:TAG_BYTES]


class FrameSealer:
    """Connector side: the tag to write after each frame, in order."""

    def __init__(self, key: bytes) -> None:
        self._key = _FrameMac.key(key)
        self._seq = 0

    def seal(self, *frame: bytes | bytearray | memoryview) -> bytes:
        """The next frame's tag; the frame may come in pieces (header, body), uncopied."""
        mac = _FrameMac(self._key, self._seq)
        for piece in frame:
            mac.update(piece)
        self._seq += 1
        return mac.digest()


class TaggedFrameReader:
    """Acceptor side: splits (frame, tag) pairs out of the byte stream, feeds the frames to a
    `FrameDecoder` and releases a frame's message only once its tag verifies.

    Bytes that lie wholly inside one frame body are passed on without copying.
    """

    def __init__(self, key: bytes, decoder: FrameDecoder) -> None:
        self._key = _FrameMac.key(key)
        self._decoder = decoder
        self._seq = 0
        self._mac = self._new_mac()
        self._header = bytearray()
        self._left: int | None = None  # body bytes still to come, None while in the header
        self._tag: bytearray | None = None  # set while reading a tag
        self._held: list[tuple[Message, int]] = []

    def _new_mac(self) -> _FrameMac:
        return _FrameMac(self._key, self._seq)

    def _frame_bytes(self, data: bytes | memoryview) -> None:
        self._mac.update(data)
        self._held.extend(self._decoder.feed_iter(data))

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[tuple[Message, int]]:
        """Yield (message, frame size) for every frame completed and verified by `data`."""
        view, pos, end = memoryview(data), 0, len(data)
        while pos < end:
            if self._tag is not None:
                take = min(TAG_BYTES - len(self._tag), end - pos)
                self._tag += view[pos:pos + take]
                pos += take
                if len(self._tag) == TAG_BYTES:
                    yield from self._verified()
            elif self._left is None:
                take = min(HEADER_BYTES - len(self._header), end - pos)
                self._header += view[pos:pos + take]
                pos += take
                if len(self._header) == HEADER_BYTES:
                    self._frame_bytes(bytes(self._header))  # the decoder checks the length
                    self._left = int.from_bytes(self._header, "big")
                    self._header.clear()
            else:
                take = min(self._left, end - pos)
                whole = pos == 0 and take == end and isinstance(data, bytes)
                self._frame_bytes(data if whole else view[pos:pos + take])  # type: ignore[arg-type]
                pos += take
                self._left -= take
                if self._left == 0:
                    self._left, self._tag = None, bytearray()

    def read_buffer(self) -> memoryview | None:
        """Where the next received bytes may be written directly, uncopied: the rest of a
        large frame body (`FrameDecoder.collect_buffer`); None when they must be `feed`."""
        if self._tag is not None or not self._left:
            return None
        buf = self._decoder.collect_buffer()
        if buf is not None and len(buf) != self._left:
            raise AssertionError(f"collect buffer of {len(buf)} bytes, frame has {self._left}")
        return buf

    def filled(self, n: int) -> None:
        """`n` bytes were written at the start of `read_buffer()`: authenticate and take
        them. Their message, if they completed one, is released with its tag by `feed`."""
        buf = self._decoder.collect_buffer()
        assert buf is not None and self._left is not None
        self._mac.update(buf[:n])
        if (item := self._decoder.collected(n)) is not None:
            self._held.append(item)
        self._left -= n
        if self._left == 0:
            self._left, self._tag = None, bytearray()

    def _verified(self) -> list[tuple[Message, int]]:
        assert self._tag is not None
        if not hmac.compare_digest(self._mac.digest(), bytes(self._tag)):
            raise HandshakeError(f"frame {self._seq}: MAC does not verify (tampered or "
                                 "injected data)")
        out, self._held, self._tag = self._held, [], None
        self._seq += 1
        self._mac = self._new_mac()
        return out


# ---------------------------------------------------------------------- handshake


def read_handshake_frame(buf: bytearray) -> bytes | None:
    """Pop one complete frame body from the front of `buf` (None if incomplete);
    HandshakeError for a length beyond `HANDSHAKE_FRAME_MAX`."""
    if len(buf) < HEADER_BYTES:
        return None
    length = int.from_bytes(buf[:HEADER_BYTES], "big")
    if not 0 < length <= HANDSHAKE_FRAME_MAX:
        raise HandshakeError(f"handshake frame of {length} bytes (expected 1.."
                             f"{HANDSHAKE_FRAME_MAX})")
    if len(buf) < HEADER_BYTES + length:
        return None
    body = bytes(buf[HEADER_BYTES:HEADER_BYTES + length])
    del buf[:HEADER_BYTES + length]
    return body


class OutboundHandshake:
    """The connector's side: `hello_frame()`, then `on_ack(body)` -> (auth frame, sealer).

    `expected_peer` is the peer id we meant to reach: anyone else answering is refused.
    """

    def __init__(self, creds: Credentials | None, run_id: str, peer_id: str,
                 expected_peer: str, *, ephemeral_seed: bytes | None = None) -> None:
        _check_creds(creds, run_id, peer_id)
        self.creds = creds
        self.expected_peer = expected_peer
        self._private = _ephemeral(ephemeral_seed)
        public_key = creds.identity.public_key if creds is not None else b""
        self.hello = Hello(run_id=run_id, peer_id=peer_id, public_key=public_key,
                           nonce=_public(self._private))
        self._swarm_key = _swarm_key(creds, run_id)
        self.session_key = b""  # set by on_ack (state sync derives its reply key from it)

    def hello_frame(self) -> bytes:
        return encode_frame(self.hello)

    def on_ack(self, body: bytes) -> tuple[bytes, FrameSealer]:
        """Check the acceptor's answer; HandshakeError (or RemoteProtocolError for a frame
        that does not decode) if it is not the peer we dialed, proven and admitted."""
        ack = decode_message(body, run_id=self.hello.run_id)
        who = f"peer {one_line(self.expected_peer, 64)}"
        if not isinstance(ack, HelloAck):
            raise HandshakeError(f"{who}: expected hello_ack, got {ack.type}")
        if ack.peer_id != self.expected_peer:
            raise HandshakeError(f"{who}: dialed it but {one_line(ack.peer_id, 64)} answered")
        _check_peer(self.creds, ack.peer_id, ack.public_key, who)
        shared = _exchange(self._private, ack.nonce, who)
        transcript = _transcript(self.hello, ack.peer_id, ack.public_key, ack.nonce)
        _check_proof(self._swarm_key, _ROLE_ACCEPTOR, transcript, ack.public_key,
                     ack.signature, ack.mac, who)
        signature, mac = _proof(self.creds, self._swarm_key, _ROLE_CONNECTOR, transcript)
        auth = HelloAuth(run_id=self.hello.run_id, signature=signature, mac=mac)
        self.session_key = _session_key(self._swarm_key, shared, transcript)
        return encode_frame(auth), FrameSealer(self.session_key)


class InboundChannel:
    """The acceptor's side of one connection: handshake, then verified round messages.

    `feed(data)` yields (round message, frame size) pairs once the peer is authenticated;
    frames to write back (the `HelloAck`) are appended to `outgoing`. `claimed` is the
    peer id from the Hello (for log lines only); `peer_id` is set once it is proven.
    """

    def __init__(self, creds: Credentials | None, run_id: str, peer_id: str, *,
                 max_frame_bytes: int, ephemeral_seed: bytes | None = None) -> None:
        _check_creds(creds, run_id, peer_id)
        self.creds = creds
        self.run_id = run_id
        self.my_peer_id = peer_id
        self.max_frame_bytes = max_frame_bytes
        self.claimed: str | None = None
        self.peer_id: str | None = None
        self.outgoing: list[bytes] = []
        self._seed = ephemeral_seed
        self._swarm_key = _swarm_key(creds, run_id)
        self._buf = bytearray()
        self._hello: Hello | None = None
        self._ack: HelloAck | None = None
        self._shared = b""
        self._reader: TaggedFrameReader | None = None
        self.session_key = b""  # set once the peer is proven (state sync uses it too)

    @property
    def authenticated(self) -> bool:
        return self._reader is not None

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[tuple[RoundMessage, int]]:
        if self._reader is None:
            self._buf += data
            while self._reader is None and (body := read_handshake_frame(self._buf)):
                self._handshake(decode_message(body, run_id=self.run_id))
            if self._reader is None or not self._buf:
                return
            data, self._buf = bytes(self._buf), bytearray()
        for msg, size in self._reader.feed(data):
            if isinstance(msg, Hello | HelloAck | HelloAuth):
                raise RemoteProtocolError(f"{msg.type} after the handshake")
            yield msg, size

    def read_buffer(self) -> memoryview | None:
        """See `TaggedFrameReader.read_buffer`; None during the handshake."""
        if self._reader is None:
            return None
        return self._reader.read_buffer()

    def filled(self, n: int) -> None:
        """See `TaggedFrameReader.filled`."""
        assert self._reader is not None
        self._reader.filled(n)

    def _handshake(self, msg: Message) -> None:
        if self._hello is None:
            if not isinstance(msg, Hello):
                raise HandshakeError(f"expected hello as the first frame, got {msg.type}")
            self._on_hello(msg)
        elif isinstance(msg, HelloAuth):
            self._on_auth(msg)
        else:
            raise HandshakeError(f"expected auth after hello, got {msg.type}")

    def _on_hello(self, hello: Hello) -> None:
        self.claimed = hello.peer_id
        who = f"peer {one_line(hello.peer_id, 64)}"
        _check_peer(self.creds, hello.peer_id, hello.public_key, who)
        private = _ephemeral(self._seed)
        self._shared = _exchange(private, hello.nonce, who)
        public_key = self.creds.identity.public_key if self.creds is not None else b""
        nonce = _public(private)
        transcript = _transcript(hello, self.my_peer_id, public_key, nonce)
        signature, mac = _proof(self.creds, self._swarm_key, _ROLE_ACCEPTOR, transcript)
        self._hello = hello
        self._ack = HelloAck(run_id=self.run_id, peer_id=self.my_peer_id,
                             public_key=public_key, nonce=nonce, signature=signature, mac=mac)
        self.outgoing.append(encode_frame(self._ack))

    def _on_auth(self, auth: HelloAuth) -> None:
        assert self._hello is not None and self._ack is not None
        hello, ack = self._hello, self._ack
        transcript = _transcript(hello, ack.peer_id, ack.public_key, ack.nonce)
        _check_proof(self._swarm_key, _ROLE_CONNECTOR, transcript, hello.public_key,
                     auth.signature, auth.mac, f"peer {one_line(hello.peer_id, 64)}")
        self.peer_id = hello.peer_id
        decoder = FrameDecoder(max_frame_bytes=self.max_frame_bytes, run_id=self.run_id)
        key = _session_key(self._swarm_key, self._shared, transcript)
        self._reader = TaggedFrameReader(key, decoder)
        self.session_key = key
