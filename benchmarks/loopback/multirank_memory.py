"""Memory per rank of a node on N local devices: outer state and inner model, DDP vs FSDP2.

Two parts (docs/reports/2026-11-25-multirank-memory.md):

* `--table`: what each rank holds for a preset (150m, 1b) at 1, 2 and 4 ranks, computed
  from the layouts the code uses (`train/ranks.py`: outer slices, FSDP2 dim-0 shards of the
  parameters of a model built on the meta device): host RAM for the outer state (float32
  weights + momentum of the rank's slices), device memory for the model's training state
  (float32 weights, gradients and AdamW's two moments), and the leader's transients (one
  fragment's contribution and result; a full snapshot for a checkpoint or a joiner).
* `--measure PRESET`: real ranks on CPU over gloo (1 and 2 ranks, DDP and FSDP), one
  inner step and one round of every fragment, reporting each rank's peak RSS and the bytes
  of the tensors it holds (outer slices, its share of the model, AdamW state).

    python -m benchmarks.loopback.multirank_memory --table --json runs/bench/multirank_memory.json
    python -m benchmarks.loopback.multirank_memory --measure 150m
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.results import write_json
from dilonode.algo.fragments import assign_fragments
from dilonode.config import load_config
from dilonode.train.model import build_model
from dilonode.train.ranks.slices import fsdp_segments, slice_bounds

GIB = 2**30
VOCAB = 32_000  # a realistic tokenizer; the byte corpus's 256 would hide the embeddings


def _shapes(preset: str, fragments: int) -> list[list[tuple[int, ...]]]:
    cfg = load_config(overrides={"model": {"preset": preset, "vocab_size": VOCAB}})
    with torch.device("meta"):
        model = build_model(cfg.model, VOCAB)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    frags = assign_fragments([n for n, _ in named], fragments)
    return [[named[i][1] for i in f.param_indices] for f in frags]


def layout_row(preset: str, world: int, strategy: str, fragments: int = 3,
               align: int = 64) -> dict[str, Any]:
    """Bytes per rank (the largest over ranks) for one configuration."""
    groups = _shapes(preset, fragments)
    numels = [sum(math.prod(s) for s in g) for g in groups]
    total = sum(numels)
    outer = max(sum(hi - lo for lo, hi in (slice_bounds(n, world, align)[r] for n in numels))
                for r in range(world))
    if strategy == "fsdp":
        local = max(sum(n for g in groups for _, n in fsdp_segments(g, world, r))
                    for r in range(world))
    else:
        local = total
    return {"preset": preset, "params": total, "ranks": world, "strategy": strategy,
            "outer_host_bytes": 8 * outer, "model_device_bytes": 16 * local,
            "leader_round_bytes": 8 * max(numels),  # contribution + result, one fragment
            "leader_snapshot_bytes": 8 * total}


def table() -> list[dict[str, Any]]:
    rows = []
    for preset in ("150m", "1b"):
        rows.append(layout_row(preset, 1, "single"))
        for world in (2, 4):
            for strategy in ("ddp", "fsdp"):
                rows.append(layout_row(preset, world, strategy))
    return rows


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'preset':<6} {'params':>8} {'ranks':>5} {'strategy':<8} {'outer/rank':>11} "
          f"{'model/rank':>11} {'leader round':>13} {'leader snap':>12}")
    for r in rows:
        print(f"{r['preset']:<6} {r['params'] / 1e6:>7.0f}M {r['ranks']:>5} "
              f"{r['strategy']:<8} {r['outer_host_bytes'] / GIB:>9.2f} G "
              f"{r['model_device_bytes'] / GIB:>9.2f} G "
              f"{r['leader_round_bytes'] / GIB:>11.2f} G "
              f"{r['leader_snapshot_bytes'] / GIB:>10.2f} G")


# -- measured ---------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """A rank's part of a tensor (an FSDP2 DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensor_bytes(w: Any) -> dict[str, int]:
    outer = sum(8 * f.outer.weights.numel() for f in w.frags)
    local = sum(4 * t.numel() for t in w.ranks.local_tensors(w.params))
    adam = sum(_local(t).numel() * t.element_size() for s in w.opt.state.values()
               for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
    return {"outer": outer, "weights": local, "adam": adam}


def measure_rank(env: Any, preset: str, strategy: str) -> dict[str, Any]:
    """One node of `env.world` ranks (None: one process): one step, one round each."""
    from dilonode.algo.codecs import get_codec
    from dilonode.sim.local_group import LocalGroup
    from dilonode.train.data import load_data
    from dilonode.train.ranks.node_ranks import follow, init_node_ranks
    from dilonode.train.ranks.single import SingleRank
    from dilonode.train.worker import Worker

    world = env.world if env else 1
    cfg = load_config(overrides={
        "device": "cpu", "model": {"preset": preset}, "total_steps": 4,
        "data": {"seq_len": 64, "batch_size": 2 * world},
        "diloco": {"sync_every": 3, "num_fragments": 3, "fragment_sync_delay": 0,
                   "pacing": "steps"},
        "dist": {"nproc": world, "strategy": strategy if env else "auto"}})
    ranks: Any = init_node_ranks(cfg, env) if env else SingleRank()
    out: dict[str, Any] = {"rank": env.rank if env else 0}
    if ranks.leader:
        ranks.handshake("bench", torch.device("cpu"))
        group = LocalGroup(1, get_codec("int4"))
        w = Worker(cfg, load_data(cfg.data), group.view(0), "bench", torch.device("cpu"),
                   ranks=ranks)
        w.end_step = 3
        for _ in range(3):
            w.train_step()
            w.launch()
            w.land()
        out.update(_tensor_bytes(w))
        ranks.stop()
    else:
        w = follow_and_keep(cfg, ranks, follow)
        out.update(_tensor_bytes(w))
    out["max_rss"] = _peak_rss()
    if env:
        ranks.close()
    return out


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM: its own, unlike ru_maxrss, which a
    spawned child inherits from its parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def follow_and_keep(cfg: Any, ranks: Any, follow: Any) -> Any:
    """`follow`, keeping the follower's Worker to measure it afterwards."""
    from dilonode.train import worker as worker_mod

    kept: list[Any] = []
    original = worker_mod.Worker.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        original(self, *a, **kw)
        kept.append(self)

    worker_mod.Worker.__init__ = init  # type: ignore[method-assign]
    try:
        follow(cfg, ranks)
    finally:
        worker_mod.Worker.__init__ = original  # type: ignore[method-assign]
    return kept[0]


def measure(preset: str) -> list[dict[str, Any]]:
    from tests.integration.ranks_harness import run_ranks

    rows = [{"ranks": 1, "strategy": "single", **measure_rank(None, preset, "auto")}]
    for strategy in ("ddp", "fsdp"):
        for r in run_ranks(2, measure_rank, preset, strategy, timeout=900):
            rows.append({"ranks": 2, "strategy": strategy, **r})
    for r in rows:
        print(f"{preset} ranks={r['ranks']} {r['strategy']:<6} rank {r['rank']}: outer "
              f"{r['outer'] / GIB:.3f} G, weights {r['weights'] / GIB:.3f} G, adam "
              f"{r['adam'] / GIB:.3f} G, peak RSS {r['max_rss'] / GIB:.2f} G", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", action="store_true", help="the layout table (150m, 1b)")
    ap.add_argument("--measure", metavar="PRESET", help="real ranks on CPU for PRESET")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    result: dict[str, Any] = {}
    if args.table:
        result["table"] = table()
        _print_table(result["table"])
    if args.measure:
        result["measured"] = measure(args.measure)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
