"""Evaluate the outer weights a test-bed run saved on more held-out text than its own
evaluation read.

A node evaluates `data.eval_batches` batches (8 x 2 windows of 64 tokens on the test bed:
1,024 tokens), enough to follow a run, but two runs' final losses on so few tokens move
with which windows happen to be there. Every node saves its final outer weights
(`outer.pt`); this reads them back with the run's own config (`swarm-config.json`) and
evaluates them on evenly spaced batches of the same eval split, the way the node does
(`Worker.evaluate`: mean of the batches' losses): by default the whole split, every
64-token window once (364 batches, 46,592 tokens on the test bed). With `--batches` equal
to the run's `data.eval_batches` it reproduces the node's final eval loss.

    .venv/bin/python -m benchmarks.testbed.reeval runs/bench/half-s0/*-100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dilonode.config import RunConfig
from dilonode.train.data import TokenData, load_data
from dilonode.train.model import build_model, mean_loss

__all__ = ["eval_run"]

_data_cache: dict[str, TokenData] = {}


def eval_run(run: Path, batches: int = 0, node: str = "node-0") -> float:
    """Mean eval loss of `run`/`node`/outer.pt over `batches` batches of its eval split
    (0: as many as the split holds without overlapping windows)."""
    cfg = RunConfig.model_validate(json.loads((run / "swarm-config.json").read_text()))
    key = cfg.data.model_dump_json()
    if key not in _data_cache:  # one corpus load for every run of the same data config
        _data_cache[key] = load_data(cfg.data)
    data = _data_cache[key]
    model = build_model(cfg.model, data.vocab_size)
    state = torch.load(run / node / "outer.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    if batches <= 0:  # every window of the split once, none overlapping
        batches = (len(data.eval_tokens) - 1) // (cfg.data.seq_len * cfg.data.batch_size)
    return mean_loss(model, data.eval_batches(cfg.data.seq_len, cfg.data.batch_size, batches),
                     "cpu")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (holding swarm-config.json)")
    ap.add_argument("--batches", type=int, default=0,
                    help="batches to evaluate (default 0: the whole eval split, every window "
                         "once)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write {run: loss} here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {}
    for run in args.runs:
        if not (run / "node-0" / "outer.pt").exists():
            print(f"{run}: no node-0/outer.pt", file=sys.stderr)
            continue
        out[str(run)] = loss = eval_run(run, args.batches)
        print(f"{run}\t{loss:.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
