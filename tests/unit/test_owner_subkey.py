"""Owner-protected DHT subkeys (dilonode.swarm.dht.owner_subkey / plain_subkey) and the
OpenSSH key form they carry (dilonode.net.auth.peer_id_of_ssh_key). No sockets, no hivemind:
the validator running inside the DHT process is tested in tests/integration/test_dht.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilonode.net.auth import AuthError, Identity, peer_id_of_ssh_key
from dilonode.swarm.dht import owner_subkey, plain_subkey

VICTIM, OTHER = Identity.generate(), Identity.generate()


def _reason(subkey: str) -> str:
    with pytest.raises(AuthError) as info:
        plain_subkey(subkey)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_round_trip() -> None:
    subkey = owner_subkey(VICTIM)
    assert subkey.startswith(VICTIM.peer_id + "[owner:ssh-rsa ")
    assert plain_subkey(subkey) == VICTIM.peer_id
    assert peer_id_of_ssh_key(VICTIM.ssh_public_key) == VICTIM.peer_id


def test_owner_key_of_another_peer_is_refused() -> None:
    forged = f"{VICTIM.peer_id}[owner:{OTHER.ssh_public_key.decode()}]"
    assert "owner key is " + OTHER.peer_id in _reason(forged)


# Ids name the case, not the random key in it, so every collector (e.g. xdist's) sees the
# same tests.
@pytest.mark.parametrize("subkey", [VICTIM.peer_id, "", "[owner:]", VICTIM.peer_id + "[owner"],
                         ids=["bare-peer-id", "empty", "owner-only", "unterminated"])
def test_unprotected_subkey_is_refused(subkey: str) -> None:
    assert "not owner-protected" in _reason(subkey)


def test_second_spelling_of_the_same_key_is_refused() -> None:
    # OpenSSH allows a trailing comment; only the canonical form may stand for the victim,
    # so two stored subkeys can never map to the same plain subkey.
    commented = f"{VICTIM.peer_id}[owner:{VICTIM.ssh_public_key.decode()} me@host]"
    assert "canonical" in _reason(commented)


@pytest.mark.parametrize("key", ["ssh-rsa AAAA", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG"
                                 "pD6Uexhe8s0uqUFpz6QzIaRmoMKgp1PjrhDnFkg2yE", "x" * 3000])
def test_malformed_owner_key_is_refused(key: str) -> None:
    _reason(f"{VICTIM.peer_id}[owner:{key}]")


def test_two_markers_are_refused() -> None:
    marker = f"[owner:{VICTIM.ssh_public_key.decode()}]"
    _reason(VICTIM.peer_id + marker + marker)


@settings(deadline=None, derandomize=True, database=None, max_examples=500)
@given(st.data())
def test_mutated_subkeys_are_rejected_cleanly(data: st.DataObject) -> None:
    # A subkey is peer input (from DHT answers): every edit ends in AuthError, never a crash.
    chars = list(owner_subkey(VICTIM))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, max(len(chars) - 1, 0)))
        op = data.draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        char = data.draw(st.characters(codec="utf-8"))
        if op == "set" and chars:
            chars[pos] = char
        elif op == "insert":
            chars.insert(pos, char)
        elif op == "delete" and chars:
            del chars[pos]
        elif op == "truncate":
            del chars[pos:]
    subkey = "".join(chars)
    try:
        assert plain_subkey(subkey) == VICTIM.peer_id and subkey == owner_subkey(VICTIM)
    except AuthError as exc:
        assert "\n" not in str(exc)
