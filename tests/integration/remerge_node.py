"""One DHT-only node for the re-merge tests: a SwarmDHT with its peer record heartbeat
(`Membership`) and, when asked, a `Remerger`; no trainer, no data plane. Prints one JSON
line on stdout whenever the set of live peer records it reads changes.

    python -m tests.integration.remerge_node RUN_ID HOST PEER_TTL REMERGE(0|1) MADDR...

Runs until SIGTERM. (Not until stdin closes: a thread blocked reading stdin when the DHT
process forks deadlocks the child, which closes its copy of stdin first.)
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from dilonode.config import NetworkConfig, SuperviseConfig
from dilonode.swarm.dht import SwarmDHT
from dilonode.swarm.membership import Membership
from dilonode.swarm.remerge import Remerger


def main(argv: list[str]) -> None:
    run_id, host, ttl, remerge = argv[0], argv[1], float(argv[2]), argv[3] == "1"
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = SwarmDHT(run_id, argv[4:], host=host, op_timeout=5.0).start()
    net = NetworkConfig(host=host, peer_ttl=ttl)
    member = Membership(dht, run_id, net, f"{host}:1")
    member.start()
    merger = Remerger(dht, SuperviseConfig(remerge_backoff_max=4.0), interval=1.0)
    if remerge:
        merger.start()
    print(json.dumps({"event": "ready", "peer_id": dht.peer_id}), flush=True)
    seen: list[str] | None = None
    try:
        while not stop.wait(0.5):
            try:
                live = sorted(r.peer_id for r in member.live_peers())
            except Exception:  # a read that timed out during the partition: try again
                continue
            if live != seen:
                seen = live
                print(json.dumps({"event": "peers", "t": time.time(), "peers": live}),
                      flush=True)
    finally:
        merger.close()
        member.close()
        dht.close()


if __name__ == "__main__":
    main(sys.argv[1:])
