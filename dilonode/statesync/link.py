"""Authenticated state-sync connections: the data plane's handshake, then MACed frames both ways.

A state-sync connection opens with exactly the handshake of a data-plane connection
(`dilonode.net.channel`, protocol/README.md section 9), run by the same sans-IO code:
the joiner is the connector and names the peer id it found in the server's signed peer
record (anyone else answering is refused, so an impostor at that address serves nothing),
and the server is the acceptor and refuses a joiner that the run's credentials (swarm
secret, allowlist) do not admit. Unlike a data-plane connection, this one carries frames
both ways, so each direction has its own key: requests are tagged under the session key S,
as data-plane frames are, and replies under HMAC-SHA256(S, "dilonode/v3/statesync/reply\\0"),
so that no frame can be reflected back to its sender as one of its peer's. Every frame is
followed by its 16-byte tag (`FrameSealer`, counting frames per direction from 0); the
receiver checks the tag before it decodes the body, and a mismatch is a `HandshakeError`.

    link = await Link.connect("10.0.0.2:7001", creds, run_id, my_id, "QmServer...", timeout)
    link.send(ManifestRequest(run_id=run_id)); manifest = await link.recv()

    link = await Link.accept(reader, writer, creds, run_id, my_id, timeout)   # server side
"""

from __future__ import annotations

import asyncio
import hmac

from dilonode.net.auth import Credentials
from dilonode.net.channel import (
    HANDSHAKE_FRAME_MAX,
    TAG_BYTES,
    FrameSealer,
    HandshakeError,
    InboundChannel,
    OutboundHandshake,
    StreamOpener,
    read_handshake_frame,
)
from dilonode.statesync.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    StateMessage,
    decode_body,
    encode_frame,
)
from dilonode.wire.errors import RemoteProtocolError

__all__ = ["CONNECT_TIMEOUT_S", "Link", "own_peer_id", "reply_key"]

# A TCP connect answers within a round trip or two; an address that drops the SYN (a peer
# behind a NAT, a firewall) is given up on after this, not after the request timeout.
CONNECT_TIMEOUT_S = 5.0

_REPLY_LABEL = b"dilonode/v3/statesync/reply\0"


def reply_key(session_key: bytes) -> bytes:
    """The key of the server-to-joiner direction (the joiner's requests use `session_key`)."""
    return hmac.digest(session_key, _REPLY_LABEL, "sha256")


async def _handshake_frame(reader: asyncio.StreamReader) -> bytes:
    """One whole handshake frame (length prefix included), read exactly: the bytes after it
    belong to the MACed stream. An oversize length is refused before its body is read."""
    header = await reader.readexactly(HEADER.size)
    read_handshake_frame(bytearray(header))  # raises HandshakeError on a bad length
    return header + await reader.readexactly(HEADER.unpack(header)[0])


