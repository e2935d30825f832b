"""One soak node: DHT + data plane + membership, no trainer. Runs fragment rounds back to
back on deterministic tensors and prints one JSON line per finished round.

    python -m tests.integration.soak_node OUT INDEX ROUNDS FRAGMENTS NUMEL MIN_PEERS MADDR...
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from dilonode.allreduce.network_collective import NetworkCollective
from dilonode.allreduce.retry import RoundPolicy
from dilonode.collective import RoundRequest, SyncKey
from dilonode.config import NetworkConfig
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.membership import Membership

RUN_ID = "soak"


def tensor_for(index: int, fragment: int, round_no: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(index * 1_000_003 + fragment * 10_007 + round_no)
    return torch.randn(numel, generator=gen)


def main(argv: list[str]) -> None:
    out = open(argv[0], "w")  # noqa: SIM115 - one line per round, flushed as we go
    index, rounds, fragments, numel, min_peers = (int(a) for a in argv[1:6])
    torch.set_num_threads(1)
    net = NetworkConfig(matchmaking_window=3.0, matchmaking_timeout=10.0,
                        allreduce_timeout=10.0, max_attempts=3)
    dht = SwarmDHT(RUN_ID, argv[6:]).start()
    policy = RoundPolicy(codec="int4", timeout=net.allreduce_timeout,
                         max_attempts=net.max_attempts)
    member = Membership(dht, RUN_ID, net, settings=policy.settings())
    coll = NetworkCollective(dht.peer_id, RUN_ID, member.form, policy)
    member.attach_data_plane(coll.start(), coll.plane.gone.copy)
    member.start()
    try:
        member.wait_for_peers(min_peers, 120)
        print(json.dumps({"event": "ready", "index": index, "peer_id": dht.peer_id}),
              file=out, flush=True)
        for r in range(rounds):
            pending = [(p, coll.begin(RoundRequest(SyncKey("fragment", p, r)),
                                      tensor_for(index, p, r, numel)))
                       for p in range(fragments)]
            for p, handle in pending:
                res = handle.wait(120)
                digest = hashlib.sha256(res.mean.numpy().tobytes()).hexdigest()
                print(json.dumps({"event": "round", "fragment": p, "round": r,
                                  "members": list(res.report.members),
                                  "skipped": res.report.skipped, "digest": digest,
                                  "dropped": list(res.report.dropped),
                                  "attempts": res.report.attempts}),
                      file=out, flush=True)
    finally:
        member.close()
        coll.close()
        dht.close()


if __name__ == "__main__":
    main(sys.argv[1:])
