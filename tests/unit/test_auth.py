"""Identities, the sans-IO data-plane handshake with per-frame MACs, and signed DHT records.

No sockets: the handshake runs by handing frames between `OutboundHandshake` and
`InboundChannel` in memory. RSA keys are generated once per module (a few hundred ms).
"""

from __future__ import annotations

import base64
import os
import random
import stat
from pathlib import Path

import msgpack
import pytest

from dilonode.net.auth import (
    AuthError,
    Credentials,
    Identity,
    allowed_peer_id,
    load_secret,
    open_record,
    peer_id_of,
    seal_record,
    swarm_key,
)
from dilonode.net.channel import (
    HandshakeError,
    InboundChannel,
    OutboundHandshake,
    _proof,
    _transcript,
)
from dilonode.swarm.records import GroupEntry, decode_record, encode_record
from dilonode.wire.errors import RemoteProtocolError
from dilonode.wire.framing import HEADER_BYTES, encode_frame
from dilonode.wire.messages import Abort, Contribution, HelloAuth

RUN = "auth-run"
SECRET = b"correct horse battery staple"
A, B, C = Identity.generate(), Identity.generate(), Identity.generate()
MAX_FRAME = 1 << 20


def creds(identity: Identity, secret: bytes = SECRET,
          allowed: frozenset[str] | None = None) -> Credentials:
    return Credentials(identity, RUN, secret, allowed)


def abort(n: int) -> Abort:
    return Abort(run_id=RUN, fragment=1, round=n, sender=0, reason=f"frame {n}")


def handshake(conn: Credentials | None, acc: Credentials | None, *, conn_id: str = "",
              acc_id: str = "", expected: str = "") -> tuple[OutboundHandshake, InboundChannel,
                                                             bytes]:
    """Run the three messages; returns both sides and the connector's auth frame."""
    conn_id = conn_id or (conn.peer_id if conn else "conn")
    acc_id = acc_id or (acc.peer_id if acc else "acc")
    out = OutboundHandshake(conn, RUN, conn_id, expected or acc_id)
    inn = InboundChannel(acc, RUN, acc_id, max_frame_bytes=MAX_FRAME)
    assert list(inn.feed(out.hello_frame())) == []
    (ack,) = inn.outgoing
    auth_frame, _ = out.on_ack(ack[HEADER_BYTES:])
    return out, inn, auth_frame


def connected(conn: Credentials | None = None, acc: Credentials | None = None):
    conn = conn or creds(A)
    acc = acc or creds(B)
    out = OutboundHandshake(conn, RUN, conn.peer_id, acc.peer_id)
    inn = InboundChannel(acc, RUN, acc.peer_id, max_frame_bytes=MAX_FRAME)
    list(inn.feed(out.hello_frame()))
    auth_frame, sealer = out.on_ack(inn.outgoing.pop()[HEADER_BYTES:])
    assert list(inn.feed(auth_frame)) == []
    return inn, sealer


# ---------------------------------------------------------------------- identities


