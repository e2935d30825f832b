"""NAT benchmark: what the libp2p paths cost against direct TCP, with two real nodes and a
bootstrap on the WAN test bed (testbed/hosts.py), per pair of nodes:

* `direct`: both nodes public: the data plane's TCP connections both ways.
* `one-nat`: node-1 behind a NAT router: node-1 dials node-0 by TCP; node-0 reaches node-1
  by a libp2p stream over the connection node-1's p2pd opened to node-0's (no relay).
* `relayed`: both behind NAT routers: each reaches the other by a libp2p stream through
  the bootstrap's relay (`dilonode.swarm.tunnel.Relay`: the bytes go node -> bootstrap's
  p2pd -> bootstrap's relay process -> its p2pd -> node).
* `unflagged`: both behind NAT routers but told `network.reachable = public`, which is what
  every node did before reachability existed: no relay slots, DHT in server mode.

Every run trains the same steps (Streaming DiLoCo, float32 pseudo-gradients so the rounds
carry the most bytes). Per run: round latency per fragment (start to averaged result,
matchmaking included; mean and max over both nodes, from their summaries), rounds with a
peer and skipped, the data paths each node used, and CPU seconds from /proc, sampled every
0.25 s over each process tree: the node processes (training, data plane, DHT) and their
p2pd, and the bootstrap (its python, where the relay pipes, and its p2pd). The box is
shared, so runs of each kind take turns (--repeats) and the table shows medians.

    sudo .venv/bin/python -m benchmarks.testbed.nat --json runs/bench/nat.json
    sudo .venv/bin/python -m benchmarks.testbed.nat --pairs direct,relayed --rate 50 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.args import chosen
from benchmarks.harness.results import save_rows
from dilonode.config import load_config
from testbed.hosts import swarm_on_testbed, unavailable_reason

PAIRS: dict[str, dict[str, Any]] = {
    "direct": {"nat": [], "extra": []},
    "one-nat": {"nat": ["node-1"], "extra": []},
    "relayed": {"nat": ["node-0", "node-1"], "extra": []},
    "unflagged": {"nat": ["node-0", "node-1"],
                  "extra": ["--set", "network.reachable=public"]},
}
_TICK = os.sysconf("SC_CLK_TCK")


class TreeCpu:
    """CPU seconds of process trees, sampled from /proc in a thread until `stop()`: per
    root pid, split into p2pd and the rest (by command name). A pid's last sample counts,
    so what a process used after its last sample (< one interval) is missed."""

    def __init__(self, interval: float = 0.25) -> None:
        self.roots: dict[int, str] = {}
        self.last: dict[int, tuple[str, str, float]] = {}  # pid -> (root label, comm, cpu s)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeCpu:
        self._thread.start()
        return self

    def watch(self, pid: int, label: str) -> None:
        self.roots[pid] = label

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()
        out: dict[str, dict[str, float]] = {}
        for label, comm, cpu in self.last.values():
            part = "p2pd" if comm == "p2pd" else "python"
            out.setdefault(label, {"python": 0.0, "p2pd": 0.0})[part] += cpu
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        procs: dict[int, tuple[int, str, float]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            comm = raw[raw.index("(") + 1:raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2:].split()
            procs[int(entry)] = (int(fields[1]), comm,
                                 (int(fields[11]) + int(fields[12])) / _TICK)
        for pid, (_, comm, cpu) in procs.items():
            label = self._root_of(pid, procs)
            if label is not None:
                self.last[pid] = (label, comm, cpu)

    def _root_of(self, pid: int, procs: dict[int, tuple[int, str, float]]) -> str | None:
        seen = 0
        while pid > 1 and seen < 64:
            if pid in self.roots:
                return self.roots[pid]
            pid = procs.get(pid, (0, "", 0.0))[0]
            seen += 1
        return None


def run_config(args: argparse.Namespace, pair: str, rep: int) -> Any:
    return load_config(overrides={
        "run_id": f"nat-{pair}-{rep}", "seed": 0, "total_steps": args.steps,
        "eval_every": 10**9, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every,
                   "num_fragments": args.fragments, "fragment_sync_delay": args.tau,
                   "fragment_update_alpha": 0.5},
        "codec": {"name": "float32"},
        "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 45.0,
                    "allreduce_timeout": 30.0, "max_attempts": 2, "peer_ttl": 30.0,
                    "bandwidth_mbps": args.rate or 1000.0},
        "status": {"enabled": False},
        "paths": {"out_dir": str(args.out / f"{pair}-{rep}")},
    })


def run(args: argparse.Namespace, pair: str, rep: int) -> dict[str, Any]:
    cfg = run_config(args, pair, rep)
    spec = PAIRS[pair]
    t0 = time.perf_counter()
    cpu = TreeCpu().start()
    with swarm_on_testbed(cfg, 2, args.rate, nat=spec["nat"]) as (_bed, swarm):
        swarm.start_bootstrap()
        assert swarm.boot is not None
        cpu.watch(swarm.boot.pid, "bootstrap")
        swarm.start_nodes({i: spec["extra"] for i in range(2)})
        for i, proc in enumerate(swarm.procs):
            cpu.watch(proc.pid, f"node-{i}")
        summaries = swarm.follow()
    wall = time.perf_counter() - t0
    used = cpu.stop()
    if len(summaries) != 2:
        raise RuntimeError(f"{pair}: only {sorted(summaries)} finished "
                           f"(logs in {cfg.paths.out_dir})")
    nodes = [summaries[f"node-{i}"] for i in range(2)]
    latency: dict[str, list[float]] = {}
    latency_max: dict[str, float] = {}
    for s in nodes:
        for frag, v in s["round_latency_s"].items():
            latency.setdefault(frag, []).append(v["mean"])
            latency_max[frag] = max(latency_max.get(frag, 0.0), v["max"])
    rounds = sum(nodes[0]["rounds_per_fragment"].values())
    return {
        "pair": pair, "repeat": rep, "rate_mbit": args.rate, "steps": nodes[0]["steps"],
        "rounds": rounds, "wall_s": round(wall, 1),
        "rounds_with_peers": [s["rounds_with_peers"] for s in nodes],
        "skipped_rounds": [s["skipped_rounds"] for s in nodes],
        "latency_mean_s": {k: statistics.mean(v) for k, v in sorted(latency.items())},
        "latency_max_s": dict(sorted(latency_max.items())),
        "bytes_per_node_per_round": statistics.mean(s["bytes_sent"] for s in nodes) / rounds,
        "utilization_mean": statistics.mean(s["compute_utilization"] for s in nodes),
        "reachability": [s["reachability"] for s in nodes],
        "data_paths": [s["data_paths"] for s in nodes],
        "cpu_s": used,
        "node_cpu_s": sum(used.get(f"node-{i}", {}).get("python", 0.0) for i in range(2)),
        "node_p2pd_cpu_s": sum(used.get(f"node-{i}", {}).get("p2pd", 0.0) for i in range(2)),
        "relay_p2pd_cpu_s": used.get("bootstrap", {}).get("p2pd", 0.0),
        "relay_python_cpu_s": used.get("bootstrap", {}).get("python", 0.0),
        "identical_outer": len({s["outer_digest"] for s in nodes}) == 1,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Medians over repeats, one line per pair."""
    head = ("| pair | rounds with a peer (of) | skipped | round latency per fragment, "
            "mean (max) | nodes' CPU s: python + p2pd | bootstrap CPU s: python + p2pd "
            "| data paths node-0 / node-1 |")
    out = [head, "|" + "---|" * 7]
    for pair in dict.fromkeys(r["pair"] for r in rows):
        rs = [r for r in rows if r["pair"] == pair]

        def med(get: Any, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(get(r) for r in rs)

        frags = rs[0]["latency_mean_s"]
        lat = ", ".join(f"{k}: {med(lambda r, k=k: r['latency_mean_s'][k]):.2f} "
                        f"({med(lambda r, k=k: r['latency_max_s'][k]):.2f}) s" for k in frags)
        paths = " / ".join(", ".join(f"{k} {v}" for k, v in p.items() if v)
                           or "-" for p in rs[0]["data_paths"])
        out.append(
            f"| {pair} | {med(lambda r: min(r['rounds_with_peers'])):.0f} "
            f"({rs[0]['rounds']}) | {med(lambda r: sum(r['skipped_rounds'])):.0f} | {lat} "
            f"| {med(lambda r: r['node_cpu_s']):.1f} + {med(lambda r: r['node_p2pd_cpu_s']):.1f} "
            f"| {med(lambda r: r['relay_python_cpu_s']):.1f} + "
            f"{med(lambda r: r['relay_p2pd_cpu_s']):.1f} | {paths} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="direct,one-nat,relayed,unflagged",
                    help=f"of {','.join(PAIRS)}")
    ap.add_argument("--rate", type=float, default=None, help="Mbit/s per node (default none)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--sync-every", type=int, default=20, help="H")
    ap.add_argument("--fragments", type=int, default=2, help="P")
    ap.add_argument("--tau", type=int, default=2, help="overlap")
    # ~1.6M parameters: 3 MB of float32 per fragment round, steps this 2-core box takes fast.
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/nat"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (reason := unavailable_reason(nat=True)) is not None:
        sys.exit(f"nat.py: {reason}")
    pairs = chosen(args.pairs, PAIRS, "nat.py: --pairs")
    rows = []
    for rep in range(args.repeats):
        for pair in pairs:
            rows.append(run(args, pair, rep))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
