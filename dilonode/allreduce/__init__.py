"""Butterfly all-reduce of one pseudo-gradient fragment among a group of peers.

`round` holds the sans-IO state machine (`AllReduceRound`), `memnet` an in-memory network
with fault injection that runs several rounds against each other in tests, `transport` the
asyncio TCP data plane and `driver` the glue (one round, retries, the `NetworkCollective`).
The asyncio modules are not imported here, so the sans-IO core stays import-light.
"""

from dilonode.allreduce.memnet import Corruption, Faults, MemNet
from dilonode.allreduce.round import (
    Action,
    AllReduceRound,
    Done,
    Failed,
    GroupSpec,
    RoundFailure,
    RoundState,
    Send,
    tensor_digest,
)

__all__ = [
    "Action",
    "AllReduceRound",
    "Corruption",
    "Done",
    "Failed",
    "Faults",
    "GroupSpec",
    "MemNet",
    "RoundFailure",
    "RoundState",
    "Send",
    "tensor_digest",
]
