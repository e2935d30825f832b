"""What the daemon costs a node's training: tokens/s of (a) a plain PyTorch AdamW loop,
(b) `dilonode run` alone and (c) `dilonode run` in a 2-node swarm, same model, batch, seed
and steps, in one run, alternated (a b c a b c ...) so that the load of the machine hits the
three alike.

    python -m benchmarks.loopback.daemon_cost --repeats 3 --json runs/bench/daemon_cost.json
    python -m benchmarks.loopback.daemon_cost --device cuda ...   # a GPU host (gpu.sh)

Each training process gets one core of its own (`taskset`) and one torch thread: (a) and
(b) on core 0 (b's bootstrap on the last core), the nodes of (c) on cores 0 and 1, side by
side as two hosts would be (the bootstrap on the last core). (a) runs the inner loop a user
would write: the same model, batch shape, seed, autocast, loss, gradient clipping and AdamW
as a worker, reading the loss every step as a worker does, nothing else. (b) and (c) read
the nodes' run summaries: tokens/s over their training steps (`LoopReport.train_s`: the
per-step hook included; evaluations and the end-of-run rounds not).

Where the node's time goes, per inner step, from its own measurements
(`NodeSummary.phases`): `step` (forward, backward, the inner update), `start` (the
pseudo-gradient, handing it to the round: copies, and encoding where the node's ranks
encode), `apply` (the outer step and the merge), `wait` (blocked on a round's result),
`hooks` (status, checkpoints), `rest` (the loop, the pacer, whatever none of these holds).
`other cpu` is the CPU the node's other threads used meanwhile (the network thread: the
codec's encode and decode, hashing, transport): on a node's one core it is taken from the
training thread, so in (c) it shows up as a slower `step` (with the GIL it holds) beside
(b)'s. With `--device cuda` the nodes of (c) share the one GPU, so c/b there also measures
two processes sharing a GPU.
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
from benchmarks.harness.results import write_json
from dilonode.config import RunConfig, load_config

__all__ = ["breakdown", "cpu_per_step", "extra_per_step", "main", "plain_loop", "spread",
           "summarize"]

# The node's phases of a training step (`LoopReport.phases`), in the table's order.
PARTS = ("step", "start", "apply", "wait", "hooks")


def bench_config(args: argparse.Namespace, out: Path) -> RunConfig:
    return load_config(overrides={
        "run_id": "daemon-cost", "seed": 0, "total_steps": args.steps,
        "eval_every": 10 * args.steps, "device": args.device,
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "eval_batches": 2},
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

    torch.set_num_threads(1)
    device = torch.device(cfg.device)
    data = load_data(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.vocab_size).to(device)
    opt = build_inner_optimizer(model, cfg.inner)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = data.train_batches(0, cfg.data.seq_len, cfg.data.batch_size, cfg.data.seed)
    tokens, cpu0, t0 = 0, time.thread_time(), time.perf_counter()
    for _ in range(cfg.total_steps):
        x, y = next(batches)
        with autocast(device):
            loss = lm_loss(model, x.to(device), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the worker reads every step's loss (a sync on a GPU)
        tokens += x.numel()
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "train_s": wall, "tokens_per_s": tokens / wall,
            "step_ms": 1e3 * wall / cfg.total_steps,
            "cpu_ms": 1e3 * (time.thread_time() - cpu0) / cfg.total_steps}


# ------------------------------------------------------------------ arithmetic (pure)


def breakdown(summary: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per inner step of a node's training steps (`train_s`): each of `PARTS`,
    `rest` (train_s less them), and `other_cpu` (its other threads' CPU, overlapping)."""
    steps = int(summary["steps"])
    if steps <= 0 or not summary.get("phases"):
        raise ValueError(f"summary of {summary.get('worker_id', '?')}: no training steps "
                         "or no phases to break down")
    ph = summary["phases"]
    ms = {k: 1e3 * float(ph[f"{k}_s"]) / steps for k in PARTS}
    total = 1e3 * float(summary["train_s"]) / steps
    return ms | {"rest": max(total - sum(ms.values()), 0.0), "total": total,
                 "train_cpu": 1e3 * float(ph["train_cpu_s"]) / steps,
                 "other_cpu": 1e3 * float(ph["other_cpu_s"]) / steps}


