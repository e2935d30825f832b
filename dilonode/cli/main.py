"""Command line: parse arguments and dispatch to `dilonode.cli.commands`.

Nothing heavy is imported here (no torch, no hivemind) so `dilonode --help` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from dilonode.algo.codec_table import CODEC_NAMES
from dilonode.cli.fast_exit import exit_without_finalizing

__all__ = ["build_parser", "main"]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="TOML run config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set diloco.sync_every=50 (repeatable)")
    p.add_argument("--steps", type=int, help="inner steps per worker (total_steps)")
    p.add_argument("--mode", choices=["ddp", "diloco", "streaming"], help="diloco.mode")
    p.add_argument("--codec", help=f"codec.name: {', '.join(CODEC_NAMES)}")
    p.add_argument("--out", help="output folder (paths.out_dir)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dilonode", description="Decentralized training with Streaming DiLoCo.")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="M virtual workers in one process (same algorithm)")
    _add_config_args(sim)
    sim.add_argument("--workers", "-m", type=int, help="number of virtual workers (sim.workers)")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")

    run = sub.add_parser("run", help="run a training node that joins a swarm")
    _add_config_args(run)
    run.add_argument("--initial-peers", nargs="*", default=None, metavar="MULTIADDR",
                     help="bootstrap multiaddrs (network.initial_peers)")
    run.add_argument("--worker-id", help="data stream identity (default: the peer id)")
    run.add_argument("--forever", action="store_true", help="train until stopped")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest valid checkpoint (checkpoint.dir)")
    run.add_argument("--log-format", choices=["text", "json"], help="default: text on a TTY")
    run.add_argument("--nproc", type=int, metavar="N",
                     help="ranks of this node, one per local device (dist.nproc); under "
                          "torchrun its world size")

    boot = sub.add_parser("bootstrap", help="run a DHT-only bootstrap peer")
    boot.add_argument("--host", default="127.0.0.1", help="listen address")
    boot.add_argument("--port", type=int, default=0, help="listen port (0: any)")
    boot.add_argument("--identity", help="key file for a stable peer id")
    boot.add_argument("--run-id", default="dilonode-default", help="run id it serves")
    boot.add_argument("--log-format", choices=["text", "json"], help="default: text on a TTY")
    boot.add_argument("--status-host", default="127.0.0.1",
                      help="status endpoint (swarm view) listen address")
    boot.add_argument("--status-port", type=int, default=0, help="status port (0: any)")
    boot.add_argument("--status-refresh", type=float, default=2.0, metavar="SECONDS",
                      help="how often the swarm view reads the peer records")
    boot.add_argument("--no-status", action="store_true", help="no status endpoint")
    boot.add_argument("--no-relay", action="store_true",
                      help="do not relay data and state-sync streams to nodes behind NATs")
    boot.add_argument("--maddrs-file", metavar="PATH",
                      help="also write the multiaddrs there, one per line (for scripts)")

    st = sub.add_parser("status", help="print a node's status, or the swarm view of a "
                        "bootstrap peer")
    st.add_argument("url", nargs="?", help="status URL (default: read from OUT/status.url)")
    st.add_argument("--out", default="runs/default", help="a node's out_dir (for status.url)")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    st.add_argument("--json", action="store_true", help="print the raw JSON")

    swarm = sub.add_parser("swarm", help="a bootstrap and N nodes on loopback, one process each")
    _add_config_args(swarm)
    swarm.add_argument("--nodes", "-n", type=int, default=3, help="number of nodes")
    swarm.add_argument("--forever", action="store_true", help="train until Ctrl+C")

    ident = sub.add_parser("identity", help="print the peer id and public key of a key file "
                           "(for auth.allowed_peers)")
    ident.add_argument("path", help="libp2p key file (network.identity_path)")
    ident.add_argument("--create", action="store_true", help="write a new key if missing")

    mem = sub.add_parser("memory", help="estimate the device memory and host RAM a node of "
                         "this config needs (measures activations on the CPU, ~10-60 s)")
    _add_config_args(mem)
    mem.add_argument("--vocab", type=int, help="vocabulary size (default: the tokenizer's)")
    mem.add_argument("--ranks", type=int, default=1, help="ranks sharing each inner step")
    mem.add_argument("--device-gb", type=float, default=24.0,
                     help="memory of the card to compare with, in GiB")
    mem.add_argument("--json", action="store_true", help="print the estimate as JSON")

    prep = sub.add_parser("prepare-data", help="tokenize .txt/.jsonl, Parquet or a datasets "
                          "save_to_disk folder into shards")
    prep.add_argument("src", help="folder (or file) of .txt / .jsonl or .parquet files, or a "
                      "save_to_disk folder")
    prep.add_argument("--source", choices=("auto", "text", "parquet", "arrow"), default="auto",
                      help="kind of input (auto: by its files)")
    prep.add_argument("--text-column", default="text", help="text column of Parquet/Arrow rows")
    prep.add_argument("--split", default="train", help="split of a save_to_disk DatasetDict")
    prep.add_argument("out", help="output folder (train.bin, val.bin, meta.json)")
    prep.add_argument("--tokenizer", default="bytes", help="'bytes' or a local tokenizer.json")
    prep.add_argument("--eval-fraction", type=float, default=0.1, help="held-out share")
    prep.add_argument("--jsonl-field", default="text", help="text field of .jsonl records")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status of the command; a rank of a multi-rank node exits here instead
    (`exit_without_finalizing`: gloo can abort at interpreter exit)."""
    code = _dispatch(argv)
    # Loaded only by the commands that use ranks.
    dist = sys.modules.get("dilonode.train.ranks.node_ranks")
    if dist is not None and dist.used_process_groups():
        exit_without_finalizing(code)
    return code


def entry() -> NoReturn:
    """The `dilonode` program: `main`, then exit without tearing the interpreter down
    (1.5 s of a node's exit went to that, after it had closed and written everything)."""
    exit_without_finalizing(main())


def _dispatch(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from dilonode.cli import commands  # deferred: each command imports what it needs
    from dilonode.cli.args import UserError

    handler = {"simulate": commands.simulate, "prepare-data": commands.prepare_data,
               "run": commands.run_node, "bootstrap": commands.bootstrap,
               "swarm": commands.swarm, "status": commands.status,
               "identity": commands.identity, "memory": commands.memory}
    try:
        return handler[args.command](args)
    except KeyboardInterrupt:
        print("dilonode: interrupted", file=sys.stderr)
        return 130
    except UserError as exc:
        print(f"dilonode: {exc}", file=sys.stderr)
        return 2
    except commands.NodeFailure as exc:
        print(f"dilonode: {exc}", file=sys.stderr)
        return 1

