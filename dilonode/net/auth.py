"""Who a peer is and whether it may take part: libp2p identities, the swarm credential, and
the signatures and MACs that bind records and connections to them.

Pure computation (no sockets, no hivemind import), used by the data plane's handshake
(`dilonode.net.channel`) and by DHT records (`dilonode.swarm.records`).

* `Identity`: a node's libp2p private key, read from (or written to) the file hivemind's
  `identity_path` uses: a libp2p `PrivateKey` protobuf holding an RSA key (DER, PKCS#1),
  which is what hivemind 1.1.12 writes. `identity.peer_id` is the libp2p peer id (base58
  sha2-256 multihash of the `PublicKey` protobuf), the same string the DHT reports.
* `peer_id_of(public_key)`: the peer id a public key (libp2p `PublicKey` protobuf) stands for;
  `verify(public_key, message, signature)` checks an RSA PKCS#1 v1.5 SHA-256 signature.
* `Credentials`: this node's identity plus the run's policy: the swarm secret (empty: none)
  and the allowlist of peer ids (None: anyone who proves an identity). Every signed or
  MACed message is domain-separated and bound to the run id and, through
  `Credentials.secret_key`, to the secret.
* `seal_record` / `open_record`: the signed envelope of a DHT record.
* `peer_id_of_ssh_key`: the peer id of an RSA key in the OpenSSH form hivemind's
  `RSASignatureValidator` writes into `[owner:...]` subkey markers (`dilonode.swarm.dht`).

Usage::

    creds = Credentials(Identity.load_or_create(path), run_id, secret=b"...",
                        allowed=frozenset({"QmA...", "QmB..."}))
    raw = seal_record(creds, record_bytes)                  # publish raw
    record_bytes, peer_id = open_record(creds, raw)         # AuthError if not acceptable
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

__all__ = [
    "MAX_PUBLIC_KEY_BYTES",
    "MAX_SIGNATURE_BYTES",
    "MIN_SECRET_BYTES",
    "AuthError",
    "Credentials",
    "Identity",
    "allowed_peer_id",
    "load_secret",
    "open_record",
    "peer_id_of",
    "peer_id_of_ssh_key",
    "seal_record",
    "swarm_key",
    "verify",
]

# Bounds on what a peer may hand us to parse: RSA up to 4096 bits (verify cost grows with
# the modulus; go-libp2p's own cap is 8192, hivemind writes 2048).
MAX_PUBLIC_KEY_BYTES = 1024
MAX_SIGNATURE_BYTES = 512
_MIN_RSA_BITS, _MAX_RSA_BITS = 2048, 4096
MIN_SECRET_BYTES = 16
_KEY_TYPE_RSA = 0  # libp2p crypto.proto KeyType
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_RECORD_DOMAIN = b"dilonode/v3/record\0"
_RECORD_KEYS = ("record", "public_key", "signature")


class AuthError(ValueError):
    """A peer's key, signature, MAC or identity is not acceptable; `str()` is one line."""


# ---------------------------------------------------------------------- encodings


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key_proto(key_type: int, data: bytes) -> bytes:
    """libp2p crypto.proto `PublicKey`/`PrivateKey`: field 1 = type (varint), 2 = data."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def _parse_key_proto(raw: bytes, what: str) -> tuple[int, bytes]:
    """(key_type, data) of a libp2p key protobuf, exactly fields 1 and 2 in canonical order."""
    def varint(pos: int) -> tuple[int, int]:
        value = shift = 0
        while pos < len(raw) and shift < 64:
            byte = raw[pos]
            value |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                return value, pos
        raise AuthError(f"{what}: truncated varint")

    if len(raw) < 4 or raw[0] != 0x08:
        raise AuthError(f"{what}: not a libp2p key protobuf")
    key_type, pos = varint(1)
    if pos >= len(raw) or raw[pos] != 0x12:
        raise AuthError(f"{what}: not a libp2p key protobuf")
    length, pos = varint(pos + 1)
    if pos + length != len(raw):
        raise AuthError(f"{what}: key data is {len(raw) - pos} bytes, header says {length}")
    return key_type, raw[pos:]


def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        digit = _B58.find(ch)
        if digit < 0:
            raise ValueError(f"{ch!r} is not a base58 character")
        n = n * 58 + digit
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id of a `PublicKey` protobuf: base58 of its multihash.

    Keys up to 42 bytes use the identity multihash (Ed25519); longer ones sha2-256, as
    go-libp2p and hivemind's `PeerID.from_identity` do.
    """
    if len(public_key) <= 42:
        return _b58encode(b"\x00" + _varint(len(public_key)) + public_key)
    return _b58encode(b"\x12\x20" + hashlib.sha256(public_key).digest())


def _is_peer_id(text: str) -> bool:
    try:
        raw = _b58decode(text)
    except ValueError:
        return False
    if raw[:2] == b"\x12\x20":
        return len(raw) == 34
    return raw[:1] == b"\x00" and len(raw) >= 2 and raw[1] == len(raw) - 2


