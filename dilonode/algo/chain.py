"""A hash chain per fragment over the rounds applied to its outer state: the cheap "digest of
the outer state" that peers compare before averaging together.

A fragment's outer state (weights and momentum) is a function of the run's start (the
config) and of the rounds applied to it: which round, and which averaged result. So two
nodes hold the same outer state for a fragment exactly when they applied the same results
in the same rounds, and a chain `c' = H(c || round || result digest || applied)` names it
for free (no pass over the weights; the result digest is computed by the round anyway).
Nodes that diverged (a lone round, a partition, a refused result) hold different chains,
which matchmaking compares (`swarm/matchmaking.py`) so that the odd ones out adopt the
state that stands before they contribute again (PCCL keeps its peers bit-identical the
same way, by hashing the shared state).
"""

from __future__ import annotations

import blake3

__all__ = ["CHAIN_HEX", "chain_next", "chain_start"]

CHAIN_HEX = 32  # 16 bytes: collisions between honest divergent states are not a concern


def chain_start(config_digest: str, fragment: int) -> str:
    """The chain of a fragment before any round: every node of a run starts equal."""
    text = f"dilonode-chain\n{config_digest}\n{fragment}"
    return blake3.blake3(text.encode()).hexdigest()[:CHAIN_HEX]


def chain_next(chain: str, round_no: int, result_digest: str, applied: bool) -> str:
    """The chain after round `round_no` landed with `result_digest` (the round's digest of
    the decoded result, the same on every member); `applied` False when the outer step
    was refused (non-finite), which leaves the state as it was but still marks the round."""
    text = f"{chain}\n{round_no}\n{result_digest}\n{int(applied)}"
    return blake3.blake3(text.encode()).hexdigest()[:CHAIN_HEX]
