"""Run one node's ranks as local processes over gloo, for the multi-rank tests.

`run_ranks(world, fn, *args)` spawns `world` processes that each call `fn(env, *args)`
(`env`: a `RankEnv` on a free loopback port) and returns their results by rank, killing
them all after `timeout` seconds. `train_node` is the usual `fn`: the leader drives a
Worker in lockstep against a group of one (or a shared `LocalGroup` view) while the other
ranks `follow` it.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests.support.ports import free_port

__all__ = ["run_ranks", "train_node"]


def _child(fn: Callable[..., Any], env: Any, args: tuple[Any, ...], out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle: tensors travel by value, not as shared memory the child would free.
        out.put((env.rank, "ok", pickle.dumps(fn(env, *args))))
    except BaseException:  # report, then die: the parent fails the test with the trace
        out.put((env.rank, "error", traceback.format_exc()))


def run_ranks(world: int, fn: Callable[..., Any], *args: Any,
              timeout: float = 120.0) -> list[Any]:
    """`fn(env, *args)` on `world` spawned ranks; their results, by rank."""
    from dilonode.train.ranks.node_ranks import RankEnv

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, RankEnv(r, world, r, f"127.0.0.1:{port}"), args, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, value = out.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} "
                                   f"still running after {timeout} s") from None
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def train_node(env: Any, overrides: dict[str, Any], steps: int,
               ckpt: str | None = None, resume: str | None = None) -> Any:
    """One node of `env.world` ranks (None: a single process) trains `steps` lockstep steps
    alone in its swarm, after resuming from the checkpoints in `resume` and before saving
    one to `ckpt` when given; the leader returns what it ended with (a dict)."""
    import torch

    from dilonode.algo.codecs import get_codec
    from dilonode.config import load_config
    from dilonode.sim.local_group import LocalGroup
    from dilonode.train.data import load_data
    from dilonode.train.ranks.node_ranks import follow, init_node_ranks
    from dilonode.train.ranks.single import SingleRank
    from dilonode.train.worker import Worker

    cfg = load_config(overrides={**overrides, "dist": {**overrides.get("dist", {}),
                                                      "nproc": env.world if env else 1}})
    ranks: Any = init_node_ranks(cfg, env) if env is not None else SingleRank()
    try:
        if not ranks.leader:
            follow(cfg, ranks)
            return None
        identity = ranks.handshake("node-a", torch.device("cpu"))
        data = load_data(cfg.data)
        group = LocalGroup(1, get_codec(cfg.codec.name, cfg.codec.block_size))
        w = Worker(cfg, data, group.view(0), identity, device=torch.device("cpu"), ranks=ranks)
        w.end_step = cfg.total_steps
        imported = None
        if resume:
            _resume(w, cfg, resume)
            imported = w.outer_flat()
        losses = []
        for _ in range(steps):
            losses.append(w.train_step())
            w.launch()
            w.land()
        w.drain()
        if ckpt:
            _save(w, cfg, ckpt)
        ev = w.evaluate(data.eval_batches(cfg.data.seq_len, cfg.data.batch_size, 2))
        result = {"outer": w.outer_flat(), "losses": losses, "eval": ev,
                  "digest": w.outer_digest(), "state": w.outer_state_dict(),
                  "imported": imported, "strategy": ranks.strategy}
        ranks.stop()
        return result
    finally:
        if env is not None:
            ranks.close()


def _save(w: Any, cfg: Any, directory: str) -> None:
    from pathlib import Path

    from dilonode.train.checkpoint import save_checkpoint
    from dilonode.train.state import config_digest

    save_checkpoint(Path(directory), w.export_state(), cfg.run_id, config_digest(cfg), 2,
                    position=w.data_position())


def _resume(w: Any, cfg: Any, directory: str) -> None:
    from pathlib import Path

    from dilonode.train.checkpoint import load_latest, resume_data
    from dilonode.train.state import config_digest

    found = load_latest(Path(directory), cfg.run_id, config_digest(cfg))
    assert found is not None, "no checkpoint"
    w.import_state(found[0])
    assert resume_data(w, found[1]), "no data position"  # every rank's stream goes on