def extra_per_step(base: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """What `other`'s step costs beyond `base`'s (breakdowns), per part, largest first."""
    keys = [*PARTS, "rest"]
    diff = {k: other[k] - base[k] for k in keys}
    return dict(sorted(diff.items(), key=lambda kv: -kv[1]))


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _mean_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(p[k] for p in parts) for k in parts[0]}


def summarize(rows: list[dict[str, Any]], target: float = 0.98) -> dict[str, Any]:
    """The ratios across repeats (median, min, max), the mean breakdowns of (b) and (c),
    and what (c)'s step costs beyond (b)'s."""
    b = _mean_parts([r["b"] for r in rows])
    c = _mean_parts([x for r in rows for x in r["c"]])
    ba = spread([r["b_over_a"] for r in rows])
    return {"b_over_a": ba, "c_over_b": spread([r["c_over_b"] for r in rows]),
            "b_over_a_cpu": spread([r["b_over_a_cpu"] for r in rows]),
            "c_over_b_cpu": spread([r["c_over_b_cpu"] for r in rows]),
            "target_b_over_a": target, "met": ba["median"] >= target,
            "b_ms": b, "c_ms": c, "c_extra_ms": extra_per_step(b, c)}


def row_of(rep: int, plain: dict[str, float], alone: dict[str, Any],
           pair: list[dict[str, Any]]) -> dict[str, Any]:
    c_rate = statistics.fmean(s["tokens_per_s"] for s in pair)
    return {"repeat": rep, "a_tokens_per_s": round(plain["tokens_per_s"], 1),
            "a_step_ms": plain["step_ms"], "a_cpu_ms": plain["cpu_ms"],
            "b_tokens_per_s": alone["tokens_per_s"],
            "c_tokens_per_s": [s["tokens_per_s"] for s in pair],
            "b_over_a": round(alone["tokens_per_s"] / plain["tokens_per_s"], 4),
            "c_over_b": round(c_rate / alone["tokens_per_s"], 4),
            "b": (b := breakdown(alone)), "c": (c := [breakdown(s) for s in pair]),
            "b_over_a_cpu": round(plain["cpu_ms"] / cpu_per_step(b), 4),
            "c_over_b_cpu": round(cpu_per_step(b) / statistics.fmean(map(cpu_per_step, c)), 4)}


def cpu_per_step(parts: dict[str, float]) -> float:
    """A node's CPU milliseconds per inner step, all its threads (a breakdown)."""
    return parts["train_cpu"] + parts["other_cpu"]


# ------------------------------------------------------------------ processes


class _Cores:
    """Pins each process of a local swarm to a core of its own (`taskset`)."""

    def __init__(self, cores: dict[str, int]) -> None:
        self.cores = cores

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        if name not in self.cores:
            raise KeyError(f"daemon_cost: no core for process {name!r}")
        return ["taskset", "-c", str(self.cores[name]), *argv]

    def addr(self, name: str) -> str:
        return "127.0.0.1"


def cores_for(nodes: int, cpus: int) -> dict[str, int]:
    """Node i on core i (wrapping round the cores), the bootstrap on the last core."""
    last = max(cpus, 1) - 1
    return {f"node-{i}": i % (last + 1) for i in range(nodes)} | {"bootstrap": last}


def _swarm(cfg: RunConfig, nodes: int) -> list[dict[str, Any]]:
    """(b) with one node, (c) with two: the nodes' summaries, by worker id."""
    from dilonode.cli.local_swarm import LocalSwarm

    swarm = LocalSwarm(cfg, nodes, placement=_Cores(cores_for(nodes, os.cpu_count() or 1)),
                       threads=1)
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


def _at(cfg: RunConfig, out: Path) -> RunConfig:
    return cfg.model_copy(update={"paths": cfg.paths.model_copy(update={"out_dir": str(out)})})


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = bench_config(args, work)
        for rep in range(args.repeats):
            plain = _plain(cfg, work)
            alone = _swarm(_at(cfg, work / f"b{rep}"), 1)[0]
            pair = _swarm(_at(cfg, work / f"c{rep}"), 2)
            rows.append(row_of(rep, plain, alone, pair))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------ output


