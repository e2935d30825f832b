"""Join benchmark: how long a new node takes to recover a 100 MB+ outer state (weights and
outer momentum, float32) from 3 training peers on the WAN test bed, against the ideal
(state bytes / the joiner's link rate). Needs root (network namespaces).

    sudo .venv/bin/python -m benchmarks.testbed.join --rates 100 --json runs/bench/join.json
    sudo .venv/bin/python -m benchmarks.testbed.join --rates 10 --codecs int4,int2-rand1.56-ef \
        --replay-rounds 1 --json runs/bench/join-codecs.json

`--codecs` names the peers' codec as wan.py's option does (benchmarks/harness/methods.py),
one run each: the state a joiner fetches (outer weights and momentum) is the same whatever
the rounds sent, and after sparse rounds (`codec.kind = randk`) a joiner fetches fragments
instead of replaying them.

The 3 peers train a 15.4M-parameter model (state 123.5 MB) and the joiner starts once every
fragment has been averaged at least once (before that, chunks of untouched fragments equal
the joiner's own fresh state and would not be fetched). Servers keep the results of the
last `statesync.replay_rounds` rounds, so this early in a run a joiner derives the state
from its own fresh one by replaying every round so far; `--replay-rounds 1` measures
fetching the state itself. `recovery` is what the joiner's state
sync reports: first manifest request to the verified state in memory, including what is
left of its wait after publishing its peer record (it starts publishing ~2 s before the
transfer is expected to end); `transfer` is the part spent fetching chunks, `manifests` the
time spent waiting for manifests between fetches; `spawn to recovered` adds process start
and DHT join.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.args import floats, names
from benchmarks.harness.methods import codec_overrides, diloco_overrides, row
from benchmarks.harness.options import add_tcp_congestion, tcp_congestion
from benchmarks.harness.results import save_rows
from dilonode.config import load_config
from testbed.hosts import swarm_on_testbed, unavailable_reason

MODEL = {"preset": "small", "d_model": 384, "n_heads": 6, "n_layers": 8, "ffn_hidden": 1152}


def run_config(args: argparse.Namespace, rate: float, codec: str = "int4") -> Any:
    r = row(f"s-{codec}-a0.5")
    return load_config(overrides={
        "run_id": f"join-{rate:g}-{codec}".replace(".", "_"), "seed": 0,
        "total_steps": 10**6, "eval_every": 5,
        "device": "cpu", "model": MODEL,
        "data": {"seq_len": 32, "batch_size": 1, "eval_batches": 1},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments, "fragment_sync_delay": 1,
                   **diloco_overrides(r)},
        "codec": codec_overrides(r, 64),
        # A window that outlasts the peers' drift (see benchmarks/testbed/wan.py).
        "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 45.0,
                    "allreduce_timeout": 60.0, "bandwidth_mbps": rate, "peer_ttl": 60.0,
                    **tcp_congestion(args)},
        "statesync": {"request_timeout": 60.0, "recover_timeout": 600.0,
                      **({} if args.replay_rounds is None
                         else {"replay_rounds": args.replay_rounds})},
        "status": {"enabled": False},
        "paths": {"out_dir": str(args.out / f"rate-{rate:g}-{codec}")},
    })


def state_bytes(cfg: Any) -> int:
    """Outer weights plus outer momentum, float32: 8 bytes per trainable parameter."""
    from dilonode.train.model import build_model

    model = build_model(cfg.model, 256)
    return 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def wait_event(swarm: Any, until: Any, deadline: float) -> tuple[str, dict[str, Any]]:
    while (left := deadline - time.monotonic()) > 0:
        try:
            name, ev = swarm.events.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if ev.get("event") == "eof" and name != "bootstrap":
            raise RuntimeError(f"{name} exited early (see its stderr.log)")
        if until(name, ev):
            return name, ev
    raise TimeoutError("join benchmark: event did not come in time")


def run(args: argparse.Namespace, rate: float, codec: str) -> dict[str, Any]:
    cfg = run_config(args, rate, codec)
    frags = {str(p) for p in range(args.fragments)}
    synced: dict[str, set[str]] = {}

    def all_synced(name: str, ev: dict[str, Any]) -> bool:
        if ev.get("event") == "progress":
            synced[name] = {f for f, n in (ev.get("rounds") or {}).items() if n > 0}
        return len(synced) == args.peers and all(s >= frags for s in synced.values())

    deadline = time.monotonic() + args.timeout
    with swarm_on_testbed(cfg, args.peers, rate, hosts=args.peers + 1) as (_bed, swarm):
        swarm.start()
        wait_event(swarm, all_synced, deadline)
        t_spawn = time.monotonic()
        swarm.start_node(args.peers, ["--set", "network.min_peers=1"])
        _, rec = wait_event(swarm, lambda n, ev: n == f"node-{args.peers}"
                            and ev.get("event") == "recovered", deadline)
        spawn_to_recovered = time.monotonic() - t_spawn
    total = state_bytes(cfg)
    ideal = total * 8 / (rate * 1e6)
    return {"rate_mbit": rate, "codec": codec, "state_bytes": total, "fetched_bytes": rec["bytes"],
            "reused_bytes": rec["reused_bytes"], "peers": len(rec["peers"]),
            "bytes_per_peer": sorted(rec["peers"].values()), "seconds": rec["seconds"],
            "fetch_s": rec["fetch_seconds"], "manifest_s": rec.get("manifest_seconds"),
            "publish_wait_s": rec.get("publish_wait_seconds"), "passes": rec.get("passes"),
            "replayed": rec.get("replayed", 0),
            "ideal_s": ideal, "ratio": rec["seconds"] / ideal,
            "fetch_ratio": rec["fetch_seconds"] / ideal, "step": rec["step"],
            "spawn_to_recovered_s": spawn_to_recovered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100", help="Mbit/s per host, comma-separated")
    ap.add_argument("--peers", type=int, default=3, help="nodes serving the state")
    # Rounds that land while the joiner fetches change the state under it (it then fetches
    # those fragments again): H = 90 leaves 30 steps between rounds for the transfer.
    ap.add_argument("--sync-every", type=int, default=90, help="H of the peers' run")
    ap.add_argument("--fragments", type=int, default=3, help="P of the peers' run")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per rate, at most")
    ap.add_argument("--replay-rounds", type=int, help="statesync.replay_rounds of every node "
                    "(default: the config's; 1: a joiner replays at most the last round, so "
                    "it fetches the state itself)")
    ap.add_argument("--codecs", default="int4", help="the peers' codecs, one run each: int4, "
                    "int2-rand1.56-ef (benchmarks/harness/methods.py)")
    add_tcp_congestion(ap)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/join"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (reason := unavailable_reason()) is not None:
        sys.exit(f"join.py: {reason}")
    codecs = names(args.codecs)
    for codec in codecs:
        try:
            row(f"s-{codec}-a0.5")
        except ValueError as e:
            sys.exit(f"join.py: --codecs {codec}: {e}")
    rows = []
    for rate in floats(args.rates):
        for codec in codecs:
            rows.append(run(args, rate, codec))
            print(json.dumps(rows[-1]), flush=True)
    print("| link | codec | state | fetched | reused | from peers (MB each) | recovery (transfer) "
          "| passes (manifests, publish wait) | replayed | ideal "
          "| recovery / ideal (transfer / ideal) | spawn to recovered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        each = ", ".join(f"{b / 1e6:.1f}" for b in r["bytes_per_peer"])
        print(f"| {r['rate_mbit']:g} Mbit/s | {r['codec']} | {r['state_bytes'] / 1e6:.1f} MB "
              f"| {r['fetched_bytes'] / 1e6:.1f} MB | {r['reused_bytes'] / 1e6:.1f} MB "
              f"| {r['peers']} ({each}) | {r['seconds']:.2f} s ({r['fetch_s']:.2f} s) "
              f"| {r['passes']} ({r['manifest_s']:.2f} s, {r['publish_wait_s']:.2f} s) "
              f"| {r['replayed']} | {r['ideal_s']:.2f} s "
              f"| {r['ratio']:.2f}x ({r['fetch_ratio']:.2f}x) "
              f"| {r['spawn_to_recovered_s']:.1f} s |")
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
