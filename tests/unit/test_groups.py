"""The grouping rule (algo/groups.py) and the state-mixing arithmetic (algo/mixing.py):
bounded, deterministic, rotating groups; a single group with at most M peers;
mixing the pre-step states of a group is mixing its post-step states (the outer step is
linear)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dilonode.algo.groups import (
    grouped,
    key_index,
    mixes,
    num_keys,
    partition,
    split_members,
)
from dilonode.algo.mixing import mixed_chain, pack_state, spread, unpack_state
from dilonode.algo.outer import OuterState

RUN = "groups-unit"


def _peers(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Qm{rng.getrandbits(64):016x}" for _ in range(n)]


@pytest.mark.parametrize("m", [2, 3, 4, 8, 16])
def test_groups_are_bounded_and_cover_every_peer_once(m: int) -> None:
    for n in [1, 2, m - 1, m, m + 1, 2 * m, 4 * m - 1, 4 * m, 5 * m + 3, 300, 1000]:
        if n < 1:
            continue
        peers = _peers(n, seed=n)
        for r in range(3):
            groups = partition(peers, m, RUN, 1, r)
            assert all(1 <= len(g) <= m for g in groups), (n, m, [len(g) for g in groups])
            flat = [p for g in groups for p in g]
            assert sorted(flat) == sorted(peers)


def test_at_most_m_peers_form_one_group_under_key_zero_as_before() -> None:
    for n in range(1, 17):
        peers = _peers(n)
        assert num_keys(n, 16) == 1 and not grouped(n, 16)
        assert all(key_index(RUN, 0, r, p, 1) == 0 for p in peers for r in range(5))
        assert partition(peers, 16, RUN, 0, 7) == [tuple(sorted(peers))]


def test_the_rule_is_deterministic_and_ignores_the_order_peers_are_read_in() -> None:
    peers = _peers(200)
    shuffled = list(reversed(peers))
    assert partition(peers, 8, RUN, 2, 11) == partition(shuffled, 8, RUN, 2, 11)
    assert split_members(peers[:40], 8, RUN, 2, 11) == split_members(shuffled[-40:], 8, RUN,
                                                                      2, 11)


def test_keys_are_powers_of_two_holding_two_to_four_groups_of_registrations() -> None:
    m = 16
    last = 1
    for n in range(1, 5000, 7):
        k = num_keys(n, m)
        assert k & (k - 1) == 0 and k >= last  # a power of two, never fewer for more peers
        last = k
        if k > 1:
            assert 2 * m <= n / k < 4 * m, (n, k)


def test_a_node_counting_twice_the_keys_agrees_on_half_of_the_peers() -> None:
    """h mod 2K reduces to h mod K: near a boundary, nodes whose counts differ still meet."""
    for p in _peers(300):
        for k in (2, 4, 8, 32):
            assert key_index(RUN, 0, 3, p, 2 * k) % k == key_index(RUN, 0, 3, p, k)


def test_a_split_is_balanced() -> None:
    for s in range(17, 100):
        sizes = [len(g) for g in split_members(_peers(s, seed=s), 16, RUN, 0, 1)]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 16
        assert len(sizes) == math.ceil(s / 16)


def test_groups_rotate_so_the_swarm_mixes_in_about_log_n_rounds() -> None:
    """Scalar values averaged within each round's groups: within 1% of the mean after
    log2(N) rounds (and the co-membership graph connects everyone long before)."""
    n, m = 512, 16
    peers = _peers(n)
    rng = random.Random(1)
    value = {p: 1.0 + rng.uniform(-1.0, 1.0) for p in peers}  # spread ~ 58% of the mean
    mean = sum(value.values()) / n
    rounds = int(math.log2(n))
    for r in range(rounds):
        groups = partition(peers, m, RUN, 0, r)
        assert len(groups) > 1
        for g in groups:
            avg = sum(value[p] for p in g) / len(g)
            for p in g:
                value[p] = avg
    worst = max(abs(v - mean) for v in value.values()) / abs(mean)
    assert worst < 0.01, worst
    assert abs(sum(value.values()) / n - mean) < 1e-9  # averaging keeps the mean


def test_groups_differ_from_round_to_round() -> None:
    peers = _peers(256)
    a, b = partition(peers, 16, RUN, 0, 4), partition(peers, 16, RUN, 0, 5)
    pair_a = {frozenset(g) for g in a}
    assert not pair_a & {frozenset(g) for g in b}
    assert partition(peers, 16, RUN, 1, 4) != a  # fragments rotate independently


def test_mixing_rounds_follow_the_round_number() -> None:
    assert [mixes(r, 1) for r in range(4)] == [True] * 4
    assert [mixes(r, 3) for r in range(7)] == [True, False, False, True, False, False, True]
    assert not any(mixes(r, 0) for r in range(5))
    with pytest.raises(ValueError):
        mixes(0, -1)
    with pytest.raises(ValueError):
        num_keys(10, 1)


def test_stepping_the_mean_state_is_the_mean_of_the_stepped_states() -> None:
    """The outer step is linear in (g, m, d): a group that averages its states before the
    step ends where averaging after it would, and every member holds the same state."""
    torch.manual_seed(0)
    numel, members = 1000, 5
    states = []
    for _ in range(members):
        st = OuterState(torch.randn(numel), lr=0.7, momentum=0.9)
        st.momentum_buf.copy_(torch.randn(numel) * 0.1)
        states.append(st)
    d = torch.randn(numel) * 0.01  # the group's averaged pseudo-gradient
    after = []
    for st in states:
        alone = OuterState(st.weights, 0.7, 0.9)
        alone.momentum_buf.copy_(st.momentum_buf)
        after.append(pack_state(alone.step(d), alone.momentum_buf))
    packed = torch.stack([pack_state(s.weights, s.momentum_buf) for s in states]).mean(0)
    mixed = OuterState(torch.zeros(numel), 0.7, 0.9)
    g, m = unpack_state(packed)
    mixed.weights.copy_(g)
    mixed.momentum_buf.copy_(m)
    mixed.step(d)
    want = torch.stack(after).mean(0)
    torch.testing.assert_close(pack_state(mixed.weights, mixed.momentum_buf), want,
                               atol=1e-6, rtol=1e-6)


def test_pack_unpack_and_spread() -> None:
    g, m = torch.arange(4.0), torch.ones(4)
    flat = pack_state(g, m)
    assert flat.shape == (8,)
    g2, m2 = unpack_state(flat)
    assert torch.equal(g2, g) and torch.equal(m2, m)
    with pytest.raises(ValueError):
        unpack_state(torch.zeros(3))
    with pytest.raises(ValueError):
        pack_state(torch.zeros(2), torch.zeros(3))
    assert spread([flat, flat.clone()]) == (0.0, 0.0)
    worst, avg = spread([torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0])])
    assert worst == pytest.approx(0.5) and avg == pytest.approx(0.5)


def test_mixed_chain_names_the_mixed_state() -> None:
    a, b = mixed_chain("ab" * 32), mixed_chain("cd" * 32)
    assert a != b and len(a) == 32 and a == mixed_chain("ab" * 32)
