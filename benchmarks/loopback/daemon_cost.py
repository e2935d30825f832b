"""What the daemon costs a node's training: tokens/s of (a) a plain PyTorch AdamW loop,
(b) `dilonode run` alone, (c) `dilonode run` in a 2-node swarm, same model, batch and seed,
in one run, alternating the three several times.

    python -m benchmarks.loopback.daemon_cost --repeats 3 --json runs/bench/daemon_cost.json

Each training process gets one core of its own (`taskset`) and one torch thread, so (a),
(b) and every node of (c) train on the same resources: in (c) the two nodes run side by
side, one core each, as two hosts would. (a) runs the inner loop a user would write: the
same model, data stream, autocast, loss, gradient clipping and AdamW as a worker, nothing
else. (b) and (c) read the nodes' run summaries: tokens per second over their training
steps (`LoopReport.train_s`: hooks, checkpoints and status included, evaluations and the
end-of-run rounds not).

Where (c) is slower than (b), the table says where the time went, from the summaries:
`step` (forward, backward, the inner update: slower when the node's own network thread,
encoding and reducing rounds on the same core, takes CPU from it), `sync` (starting and
landing rounds: pseudo-gradients, the outer step, merges), `wait` (blocked on a result).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, module_argv
from benchmarks.harness.results import save_rows
from dilonode.cli.local_swarm import LocalSwarm
from dilonode.config import RunConfig, load_config

__all__ = ["main", "plain_loop"]


def bench_config(args: argparse.Namespace, out: Path) -> RunConfig:
    return load_config(overrides={
        "run_id": "daemon-cost", "seed": 0, "total_steps": args.steps,
        "eval_every": 10 * args.steps, "device": "cpu",
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
        "diloco": {"mode": "streaming", "sync_every": args.sync_every, "num_fragments": 2,
                   "fragment_sync_delay": 1, "pacing": "steps"},
        "codec": {"name": "int4"},
        "network": {"min_peers": 1, "matchmaking_window": 2.0, "matchmaking_timeout": 20.0},
        "checkpoint": {"every_steps": 0},
        "paths": {"out_dir": str(out)},
    })


def plain_loop(cfg: RunConfig) -> dict[str, float]:
    """(a): the worker's inner loop with nothing around it; tokens/s over the steps."""
    import torch

    from dilonode.train.data import load_data
    from dilonode.train.device import autocast
    from dilonode.train.model import build_model, lm_loss
    from dilonode.train.worker import build_inner_optimizer

    data = load_data(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.vocab_size)
    opt = build_inner_optimizer(model, cfg.inner)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = data.train_batches(0, cfg.data.seq_len, cfg.data.batch_size, cfg.data.seed)
    device = torch.device("cpu")
    tokens, t0 = 0, time.perf_counter()
    for _ in range(cfg.total_steps):
        x, y = next(batches)
        with autocast(device):
            loss = lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "train_s": wall, "tokens_per_s": tokens / wall}


class _Cores:
    """Pins each process of a local swarm to a core of its own (`taskset`)."""

    def __init__(self, cores: dict[str, int]) -> None:
        self.cores = cores

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        return ["taskset", "-c", str(self.cores.get(name, 0)), *argv]

    def addr(self, name: str) -> str:
        return "127.0.0.1"


def _swarm(cfg: RunConfig, nodes: int) -> list[dict[str, Any]]:
    """(b) with one node, (c) with two: each node on its own core, the bootstrap on the
    last one; the nodes' summaries."""
    last = (os.cpu_count() or 1) - 1
    cores = {f"node{i}": min(i, last) for i in range(nodes)} | {"bootstrap": last}
    swarm = LocalSwarm(cfg, nodes, placement=_Cores(cores), threads=1)
    try:
        swarm.start()
        summaries = swarm.follow()
    finally:
        swarm.stop()
    if len(summaries) != nodes:
        raise RuntimeError(f"{nodes}-node run ended with {len(summaries)} summaries; logs "
                           f"in {cfg.paths.out_dir}")
    return [summaries[k] for k in sorted(summaries)]