def allowed_peer_id(entry: str) -> str:
    """An allowlist entry as a peer id: a base58 peer id as is, or a base64 libp2p public key
    (its peer id). ValueError naming the entry otherwise."""
    entry = entry.strip()
    if _is_peer_id(entry):
        return entry
    try:
        public_key = base64.b64decode(entry, validate=True)
        _load_public_key(public_key)
    except (binascii.Error, AuthError) as exc:
        raise ValueError(f"allowlist entry {entry[:60]!r} is neither a libp2p peer id nor a "
                         f"base64 libp2p public key ({exc})") from None
    return peer_id_of(public_key)


# ---------------------------------------------------------------------- keys

_PKCS1 = padding.PKCS1v15()


@functools.lru_cache(maxsize=4096)
def _load_public_key(public_key: bytes) -> rsa.RSAPublicKey:
    """Parse and bound a peer's RSA public key (cached: the same peers sign again and again)."""
    if len(public_key) > MAX_PUBLIC_KEY_BYTES:
        raise AuthError(f"public key is {len(public_key)} bytes > {MAX_PUBLIC_KEY_BYTES}")
    key_type, der = _parse_key_proto(public_key, "public key")
    if key_type != _KEY_TYPE_RSA:
        raise AuthError(f"public key type {key_type} is not RSA (0)")
    try:
        key = serialization.load_der_public_key(der)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise AuthError(f"public key is not a DER RSA key ({type(exc).__name__})") from None
    return _checked_rsa(key, "public key")


def _checked_rsa(key: object, what: str) -> rsa.RSAPublicKey:
    """`key` if it is an RSA public key within the sizes we accept, else AuthError."""
    if not isinstance(key, rsa.RSAPublicKey):
        raise AuthError(f"{what} is not an RSA key")
    if not _MIN_RSA_BITS <= key.key_size <= _MAX_RSA_BITS:
        raise AuthError(f"RSA key of {key.key_size} bits (need {_MIN_RSA_BITS}.."
                        f"{_MAX_RSA_BITS})")
    return key


def verify(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Check `signature` (RSA PKCS#1 v1.5, SHA-256) of `message`; AuthError if it is wrong."""
    key = _load_public_key(public_key)
    if len(signature) > MAX_SIGNATURE_BYTES:
        raise AuthError(f"signature is {len(signature)} bytes > {MAX_SIGNATURE_BYTES}")
    try:
        key.verify(signature, message, _PKCS1, hashes.SHA256())
    except InvalidSignature:
        raise AuthError("bad signature") from None


@functools.lru_cache(maxsize=4096)
def peer_id_of_ssh_key(ssh_key: bytes) -> str:
    """The libp2p peer id of an RSA public key in OpenSSH form (`ssh-rsa <base64>`).

    Only the canonical form is accepted (no comment, exactly what `Identity.ssh_public_key`
    writes), so a key has one encoding and an owner-protected subkey one spelling.
    AuthError when it is not such a key, or outside the RSA sizes we accept.
    """
    if len(ssh_key) > 2 * MAX_PUBLIC_KEY_BYTES:
        raise AuthError(f"OpenSSH key is {len(ssh_key)} bytes > {2 * MAX_PUBLIC_KEY_BYTES}")
    try:
        loaded = serialization.load_ssh_public_key(ssh_key)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise AuthError(f"not an OpenSSH public key ({type(exc).__name__})") from None
    key = _checked_rsa(loaded, "OpenSSH key")
    if _ssh_bytes(key) != ssh_key:
        raise AuthError("OpenSSH key is not in canonical form")
    der = key.public_bytes(serialization.Encoding.DER,
                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return peer_id_of(_key_proto(_KEY_TYPE_RSA, der))


def _ssh_bytes(key: rsa.RSAPublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


class Identity:
    """A node's libp2p RSA private key; `peer_id` and `public_key` derive from it."""

    def __init__(self, key: rsa.RSAPrivateKey) -> None:
        self._key = key
        der = key.public_key().public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
        self.public_key = _key_proto(_KEY_TYPE_RSA, der)
        self.peer_id = peer_id_of(self.public_key)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"  # never the key material

    @classmethod
    def generate(cls, bits: int = 2048) -> Identity:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=bits))

    @classmethod
    def from_bytes(cls, raw: bytes, source: str = "identity") -> Identity:
        """Parse the bytes of a libp2p identity file (hivemind's format)."""
        try:
            key_type, der = _parse_key_proto(raw, source)
            if key_type != _KEY_TYPE_RSA:
                raise AuthError(f"{source}: key type {key_type} is not RSA (0), the type "
                                "hivemind writes")
            key = serialization.load_der_private_key(der, password=None)
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise AuthError(f"{source}: not a libp2p RSA private key ({exc})") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise AuthError(f"{source}: not an RSA private key")
        return cls(key)

    def to_bytes(self) -> bytes:
        """The identity file's bytes: libp2p `PrivateKey` protobuf with a PKCS#1 DER key."""
        der = self._key.private_bytes(serialization.Encoding.DER,
                                      serialization.PrivateFormat.TraditionalOpenSSL,
                                      serialization.NoEncryption())
        return _key_proto(_KEY_TYPE_RSA, der)

    @classmethod
    def load(cls, path: Path) -> Identity:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise AuthError(f"identity {path}: {exc.strerror or exc}") from None
        return cls.from_bytes(raw, f"identity {path}")

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """Read `path`, or write a new key there (mode 0400, like hivemind) if it is missing."""
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_bytes())
        return identity

    def sign(self, message: bytes) -> bytes:
        """RSA PKCS#1 v1.5 SHA-256 (deterministic, libp2p's scheme for RSA keys)."""
        return self._key.sign(message, _PKCS1, hashes.SHA256())

    @property
    def ssh_public_key(self) -> bytes:
        """The public key in OpenSSH form, as hivemind's `RSAPublicKey.to_bytes` writes it."""
        return _ssh_bytes(self._key.public_key())

    @property
    def rsa_key(self) -> rsa.RSAPrivateKey:
        """The private key itself, for hivemind's record validator (signs DHT stores)."""
        return self._key


# ---------------------------------------------------------------------- policy


def load_secret(secret_file: Path | None, secret_env: str | None,
                environ: Mapping[str, str]) -> bytes:
    """The swarm secret from a file or an environment variable (b"" when neither is set).

    Surrounding whitespace is stripped. ValueError (one line, never the secret itself) when
    the source is missing or the secret is shorter than MIN_SECRET_BYTES.
    """
    if secret_file is not None:
        try:
            secret, source = secret_file.read_bytes().strip(), f"auth.secret_file {secret_file}"
        except OSError as exc:
            raise ValueError(f"auth.secret_file {secret_file}: {exc.strerror or exc}") from None
    elif secret_env is not None:
        if secret_env not in environ:
            raise ValueError(f"auth.secret_env: environment variable {secret_env} is not set")
        secret, source = environ[secret_env].strip().encode(), f"auth.secret_env {secret_env}"
    else:
        return b""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source}: the swarm secret is {len(secret)} bytes, need at least "
                         f"{MIN_SECRET_BYTES}")
    return secret


