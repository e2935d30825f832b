"""One fragment's exchange inside a node of 1 vs 2 ranks: where the round's time goes.

Each rank holds a fragment of `--numel` float32 values (DDP layout: the whole fragment
in its inner model, the outer state of its slice). A round is what `Worker` does through
`NodeRanks` (dilonode/train/ranks/node_ranks.py): the pseudo-gradient of each rank's slice, each
rank
encoding its slice with the codec (`dist.share_codec`; 2 ranks only) and the gather of
those bytes, the gather of the float32 contribution on the leader, the round itself (a real
`AllReduceRound` in a group of one over the in-memory network: the leader's member work,
its contribution taken from the ranks' encodings when they made them), the scatter of the
result, each rank's outer Nesterov step on its slice, and the merge of the new global
weights into every rank's weights (all-gather). Times are the leader's, median of
`--rounds`, each phase ended by a barrier so that it is the slowest rank's time.

    python -m benchmarks.loopback.multirank_round --numel 20000000 --codec int4 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.harness.results import write_json
from dilonode.algo.codec_table import CODEC_NAMES

PHASES = ("pseudo_gradient", "encode_slices", "gather", "round", "scatter", "outer_step",
          "merge")


def _round(full: torch.Tensor, codec: str, r: int, encoded: Any) -> torch.Tensor:
    """The leader's member work in a group of one: a real round over the memory network."""
    from dilonode.allreduce.memnet import MemNet
    from dilonode.allreduce.round import AllReduceRound, GroupSpec, group_digest

    spec = GroupSpec(run_id="bench", fragment=0, round=r, members=("leader",),
                     weights=(1.0,), numel=full.numel(), codec=codec, block_size=64,
                     chunk_numel=1 << 18, group_digest=group_digest(("leader",)))
    rnd = AllReduceRound(spec, 0, full, encoded=encoded)
    MemNet([rnd]).run()
    assert rnd.result is not None
    return rnd.result


def _rank(env: Any, numel: int, codec: str, rounds: int, threads: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dilonode.algo.outer import OuterState, pseudo_gradient
    from dilonode.collective import ReduceResult, RoundReport
    from dilonode.config import load_config
    from dilonode.train.ranks.node_ranks import init_node_ranks
    from dilonode.train.ranks.single import SingleRank

    torch.set_num_threads(threads)
    world = env.world if env else 1
    cfg = load_config(overrides={"device": "cpu", "codec": {"name": codec},
                                 "data": {"batch_size": 2}, "dist": {"nproc": world}})
    ranks: Any = init_node_ranks(cfg, env) if env else SingleRank()
    ranks.strategy = "ddp"
    g = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=g)
    ranks.setup_fragments([[param]], cfg.codec.block_size)
    outer = OuterState(ranks.local_flat(0, [param]), 0.7, 0.9)

    def sync() -> None:
        if env:
            dist.barrier(group=ranks.control)

    times: dict[str, list[float]] = {k: [] for k in PHASES}
    for r in range(rounds + 1):
        param.add_(torch.randn(numel, generator=g), alpha=1e-3)  # "training"
        sync()
        marks = [time.perf_counter()]
        delta = pseudo_gradient(outer.weights, ranks.local_flat(0, [param]))
        sync()
        marks.append(time.perf_counter())
        encoded = ranks._gather_encoded(0, delta) if env and ranks._shares_codec() else None
        sync()
        marks.append(time.perf_counter())
        full = ranks.gather(0, delta)
        sync()
        marks.append(time.perf_counter())
        mean = _round(full, codec, r, encoded) if ranks.leader else None
        sync()
        marks.append(time.perf_counter())
        result = ReduceResult(mean, RoundReport(1, 0, 0))  # type: ignore[arg-type]
        if env:
            result = ranks.localize(0, result)
        sync()
        marks.append(time.perf_counter())
        new = outer.step(result.mean)
        sync()
        marks.append(time.perf_counter())
        ranks.apply(0, [param], new, 0.5)
        sync()
        marks.append(time.perf_counter())
        if r:  # the first round warms up the kernels and allocator
            for k, a, b in zip(PHASES, marks, marks[1:], strict=False):
                times[k].append(b - a)
    if env:
        ranks.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ranks": world, "numel": numel, "codec": codec, **med,
            "total": sum(med.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=20_000_000)
    ap.add_argument("--codec", default="int4", choices=CODEC_NAMES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    from tests.integration.ranks_harness import run_ranks

    rows = [_rank(None, args.numel, args.codec, args.rounds, args.threads)]
    rows.append(run_ranks(2, _rank, args.numel, args.codec, args.rounds, args.threads,
                          timeout=1200)[0])
    print(f"{'ranks':>5} " + " ".join(f"{k:>15}" for k in (*PHASES, "total")))
    for row in rows:
        print(f"{row['ranks']:>5} " + " ".join(f"{row[k]:>14.3f}s"
                                               for k in (*PHASES, "total")))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