def _spread(x: dict[str, float]) -> str:
    return f"{x['median']:.3f} (min {x['min']:.3f}, max {x['max']:.3f})"


def _ms(parts: dict[str, float]) -> str:
    return " / ".join(f"{parts[k]:.1f}" for k in (*PARTS, "rest"))


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| repeat | (a) plain tok/s | (b) alone tok/s | (c) 2 nodes tok/s | b/a | c/b | "
             "b/a by CPU | c/b by CPU |", "|" + "---|" * 8]
    for r in rows:
        c_rate = " / ".join(f"{x:,.0f}" for x in r["c_tokens_per_s"])
        lines.append(f"| {r['repeat']} | {r['a_tokens_per_s']:,.0f} | "
                     f"{r['b_tokens_per_s']:,.0f} | {c_rate} | {r['b_over_a']:.3f} | "
                     f"{r['c_over_b']:.3f} | {r['b_over_a_cpu']:.3f} | "
                     f"{r['c_over_b_cpu']:.3f} |")
    s = summarize(rows)
    lines += ["", f"b/a median {_spread(s['b_over_a'])}: target >= "
              f"{s['target_b_over_a']:.2f} {'met' if s['met'] else 'NOT met'}; "
              f"c/b median {_spread(s['c_over_b'])}; by CPU time (tokens per CPU second, "
              f"all the node's threads): b/a {_spread(s['b_over_a_cpu'])}, "
              f"c/b {_spread(s['c_over_b_cpu'])}", "",
              "ms per inner step (mean over repeats and nodes); CPU ms of the training "
              "thread and of the other threads:", "",
              "| run | total | step / start / apply / wait / hooks / rest | training cpu | "
              "other cpu |", "|---|---|---|---|---|"]
    a_ms = statistics.fmean(r["a_step_ms"] for r in rows)
    a_cpu = statistics.fmean(r["a_cpu_ms"] for r in rows)
    lines.append(f"| (a) plain | {a_ms:.1f} | {a_ms:.1f} / - / - / - / - / - | {a_cpu:.1f} "
                 "| - |")
    for name, p in (("(b) alone", s["b_ms"]), ("(c) 2 nodes", s["c_ms"])):
        lines.append(f"| {name} | {p['total']:.1f} | {_ms(p)} | {p['train_cpu']:.1f} | "
                     f"{p['other_cpu']:.1f} |")
    extra = ", ".join(f"{k} {v:+.1f}" for k, v in s["c_extra_ms"].items())
    lines += ["", f"(c) beyond (b), ms per step: {extra}"]
    return "\n".join(lines)


def _load(avg: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in avg)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plain"]:  # the child of (a)
        cfg = RunConfig.model_validate_json(Path(argv[1]).read_text())
        print(json.dumps(plain_loop(cfg)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="model preset (model.preset)")
    ap.add_argument("--steps", type=int, default=150, help="inner steps of every run")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=50, help="H (two fragments)")
    ap.add_argument("--repeats", type=int, default=3, help="(a), (b), (c) alternated this often")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", type=Path, help="write the rows and the summary here")
    ap.add_argument("--md", type=Path, help="write the tables here")
    args = ap.parse_args(argv)
    if shutil.which("taskset") is None:
        print("daemon_cost: needs taskset (util-linux) to give each process its core",
              file=sys.stderr)
        return 2
    if args.steps < 1 or args.repeats < 1:
        print("daemon_cost: --steps and --repeats must be at least 1", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    rows = run(args)
    load1 = os.getloadavg()
    md = table(rows) + (f"\n\nload average (1, 5, 15 min) before {_load(load0)}, after "
                        f"{_load(load1)}; {os.cpu_count()} cpus")
    print(md)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md + "\n")
    write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                           "summary": summarize(rows), "load_before": load0,
                           "load_after": load1, "cpus": os.cpu_count()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