def swarm_key(run_id: str, secret: bytes) -> bytes:
    """The key every MAC of a run is made with: HMAC-SHA256 keyed by the swarm secret (empty
    when the run has none) over the run id."""
    return hmac.digest(secret, b"dilonode/v3/swarm-secret\0" + run_id.encode(), "sha256")


@dataclass(frozen=True)
class Credentials:
    """This node's identity and the run's admission policy.

    `secret` empty means no swarm secret; `allowed` None means no allowlist. With neither the
    run is open, but every peer still proves the identity it claims.
    """

    identity: Identity
    run_id: str
    secret: bytes = field(default=b"", repr=False)
    allowed: frozenset[str] | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @functools.cached_property
    def secret_key(self) -> bytes:
        """`swarm_key(run_id, secret)`: binds MACs and signatures to the run and secret."""
        return swarm_key(self.run_id, self.secret)

    def admit(self, peer_id: str) -> None:
        """AuthError unless the allowlist (if any) holds `peer_id`."""
        if self.allowed is not None and peer_id not in self.allowed:
            raise AuthError(f"peer {peer_id} is not in the allowlist")

    def check_identity(self, peer_id: str, public_key: bytes) -> None:
        """AuthError unless `public_key` stands for `peer_id` and that peer is admitted."""
        if peer_id_of(public_key) != peer_id:
            raise AuthError(f"public key does not belong to peer {peer_id[:64]}")
        self.admit(peer_id)


# ---------------------------------------------------------------------- records


def _record_message(creds: Credentials, record: bytes) -> bytes:
    return _RECORD_DOMAIN + creds.secret_key + record


def seal_record(creds: Credentials, record: bytes) -> bytes:
    """Envelope msgpack {record, public_key, signature}; the signature covers the domain,
    the secret-bound run key and the record bytes."""
    signature = creds.identity.sign(_record_message(creds, record))
    return msgpack.packb({"record": record, "public_key": creds.identity.public_key,
                          "signature": signature}, use_bin_type=True)


def open_record(creds: Credentials, raw: bytes) -> tuple[bytes, str]:
    """(record bytes, author peer id) of a sealed record; AuthError when the envelope is
    malformed, the signature does not verify under this run and secret, or the author is
    not admitted. The caller still checks that the record names its author."""
    try:
        env = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise AuthError(f"not a signed record: not msgpack ({type(exc).__name__})") from None
    if (not isinstance(env, dict) or tuple(sorted(env)) != tuple(sorted(_RECORD_KEYS))
            or not all(isinstance(env[k], bytes) for k in _RECORD_KEYS)):
        raise AuthError("not a signed record (expected a map of record, public_key, "
                        "signature bytes)")
    public_key: bytes = env["public_key"]
    author = peer_id_of(public_key)
    creds.admit(author)
    try:
        verify(public_key, _record_message(creds, env["record"]), env["signature"])
    except AuthError as exc:
        raise AuthError(f"record of {author}: {exc} (wrong swarm secret or forged)") from None
    return env["record"], author