class Link:
    """One authenticated, framed state-sync connection; every read has a timeout."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float, peer_id: str, send_key: bytes, recv_key: bytes) -> None:
        self.reader, self.writer, self.timeout = reader, writer, timeout
        self.peer_id = peer_id  # proven by the handshake
        self._sealer = FrameSealer(send_key)
        self._expected = FrameSealer(recv_key)  # the tags the peer must send, in order
        self.frames_in = 0

    @classmethod
    async def connect(cls, addr: str, auth: Credentials | None, run_id: str, peer_id: str,
                      expected_peer: str, timeout: float,
                      opener: StreamOpener | None = None) -> Link:
        """Dial `addr` and prove that `expected_peer` answers (HandshakeError otherwise).
        The TCP connect itself gets at most `CONNECT_TIMEOUT_S` (an address behind a NAT
        or a firewall that drops the SYN is given up on then), the handshake the rest of
        `timeout`. With `opener` (a peer behind a NAT) the stream comes from it (a libp2p
        stream, `dilonode.swarm.tunnel`) instead of a dial; the handshake is the same."""
        host, _, port = addr.rpartition(":")
        async with asyncio.timeout(timeout):
            async with asyncio.timeout(min(timeout, CONNECT_TIMEOUT_S)):
                if opener is not None:
                    reader, writer = await opener(expected_peer)
                else:
                    reader, writer = await asyncio.open_connection(host, int(port))
            try:
                shake = OutboundHandshake(auth, run_id, peer_id, expected_peer)
                writer.write(shake.hello_frame())
                ack = await _handshake_frame(reader)
                auth_frame, _ = shake.on_ack(ack[HEADER.size:])
                writer.write(auth_frame)
            except BaseException:
                writer.transport.abort()
                raise
        key = shake.session_key
        return cls(reader, writer, timeout, expected_peer, key, reply_key(key))

    @classmethod
    async def accept(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     auth: Credentials | None, run_id: str, peer_id: str,
                     timeout: float) -> Link:
        """Run the acceptor's side on an accepted connection. HandshakeError when the joiner
        is refused, sends anything but the handshake, does not finish in `timeout` s, or
        hangs up after our answer; IncompleteReadError when it leaves before a word."""
        channel = InboundChannel(auth, run_id, peer_id, max_frame_bytes=HANDSHAKE_FRAME_MAX)
        try:
            async with asyncio.timeout(timeout):
                while not channel.authenticated:
                    # One frame at a time, so nothing after `auth` reaches the channel's
                    # own (all-reduce) frame reader: the loop body never runs.
                    for _ in channel.feed(await _handshake_frame(reader)):
                        pass
                    for frame in channel.outgoing:
                        writer.write(frame)
                    channel.outgoing.clear()
        except TimeoutError:
            raise HandshakeError(f"no complete handshake within {timeout:g}s") from None
        except HandshakeError:
            raise
        except RemoteProtocolError as exc:  # e.g. a request without the handshake
            raise HandshakeError(f"handshake: {exc.reason}") from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if channel.claimed is None:
                raise
            raise HandshakeError(f"handshake abandoned by {channel.claimed}: "
                                 f"{type(exc).__name__}") from None
        assert channel.peer_id is not None
        key = channel.session_key
        return cls(reader, writer, timeout, channel.peer_id, reply_key(key), key)

    def send(self, msg: StateMessage) -> None:
        frame = encode_frame(msg)
        self.writer.write(frame)
        self.writer.write(self._sealer.seal(frame))

    async def drain(self) -> None:
        await asyncio.wait_for(self.writer.drain(), self.timeout)

    async def recv(self, timeout: float | None = None) -> StateMessage:
        """The next frame's message once its tag verifies; RemoteProtocolError (HandshakeError
        for a wrong tag) on anything malformed."""
        async with asyncio.timeout(timeout or self.timeout):
            header = await self.reader.readexactly(HEADER.size)
            (n,) = HEADER.unpack(header)
            if not 1 <= n <= MAX_FRAME_BYTES:
                raise RemoteProtocolError(f"state sync frame of {n} bytes (max "
                                          f"{MAX_FRAME_BYTES})")
            body = await self.reader.readexactly(n)
            tag = await self.reader.readexactly(TAG_BYTES)
        if not hmac.compare_digest(self._expected.seal(header, body), tag):
            raise HandshakeError(f"state sync frame {self.frames_in}: MAC does not verify "
                                 "(tampered or injected data)")
        self.frames_in += 1
        return decode_body(body)

    def close(self) -> None:
        self.writer.close()


def own_peer_id(auth: Credentials | None, peer_id: str | None) -> str:
    """Our peer id in the handshake: the credentials' own, or a made-up one in trust mode."""
    if auth is not None:
        if peer_id not in (None, auth.peer_id):
            raise ValueError(f"state sync: credentials of {auth.peer_id} used as {peer_id}")
        return auth.peer_id
    if peer_id is None:
        raise ValueError("state sync: trust mode (no credentials) needs an explicit peer_id")
    return peer_id
