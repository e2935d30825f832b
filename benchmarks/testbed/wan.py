"""WAN benchmark: 4 real nodes on the namespace test bed (testbed/hosts.py) behind `tbf` limits,
Streaming DiLoCo (overlapped; int4, or each codec of `--codecs`) against plain DiLoCo (P=1,
tau=0, fp32) and DDP.

For each link rate and each run: compute utilization (share of wall time the training thread
was not blocked on a sync result; `step share` counts only time inside train_step), payload
bytes each node sent per round, and each fragment's round latency (sync start to averaged
result, matchmaking included). Needs root (network namespaces).

    sudo .venv/bin/python -m benchmarks.testbed.wan --rates 100,20 --json runs/bench/wan.json
    sudo .venv/bin/python -m benchmarks.testbed.wan --rates 10 --runs streaming \
        --codecs int4,int2-top1.56-ef --json runs/bench/wan-codecs.json
    sudo .venv/bin/python -m benchmarks.testbed.wan --rates 20 --runs streaming --defaults \
        --delays 10,40,80,150 --loss 0.001 --steps 1200 --json runs/bench/continents.json

`--codecs` names codecs as the quality benchmark's rows do without `s-` and the alpha
(benchmarks/harness/methods.py): `int4`, `int2-ef`, `int2-top1.56-ef`. `--delays`, `--jitter`
and `--loss` give node host i the i-th value of each list (one-way ms, ms, per packet) through
the link emulator; `--defaults` keeps the streaming run's pacing, overlap and network
timeouts at the configuration's defaults (tau auto, time pacing) instead of this benchmark's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.args import chosen, floats, names
from benchmarks.harness.methods import codec_overrides, diloco_overrides, row
from benchmarks.harness.results import save_rows
from dilonode.config import load_config
from testbed.hosts import swarm_on_testbed, unavailable_reason


def _streaming(a: argparse.Namespace) -> dict[str, Any]:
    r = row(f"s-{a.codec}-a0.5")
    return {"diloco": {"mode": "streaming", "sync_every": a.sync_every,
                       "num_fragments": a.fragments, "fragment_sync_delay": a.tau,
                       "fragment_update_alpha": 0.5, **diloco_overrides(r)},
            "codec": codec_overrides(r, a.block_size)}


RUNS = {
    "streaming": _streaming,
    "diloco": lambda a: {"diloco": {"mode": "diloco", "sync_every": a.sync_every},
                         "codec": {"name": "float32"}},
    "ddp": lambda a: {"diloco": {"mode": "ddp"}, "codec": {"name": "float32"},
                      "total_steps": a.ddp_steps},
}
LABELS = {"streaming": "Streaming int4", "diloco": "DiLoCo fp32", "ddp": "DDP fp32"}


def run_label(name: str, codec: str) -> str:
    return f"Streaming {codec}" if name == "streaming" else LABELS[name]


def run_config(args: argparse.Namespace, name: str, rate: float, out: Path) -> Any:
    tag = f"{name}-{args.codec}" if name == "streaming" else name
    over: dict[str, Any] = {
        "run_id": f"wan-{tag}-{rate:g}", "seed": 0, "total_steps": args.steps,
        "eval_every": 10**9, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
        # Nodes here drift several steps apart (4 trainers on 2 shared cores): the window
        # must outlast that drift, or early peers close a group without a late one and the
        # round fails on the membership check. Records live a minute so that a DHT read
        # that misses a peer does not drop it from the expected members either.
        "network": {"matchmaking_window": 20.0, "matchmaking_timeout": 45.0,
                    "allreduce_timeout": 60.0, "bandwidth_mbps": rate, "peer_ttl": 60.0},
        "status": {"enabled": False},
        "paths": {"out_dir": str(out / f"{tag}-{rate:g}")},
    }
    for key, value in RUNS[name](args).items():
        over[key] = {**over.get(key, {}), **value} if isinstance(value, dict) else value
    if args.defaults:
        over["network"] = {"bandwidth_mbps": rate}
        for key in ("fragment_sync_delay", "pacing"):
            over["diloco"].pop(key, None)
    return load_config(overrides=over)


def per_host(values: str, nodes: int) -> dict[str, float]:
    """Host `node-i` takes the i-th of the comma-separated values (the last one repeats)."""
    given = floats(values)
    return {f"node-{i}": given[min(i, len(given) - 1)] for i in range(nodes)}


def run(args: argparse.Namespace, name: str, rate: float) -> dict[str, Any]:
    cfg = run_config(args, name, rate, args.out)
    t0 = time.perf_counter()
    links = {k: per_host(v, args.nodes) for k, v in
             (("delays", args.delays), ("jitter", args.jitter), ("loss", args.loss)) if v}
    with swarm_on_testbed(cfg, args.nodes, rate, **links) as (bed, swarm):
        if args.idle_restart is not None:
            for i in range(args.nodes):
                bed.set_idle_restart(f"node-{i}", bool(args.idle_restart))
        swarm.start()
        summaries = swarm.follow()
    wall = time.perf_counter() - t0
    if len(summaries) != args.nodes:
        raise RuntimeError(f"{name} at {rate} Mbit/s: only {sorted(summaries)} finished "
                           f"(logs in {cfg.paths.out_dir})")
    return summarize(name, rate, list(summaries.values())) | {
        "wall_s": round(wall, 1), "codec": cfg.codec.name,
        "label": run_label(name, args.codec)}


def summarize(name: str, rate: float, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    utils = [s["compute_utilization"] for s in nodes]
    per_round = []
    latency: dict[str, list[float]] = {}
    latency_max: dict[str, float] = {}
    forming: dict[str, list[float]] = {}
    for s in nodes:
        lat = s["round_latency_s"]
        rounds = sum(v["n"] for v in lat.values())
        per_round.append(s["bytes_sent"] / max(rounds, 1))
        for frag, v in lat.items():
            label = "grad" if frag == "-1" else frag
            latency.setdefault(label, []).append(v["mean"])
            latency_max[label] = max(latency_max.get(label, 0.0), v["max"])
            forming.setdefault(label, []).append(v.get("forming_mean", 0.0))
    return {
        "run": name, "rate_mbit": rate, "nodes": len(nodes),
        "steps": nodes[0]["steps"],
        # Each node's own steps and its seconds blocked: on round results, and between
        # steps fetching the swarm's state (both count against utilization).
        "own_steps": [s["steps"] for s in nodes],
        "sync_wait_s": [round(s["sync_wait_s"], 1) for s in nodes],
        "catch_up_s": [round(s["catch_up_s"], 1) for s in nodes],
        "utilization_mean": statistics.mean(utils), "utilization_min": min(utils),
        "step_share_mean": statistics.mean(s["step_share"] for s in nodes),
        "s_per_step": statistics.mean(s["wall_s"] / max(s["steps"], 1) for s in nodes),
        "bytes_per_node_per_round": statistics.mean(per_round),
        "bytes_per_node": statistics.mean(s["bytes_sent"] for s in nodes),
        "rounds": nodes[0]["rounds_per_fragment"] or {"grad": nodes[0]["steps"]},
        "latency_mean_s": {k: statistics.mean(v) for k, v in sorted(latency.items())},
        "latency_max_s": dict(sorted(latency_max.items())),
        # Of the mean latency, the seconds spent forming groups (matchmaking).
        "forming_mean_s": {k: statistics.mean(v) for k, v in sorted(forming.items())},
        "skipped_rounds": sum(s["skipped_rounds"] for s in nodes),
        "retried_rounds": sum(s["retried_rounds"] for s in nodes),
        "final_eval_loss": statistics.mean(s["final_eval_loss"] for s in nodes),
        "identical_outer": len({s["outer_digest"] for s in nodes}) == 1,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| link | run | steps | utilization mean (min) | step share | s/step "
            "| bytes/node/round | round latency per fragment, mean (max) [forming groups] "
            "| skipped | agree |")
    out = [head, "|" + "---|" * 10]
    for r in rows:
        forming = r.get("forming_mean_s", {})
        lat = ", ".join(f"{k}: {r['latency_mean_s'][k]:.2f} ({r['latency_max_s'][k]:.2f}) s"
                        + (f" [{forming[k]:.2f} s]" if k in forming else "")
                        for k in r["latency_mean_s"])
        out.append(
            f"| {r['rate_mbit']:g} Mbit/s | {r.get('label', LABELS[r['run']])} | {r['steps']} "
            f"| {r['utilization_mean'] * 100:.1f}% ({r['utilization_min'] * 100:.1f}%) "
            f"| {r['step_share_mean'] * 100:.1f}% | {r['s_per_step']:.3f} "
            f"| {r['bytes_per_node_per_round'] / 1e6:.3f} MB | {lat} | {r['skipped_rounds']} "
            f"| {'yes' if r['identical_outer'] else 'NO'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100,20", help="Mbit/s per host, comma-separated")
    ap.add_argument("--runs", default="streaming,diloco,ddp", help=f"of {','.join(RUNS)}")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=90, help="inner steps (streaming, diloco)")
    ap.add_argument("--ddp-steps", type=int, default=8, help="steps of the DDP runs")
    ap.add_argument("--sync-every", type=int, default=30, help="H")
    ap.add_argument("--fragments", type=int, default=3, help="P of the streaming run")
    ap.add_argument("--tau", type=int, default=5, help="overlap of the streaming run")
    # 6.9M parameters on few tokens per step: a payload that makes DDP network-bound at
    # these rates, and a step this 2-core box can still take in about a second or two.
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--codecs", default="int4",
                    help="the streaming run's codecs, one run each: int4, int2-ef, "
                    "int2-top1.56-ef (benchmarks/harness/methods.py)")
    ap.add_argument("--block-size", type=int, default=64, help="values per block scale")
    ap.add_argument("--delays", default="", help="one-way ms per node host, comma-separated")
    ap.add_argument("--jitter", default="", help="jitter ms per node host, comma-separated")
    ap.add_argument("--loss", default="", help="loss per packet per node host, comma-separated")
    ap.add_argument("--idle-restart", type=int, choices=(0, 1),
                    help="net.ipv4.tcp_slow_start_after_idle on the node hosts (default: the "
                         "kernel's, 1); docs/operations.md asks long-link hosts for 0")
    ap.add_argument("--defaults", action="store_true",
                    help="the streaming run at the default pacing, tau and network timeouts")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/wan"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (reason := unavailable_reason()) is not None:
        sys.exit(f"wan.py: {reason}")
    runs = chosen(args.runs, RUNS, "wan.py: --runs")
    codecs = names(args.codecs)
    for codec in codecs:
        try:
            row(f"s-{codec}-a0.5")
        except ValueError as e:
            sys.exit(f"wan.py: --codecs {codec}: {e}")
    rows = []
    for rate in floats(args.rates):
        for name in runs:
            for codec in codecs if name == "streaming" else codecs[:1]:
                args.codec = codec
                rows.append(run(args, name, rate))
                print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    save_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