def test_identity_file_round_trip_and_permissions(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id and again.public_key == first.public_key
    assert first.peer_id.startswith("Qm") and peer_id_of(first.public_key) == first.peer_id
    assert "PRIVATE" not in repr(first) and first.peer_id in repr(first)


def test_identity_garbage_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(b"\x08\x00\x12\x03abc")
    with pytest.raises(AuthError) as info:
        Identity.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(AuthError, match="no such file|No such file"):
        Identity.load(tmp_path / "missing.key")


def test_signatures_verify_only_for_their_key_and_message() -> None:
    from dilonode.net.auth import verify

    sig = A.sign(b"message")
    verify(A.public_key, b"message", sig)
    with pytest.raises(AuthError, match="bad signature"):
        verify(A.public_key, b"messagE", sig)
    with pytest.raises(AuthError, match="bad signature"):
        verify(B.public_key, b"message", sig)
    with pytest.raises(AuthError, match="protobuf"):
        verify(b"\x01" * 64, b"message", sig)


def test_allowlist_entries_accept_peer_ids_and_public_keys() -> None:
    assert allowed_peer_id(A.peer_id) == A.peer_id
    assert allowed_peer_id(base64.b64encode(B.public_key).decode()) == B.peer_id
    for bad in ("", "nope", "Qm" + "1" * 10, base64.b64encode(b"x" * 50).decode()):
        with pytest.raises(ValueError, match="allowlist entry"):
            allowed_peer_id(bad)


def test_secret_from_file_or_env_never_in_messages(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_secret(path, None, {}) == SECRET
    assert load_secret(None, "SWARM", {"SWARM": SECRET.decode()}) == SECRET
    assert load_secret(None, None, {"SWARM": "x"}) == b""
    with pytest.raises(ValueError, match="SWARM is not set"):
        load_secret(None, "SWARM", {})
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16") as info:
        load_secret(path, None, {})
    assert "short" not in str(info.value)
    assert SECRET.decode() not in repr(creds(A))


# ---------------------------------------------------------------------- handshake


@pytest.mark.parametrize("secret", [SECRET, b""])
def test_handshake_proves_both_sides_and_frames_flow(secret: bytes) -> None:
    inn, sealer = connected(creds(A, secret), creds(B, secret))
    assert inn.peer_id == A.peer_id
    frames = [encode_frame(abort(n)) for n in range(3)]
    stream = b"".join(f + sealer.seal(f) for f in frames)
    got = []
    for i in range(0, len(stream), 7):  # arbitrary splits, tags straddling feeds
        got += [m for m, _ in inn.feed(stream[i:i + 7])]
    assert got == [abort(n) for n in range(3)]


def test_trust_mode_handshake_works_between_planes_without_credentials() -> None:
    out, inn, auth_frame = handshake(None, None, conn_id="peer-0", acc_id="peer-1")
    assert list(inn.feed(auth_frame)) == [] and inn.peer_id == "peer-0"


def test_wrong_secret_is_refused_on_both_sides() -> None:
    out = OutboundHandshake(creds(A, b"x" * 16), RUN, A.peer_id, B.peer_id)
    inn = InboundChannel(creds(B), RUN, B.peer_id, max_frame_bytes=MAX_FRAME)
    list(inn.feed(out.hello_frame()))
    with pytest.raises(HandshakeError, match="swarm secret mismatch"):
        out.on_ack(inn.outgoing.pop()[HEADER_BYTES:])
    # A connector that ignores the acceptor's proof still cannot produce its own MAC.
    transcript = _transcript(out.hello, inn._ack.peer_id, inn._ack.public_key, inn._ack.nonce)
    sig, mac = _proof(creds(A, b"x" * 16), swarm_key(RUN, b"x" * 16),
                      b"dilonode/v3/handshake/connector\0", transcript)
    with pytest.raises(HandshakeError, match="swarm secret mismatch"):
        list(inn.feed(encode_frame(HelloAuth(run_id=RUN, signature=sig, mac=mac))))
    assert inn.peer_id is None


def test_peer_outside_the_allowlist_is_refused_at_hello() -> None:
    only_b = frozenset({B.peer_id})
    out = OutboundHandshake(creds(A), RUN, A.peer_id, B.peer_id)
    inn = InboundChannel(creds(B, allowed=only_b), RUN, B.peer_id, max_frame_bytes=MAX_FRAME)
    with pytest.raises(HandshakeError, match=f"{A.peer_id} is not in the allowlist"):
        list(inn.feed(out.hello_frame()))
    assert inn.outgoing == [] and inn.peer_id is None  # nothing said to a refused peer
    # The connector checks the acceptor against its own allowlist too.
    with pytest.raises(HandshakeError, match="not in the allowlist"):
        handshake(creds(B, allowed=only_b), creds(A))


def test_forged_peer_id_with_own_key_is_refused() -> None:
    # C claims to be A but presents its own public key.
    out = OutboundHandshake(creds(C), RUN, C.peer_id, B.peer_id)
    forged = out.hello.model_copy(update={"peer_id": A.peer_id})
    inn = InboundChannel(creds(B), RUN, B.peer_id, max_frame_bytes=MAX_FRAME)
    with pytest.raises(HandshakeError, match=f"does not belong to peer {A.peer_id}"):
        list(inn.feed(encode_frame(forged)))


def test_forged_peer_id_with_the_victims_public_key_cannot_sign() -> None:
    # C knows the secret and A's public key (both public to members), not A's private key.
    out = OutboundHandshake(creds(C), RUN, C.peer_id, B.peer_id)
    forged = out.hello.model_copy(update={"peer_id": A.peer_id, "public_key": A.public_key})
    inn = InboundChannel(creds(B), RUN, B.peer_id, max_frame_bytes=MAX_FRAME)
    list(inn.feed(encode_frame(forged)))
    ack = inn._ack
    transcript = _transcript(forged, ack.peer_id, ack.public_key, ack.nonce)
    sig, mac = _proof(creds(C), swarm_key(RUN, SECRET), b"dilonode/v3/handshake/connector\0",
                      transcript)
    with pytest.raises(HandshakeError, match="cannot prove its peer id: bad signature"):
        list(inn.feed(encode_frame(HelloAuth(run_id=RUN, signature=sig, mac=mac))))
    assert inn.peer_id is None


def test_acceptors_proof_cannot_be_reflected_as_a_connectors() -> None:
    out = OutboundHandshake(creds(A), RUN, A.peer_id, B.peer_id)
    inn = InboundChannel(creds(B), RUN, B.peer_id, max_frame_bytes=MAX_FRAME)
    list(inn.feed(out.hello_frame()))
    ack = inn._ack
    replay = HelloAuth(run_id=RUN, signature=ack.signature, mac=ack.mac)
    with pytest.raises(HandshakeError, match="swarm secret mismatch"):
        list(inn.feed(encode_frame(replay)))


def test_credentialed_side_refuses_a_peer_without_a_key() -> None:
    with pytest.raises(HandshakeError, match="sent no public key"):
        handshake(None, creds(B), conn_id="someone")
    with pytest.raises(HandshakeError, match="sent no public key"):
        handshake(creds(A), None, acc_id="someone")


def test_connector_refuses_an_acceptor_that_is_not_the_peer_it_dialed() -> None:
    with pytest.raises(HandshakeError, match=f"{C.peer_id} answered"):
        handshake(creds(A), creds(C), expected=B.peer_id)


def test_round_messages_before_the_handshake_completes_are_refused() -> None:
    inn = InboundChannel(creds(B), RUN, B.peer_id, max_frame_bytes=MAX_FRAME)
    with pytest.raises(HandshakeError, match="expected hello as the first frame"):
        list(inn.feed(encode_frame(abort(0))))
    out = OutboundHandshake(creds(A), RUN, A.peer_id, B.peer_id)
    inn = InboundChannel(creds(B), RUN, B.peer_id, max_frame_bytes=MAX_FRAME)
    list(inn.feed(out.hello_frame()))
    with pytest.raises(HandshakeError, match="expected auth after hello"):
        list(inn.feed(encode_frame(abort(0))))
    with pytest.raises(HandshakeError, match="handshake frame of"):
        list(InboundChannel(None, RUN, "x", max_frame_bytes=MAX_FRAME).feed(b"\xff" * 8))


@pytest.mark.parametrize("attack", ["flip_body", "flip_tag", "swap", "replay", "no_tag"])
def test_tampered_frames_are_refused(attack: str) -> None:
    inn, sealer = connected()
    f0, f1 = encode_frame(abort(0)), encode_frame(abort(1))
    t0, t1 = sealer.seal(f0), sealer.seal(f1)
    stream = {
        "flip_body": f0[:-1] + bytes([f0[-1] ^ 1]) + t0,
        "flip_tag": f0 + t0[:-1] + bytes([t0[-1] ^ 1]),
        "swap": f1 + t1 + f0 + t0,  # each tag is valid, but for another position
        "replay": f0 + t0 + f0 + t0,
        "no_tag": f0 + f1 + t1,
    }[attack]
    got: list[object] = []
    with pytest.raises(RemoteProtocolError, match="MAC does not verify|not valid msgpack"):
        for msg, _ in inn.feed(stream):
            got.append(msg)
    assert got == ([abort(0)] if attack == "replay" else [])  # only a genuine first frame


def _read_like_the_event_loop(inn: InboundChannel, stream: bytes, seed: int,
                              ) -> tuple[list[object], int]:
    """Hand `stream` to `inn` as `_Inbound` does: reads of random sizes, each written into
    the channel's `read_buffer()` when it offers one, else fed from a scratch buffer.
    Returns the messages and how many bytes went in directly."""
    rng = random.Random(seed)
    got: list[object] = []
    pos = direct = 0
    while pos < len(stream):
        size = rng.choice([1, 7, 100, 5000, 70_000, 1 << 20])
        buf = inn.read_buffer()
        if buf is not None:
            n = min(size, len(buf), len(stream) - pos)
            buf[:n] = stream[pos:pos + n]
            inn.filled(n)
            direct += n
        else:
            n = min(size, len(stream) - pos)
            got += [m for m, _ in inn.feed(memoryview(stream)[pos:pos + n])]
        pos += n
    return got, direct


def _contribution(chunk: int, payload: bytes) -> Contribution:
    return Contribution(run_id=RUN, fragment=1, round=0, sender=1, owner=0, chunk=chunk,
                        n_chunks=8, offset=0, numel=len(payload) // 4, codec="float32",
                        block_size=1, weight=1.0, payload=payload)


@pytest.mark.parametrize("seed", range(6))
def test_frames_read_straight_into_their_bodies_are_authenticated(seed: int) -> None:
    inn, sealer = connected()
    msgs: list[Abort | Contribution] = [
        _contribution(0, os.urandom(200_000)), abort(1), _contribution(1, os.urandom(65_536)),
        _contribution(2, os.urandom(4_000)), _contribution(3, os.urandom(300_004))]
    frames = [encode_frame(m) for m in msgs]
    stream = b"".join(f + sealer.seal(f) for f in frames)
    got, direct = _read_like_the_event_loop(inn, stream, seed)
    assert got == msgs
    assert isinstance(got[0], Contribution) and isinstance(got[0].payload, memoryview)
    assert direct > 0



def test_a_body_changed_on_the_direct_path_fails_its_tag() -> None:
    inn, sealer = connected()
    f = encode_frame(_contribution(0, bytes(200_000)))
    tampered = bytearray(f + sealer.seal(f))
    tampered[150_000] ^= 1
    assert list(inn.feed(tampered[:1000])) == []  # the header and the start of the body
    buf = inn.read_buffer()
    assert buf is not None and len(buf) == len(f) - 1000
    buf[:] = tampered[1000:len(f)]
    inn.filled(len(buf))
    assert inn.read_buffer() is None  # the tag comes by `feed`
    with pytest.raises(RemoteProtocolError, match="MAC does not verify"):
        list(inn.feed(tampered[len(f):]))


def test_session_keys_differ_per_connection() -> None:
    inn1, sealer1 = connected()
    inn2, sealer2 = connected()
    f = encode_frame(abort(0))
    assert sealer1.seal(f) != sealer2.seal(f)
    with pytest.raises(RemoteProtocolError, match="MAC does not verify"):
        list(inn2.feed(f + sealer1.seal(f)))  # a frame recorded on another connection


# ---------------------------------------------------------------------- records


def entry(identity: Identity, **over: object) -> GroupEntry:
    fields = dict(peer_id=identity.peer_id, run_id=RUN, data_addr="127.0.0.1:4000",
                  bandwidth_mbps=10.0, fragment=0, round=3, attempt=0)
    return GroupEntry(**{**fields, **over})


def test_signed_record_round_trip_and_author() -> None:
    raw = encode_record(entry(A), creds(A))
    assert decode_record(GroupEntry, raw, creds(B)) == entry(A)
    assert open_record(creds(C), raw)[1] == A.peer_id


def test_record_naming_another_peer_is_refused() -> None:
    forged = seal_record(creds(C), msgpack.packb(entry(A).model_dump(), use_bin_type=True))
    with pytest.raises(AuthError, match=f"names peer {A.peer_id} but is signed by {C.peer_id}"):
        decode_record(GroupEntry, forged, creds(B))
    with pytest.raises(ValueError, match="cannot be signed by"):
        encode_record(entry(A), creds(C))


def test_record_under_a_wrong_secret_or_outside_the_allowlist_is_refused() -> None:
    raw = encode_record(entry(A), creds(A, b"y" * 16))
    with pytest.raises(AuthError, match="wrong swarm secret or forged"):
        decode_record(GroupEntry, raw, creds(B))
    raw = encode_record(entry(A), creds(A))
    with pytest.raises(AuthError, match="not in the allowlist"):
        decode_record(GroupEntry, raw, creds(B, allowed=frozenset({B.peer_id})))


def test_tampered_or_unsigned_record_is_refused() -> None:
    env = msgpack.unpackb(encode_record(entry(A), creds(A)))
    env["record"] = msgpack.packb(entry(A, data_addr="10.0.0.1:1").model_dump())
    with pytest.raises(AuthError, match="bad signature"):
        decode_record(GroupEntry, msgpack.packb(env, use_bin_type=True), creds(B))
    bare = msgpack.packb(entry(A).model_dump(), use_bin_type=True)
    with pytest.raises(AuthError, match="not a signed record"):
        decode_record(GroupEntry, bare, creds(B))


# ---------------------------------------------------------------------- config


def test_auth_config_resolves_the_allowlist_and_names_bad_fields() -> None:
    from dilonode.config import ConfigError, load_config

    key = base64.b64encode(B.public_key).decode()
    cfg = load_config(None, {"auth": {"allowed_peers": [A.peer_id, key]}})
    assert cfg.auth.allowed() == frozenset({A.peer_id, B.peer_id})
    assert load_config().auth.allowed() is None
    with pytest.raises(ConfigError, match="auth.allowed_peers: allowlist entry 'nope'"):
        load_config(None, {"auth": {"allowed_peers": ["nope"]}})
    with pytest.raises(ConfigError, match="either auth.secret_file or auth.secret_env"):
        load_config(None, {"auth": {"secret_file": "s", "secret_env": "S"}})


def test_identity_command_prints_what_the_allowlist_takes(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    import json

    from dilonode.cli.main import main

    path = tmp_path / "node.key"
    assert main(["identity", str(path)]) == 2
    assert "--create" in capsys.readouterr().err
    assert main(["identity", str(path), "--create"]) == 0
    shown = json.loads(capsys.readouterr().out)
    ident = Identity.load(path)
    assert shown["peer_id"] == ident.peer_id
    assert allowed_peer_id(shown["public_key"]) == ident.peer_id
