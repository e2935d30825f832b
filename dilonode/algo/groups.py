"""Bounded groups: which peers average one fragment round together once a swarm is larger
than `network.max_group_size`, derived by every node from what it reads.

The rule for round r of fragment p, among n live peers, groups of at most M:

* **Keys.** `num_keys(n, M)` matchmaking keys: 1 while n < 4M, else the largest power of
  two not above n / 2M, so each key collects 2M..4M registrations on average and a node
  reads only its own key (what it reads does not grow with the swarm). Powers of two make
  nodes whose counts differ by a few (a peer record not seen yet, one expired early) agree
  on K except right at a boundary, and `key_index` is `h mod K`: a node that counts K and
  one that counts 2K still agree on the key of half of the peers.
* **Key index.** `key_index(run, p, r, peer, K) = h(run, p, r, peer) mod K`: a fresh,
  independent assignment every round, so who averages with whom rotates and every node's
  state mixes with every other's over successive rounds (each round averages random
  groups of about M: the spread of the replicas shrinks by about sqrt(M) per round).
* **Split.** The leader of a key that collected s > M registrations splits them into
  `ceil(s / M)` groups (`split_members`): sorted by a second per-round hash and dealt
  round-robin, so sizes differ by at most one and none exceeds M. Every member derives the
  same split from the roster the leader publishes.

With n <= M there is one key (index 0, the key of an ungrouped swarm's rounds) and no
split: a single group of everyone. `mixes(round, every)` says which rounds also
average the members' outer states (`algo/mixing.py`); every member derives it from the
round number. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import blake3

__all__ = ["group_of", "grouped", "key_index", "mixes", "num_keys", "partition",
           "split_members"]

# Keys hold this many groups' worth of registrations on average (2M..4M entries): larger
# keys split into better balanced groups, smaller ones make each node read less.
_KEY_GROUPS = 2


def _hash(*parts: object) -> int:
    text = "\n".join(str(p) for p in parts)
    return int.from_bytes(blake3.blake3(text.encode()).digest()[:8], "big")


def grouped(n: int, max_group_size: int) -> bool:
    """Whether a swarm of `n` live peers averages in bounded groups (more than M peers)."""
    return n > max_group_size


def num_keys(n: int, max_group_size: int) -> int:
    """Matchmaking keys for a swarm of `n` live peers (module docstring): 1 below 4M,
    else the largest power of two <= n / 2M."""
    if max_group_size < 2:
        raise ValueError(f"num_keys: max_group_size={max_group_size}: need >= 2")
    per_key = _KEY_GROUPS * max_group_size
    if n < 2 * per_key:
        return 1
    return 1 << int(math.floor(math.log2(n / per_key)))


def key_index(run_id: str, fragment: int, round_no: int, peer_id: str, keys: int) -> int:
    """The key a peer registers under in round (fragment, round_no): 0 when keys == 1."""
    if keys < 1:
        raise ValueError(f"key_index: keys={keys}: need >= 1")
    if keys == 1:
        return 0
    return _hash("dilonode-key", run_id, fragment, round_no, peer_id) % keys


def split_members(members: Sequence[str], max_group_size: int, run_id: str, fragment: int,
                  round_no: int) -> list[tuple[str, ...]]:
    """The groups a key's registrations form: one group of all of them (sorted) when there
    are at most M, else ceil(s / M) balanced groups dealt round-robin in per-round hash
    order; each group is sorted (member order of the round)."""
    ordered = sorted(set(members))
    if len(ordered) <= max_group_size:
        return [tuple(ordered)] if ordered else []
    count = -(-len(ordered) // max_group_size)
    by_hash = sorted(ordered, key=lambda p: (_hash("dilonode-split", run_id, fragment,
                                                   round_no, p), p))
    return [tuple(sorted(by_hash[i::count])) for i in range(count)]


def group_of(peer_id: str, members: Sequence[str], max_group_size: int, run_id: str,
             fragment: int, round_no: int) -> tuple[str, ...]:
    """The group of `split_members` that holds `peer_id` (ValueError if none does)."""
    for group in split_members(members, max_group_size, run_id, fragment, round_no):
        if peer_id in group:
            return group
    raise ValueError(f"group_of: {peer_id} is not among the {len(members)} members")


def partition(peers: Iterable[str], max_group_size: int, run_id: str, fragment: int,
              round_no: int, keys: int | None = None) -> list[tuple[str, ...]]:
    """Every group of round (fragment, round_no) when all nodes read the same live set
    `peers` (the simulator's view, and what the daemon converges to): keys from the count
    (or `keys`), each key split. Groups are listed by key, then as split."""
    peers = sorted(set(peers))
    k = num_keys(len(peers), max_group_size) if keys is None else keys
    by_key: dict[int, list[str]] = {}
    for p in peers:
        by_key.setdefault(key_index(run_id, fragment, round_no, p, k), []).append(p)
    return [g for idx in sorted(by_key)
            for g in split_members(by_key[idx], max_group_size, run_id, fragment, round_no)]


def mixes(round_no: int, every: int) -> bool:
    """Whether round `round_no` also averages the members' outer states (grouped swarms):
    every `every`-th round of a fragment, counting from round 0; 0 never."""
    if every < 0:
        raise ValueError(f"mixes: every={every}: need >= 0")
    return every > 0 and round_no % every == 0
