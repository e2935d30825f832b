"""Matchmaking in a grouped swarm, over the in-memory board: a key with more registrations
than `max_group_size` is split by its one leader into bounded groups every member derives
alike; chains that differ leave nobody out; a swarm of at most M is one group."""

from __future__ import annotations

import concurrent.futures

from dilonode.algo.groups import key_index, num_keys, split_members
from dilonode.net.auth import Credentials, Identity
from dilonode.swarm.matchmaking import Group, form_group
from dilonode.swarm.records import GroupEntry, group_key
from tests.boards import Board, View

RUN = "mm-groups"
SETTINGS = {"codec": "int4", "block_size": 64, "max_group_size": 3}
IDS = sorted((Identity.generate() for _ in range(7)), key=lambda i: i.peer_id)


def _entry(identity: Identity, **over: object) -> GroupEntry:
    fields: dict[str, object] = dict(
        peer_id=identity.peer_id, run_id=RUN, data_addr=f"127.0.0.1:{7100 + IDS.index(identity)}",
        fragment=0, round=9, attempt=0, bandwidth_mbps=10.0, settings=SETTINGS,
        chain=f"{IDS.index(identity):032x}")  # every replica holds its own state
    return GroupEntry(**{**fields, **over})  # type: ignore[arg-type]


def _form_all(ids: list[Identity], grouped: bool, max_group_size: int | None,
              index: int = 0) -> dict[str, Group]:
    board = Board()
    expected = frozenset(i.peer_id for i in ids)

    def one(identity: Identity) -> Group:
        view = View(board, Credentials(identity, RUN))
        return form_group(view, RUN, 0, 9, 0, _entry(identity, grouped=grouped), 0.5, 5.0,
                          poll_interval=0.02, expected=expected, key_index=index,
                          max_group_size=max_group_size)

    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        futs = {i.peer_id: pool.submit(one, i) for i in ids}
        return {pid: f.result(timeout=30) for pid, f in futs.items()}


def test_a_key_with_more_than_m_entries_splits_into_bounded_mixing_groups() -> None:
    got = _form_all(IDS, grouped=True, max_group_size=3)
    want = split_members([i.peer_id for i in IDS], 3, RUN, 0, 9)
    assert len(want) == 3 and all(len(g) <= 3 for g in want)
    for pid, group in got.items():
        mine = next(g for g in want if pid in g)
        assert group.members == mine and group.members[group.my_index] == pid
        assert group.mixing and not group.diverged and not group.outvoted
    digests = {g.members: g.digest() for g in got.values()}
    assert len(set(digests.values())) == 3  # one round per group, never crossed


def test_ungrouped_entries_beyond_m_are_still_split() -> None:
    """A key collecting more than M entries is grouped even if no registrant knew."""
    got = _form_all(IDS[:5], grouped=False, max_group_size=3)
    assert all(g.mixing and g.size <= 3 for g in got.values())
    assert {len(g.members) for g in got.values()} == {2, 3}


def test_at_most_m_peers_with_different_chains_form_one_group_as_before() -> None:
    """Not grouped: the chain check of today applies (the smallest chain holder leads and
    leaves the others out: here every chain differs, the standing one is the smallest's)."""
    got = _form_all(IDS[:3], grouped=False, max_group_size=3)
    leader = IDS[0].peer_id
    assert got[leader].members == (leader,) and not got[leader].mixing
    assert set(got[leader].outvoted) == {i.peer_id for i in IDS[1:3]}
    for i in IDS[1:3]:
        assert got[i.peer_id].diverged == (leader,)


def test_a_grouped_key_is_its_own_dht_key() -> None:
    assert group_key(RUN, 0, 9, 0) == group_key(RUN, 0, 9, 0, 0)
    assert group_key(RUN, 0, 9, 0, 3) == group_key(RUN, 0, 9, 0) + "/k3"
    got = _form_all(IDS[:4], grouped=True, max_group_size=3, index=5)
    assert all(g.mixing for g in got.values())
    k = num_keys(40, 3)
    assert 0 <= key_index(RUN, 0, 9, IDS[0].peer_id, k) < k


class _FakeDHT:
    peer_id = IDS[0].peer_id
    started = False


def _membership(max_group_size: int):
    from dilonode.config import NetworkConfig
    from dilonode.swarm.membership import Membership

    net = NetworkConfig(max_group_size=max_group_size)
    return Membership(_FakeDHT(), RUN, net, "127.0.0.1:1")  # type: ignore[arg-type]


def test_a_node_waits_only_for_the_peers_its_view_puts_under_its_key() -> None:
    from dilonode.swarm.membership import _Round

    peers = frozenset(f"Qm{i:040d}" for i in range(40))
    small = _membership(64)
    assert small._key_of(0, 9, 0, peers, set()) == (0, False, peers)
    m = _membership(4)
    index, is_grouped, wait = m._key_of(0, 9, 0, peers, set())
    keys = num_keys(41, 4)
    assert is_grouped and keys == 4 and index == key_index(RUN, 0, 9, _FakeDHT.peer_id, keys)
    assert wait == {p for p in peers if key_index(RUN, 0, 9, p, keys) == index}
    # A retry waits only for the last group's members, minus those it leaves out.
    last = frozenset(sorted(wait)[:3])
    m._rounds[0] = _Round(9, None, frozenset(), last)
    _, _, retry = m._key_of(0, 9, 1, peers, {sorted(last)[0]})
    assert retry == last - {sorted(last)[0]}