def _plain(cfg: RunConfig, work: Path) -> dict[str, Any]:
    cfg_path = work / "plain.json"
    cfg_path.write_text(cfg.model_dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["taskset", "-c", "0", *module_argv(__spec__.name), "plain",
                           str(cfg_path)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"plain loop failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shares(s: dict[str, Any]) -> dict[str, float]:
    """Per trained token: seconds in train_step, starting/landing rounds, waiting."""
    steps = max(int(s["steps"]), 1)
    wall = float(s.get("train_s") or s["wall_s"])
    step_s = float(s["step_share"]) * float(s["wall_s"])
    wait = float(s["sync_wait_s"])
    return {"step_ms": 1e3 * step_s / steps, "wait_ms": 1e3 * wait / steps,
            "other_ms": 1e3 * max(wall - step_s - wait, 0.0) / steps}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rep in range(args.repeats):
            cfg = bench_config(args, work / f"r{rep}")
            plain = _plain(cfg, work)
            alone = _swarm(cfg.model_copy(update={"paths": cfg.paths.model_copy(
                update={"out_dir": str(work / f"b{rep}")})}), 1)[0]
            pair = _swarm(cfg.model_copy(update={"paths": cfg.paths.model_copy(
                update={"out_dir": str(work / f"c{rep}")})}), 2)
            row = {"repeat": rep, "a_tokens_per_s": round(plain["tokens_per_s"], 1),
                   "b_tokens_per_s": alone["tokens_per_s"],
                   "c_tokens_per_s": [s["tokens_per_s"] for s in pair],
                   "b_over_a": round(alone["tokens_per_s"] / plain["tokens_per_s"], 4),
                   "c_over_b": round(statistics.mean(s["tokens_per_s"] for s in pair)
                                     / alone["tokens_per_s"], 4),
                   "b": _shares(alone), "c": [_shares(s) for s in pair]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| repeat | (a) plain tok/s | (b) alone tok/s | (c) 2 nodes tok/s | b/a | c/b | "
             "step ms b / c | wait ms c | other ms b / c |", "|" + "---|" * 9]
    for r in rows:
        c_step = "/".join(f"{x['step_ms']:.1f}" for x in r["c"])
        c_wait = "/".join(f"{x['wait_ms']:.1f}" for x in r["c"])
        c_other = "/".join(f"{x['other_ms']:.1f}" for x in r["c"])
        c_rate = " / ".join(f"{x:,.0f}" for x in r["c_tokens_per_s"])
        lines.append(f"| {r['repeat']} | {r['a_tokens_per_s']:,.0f} | "
                     f"{r['b_tokens_per_s']:,.0f} | {c_rate} | {r['b_over_a']:.3f} | "
                     f"{r['c_over_b']:.3f} | {r['b']['step_ms']:.1f} / {c_step} | {c_wait} | "
                     f"{r['b']['other_ms']:.1f} / {c_other} |")
    ba = [r["b_over_a"] for r in rows]
    cb = [r["c_over_b"] for r in rows]
    lines.append(f"\nmedian b/a {statistics.median(ba):.3f} (min {min(ba):.3f}), "
                 f"median c/b {statistics.median(cb):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plain"]:  # the child of (a)
        cfg = RunConfig.model_validate_json(Path(argv[1]).read_text())
        print(json.dumps(plain_loop(cfg)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="model preset (model.preset)")
    ap.add_argument("--steps", type=int, default=300, help="inner steps of every run")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=50, help="H (two fragments)")
    ap.add_argument("--repeats", type=int, default=3, help="(a), (b), (c) alternated this often")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    if shutil.which("taskset") is None:
        print("daemon_cost: needs taskset (util-linux) to give each process its core",
              file=sys.stderr)
        return 2
    rows = run(args)
    print(table(rows))
    if args.json:
        save_rows(args.json, args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
