"""The commands behind `dilonode.cli`, one function each: build what the command needs, run
it, print its result, and turn what the user can fix into a `UserError`.

Arguments become a config in `cliargs`; text layout is `fmt`'s, and what `run` prints while
training is `progress`'s. Heavy modules (torch, hivemind) are imported inside the command
that needs them.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dilonode.cli.args import UserError, run_config_from_args, swarm_secret
from dilonode.cli.progress import (
    progress_event,
    progress_text,
    recovered_event,
    started_event,
    summary_text,
)
from dilonode.fmt import human_bytes, key_values

__all__ = ["NodeFailure", "bootstrap", "identity", "memory", "prepare_data", "run_node",
           "simulate", "status", "swarm"]

# What the CUDA context and the allocator's slack take beside the tensors (a few hundred MB
# on current drivers): left free when comparing the estimate with a card.
_CUDA_OVERHEAD = 1 << 30


class NodeFailure(Exception):
    """The node gave up on a part it could not restart (dilonode/node/supervisor.py); printed as
    one line, exit status 1, so that a service manager restarts it."""


def simulate(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    from tqdm import tqdm

    from dilonode.sim.training import simulate as run_sim
    from dilonode.sim.training import write_report

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    a = cfg.diloco.effective()
    print(f"simulating {cfg.sim.workers} workers, mode={a.mode}, H={a.sync_every}, "
          f"P={a.num_fragments}, tau={a.fragment_sync_delay}, alpha={a.fragment_update_alpha}, "
          f"codec={cfg.codec.name}, steps={cfg.total_steps}")
    bar = tqdm(total=cfg.total_steps, disable=args.no_progress, unit="step", file=sys.stdout)

    def on_step(step: int, workers: list) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{workers[0].stats.last_loss:.3f}", refresh=False)

    def on_eval(point: Any) -> None:
        bar.write(f"step {point.step:>6}  tokens {point.tokens:>10}  eval loss "
                  f"{point.eval_loss:.4f}  sent/worker {human_bytes(point.bytes_sent_per_worker)}")

    try:
        report = run_sim(cfg, on_step=on_step, on_eval=on_eval)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    finally:
        bar.close()
    paths = write_report(report, Path(cfg.paths.out_dir))
    print("\nresult")
    print(key_values([
        ("final eval loss (outer)", f"{report.final_eval_loss:.4f}"),
        ("tokens (all workers)", f"{report.tokens:,}"),
        ("bytes sent per worker", human_bytes(report.bytes_sent_per_worker)),
        ("peak bytes in one sync", human_bytes(report.peak_sync_bytes)),
        ("rounds per fragment", str(report.rounds_per_fragment or "-")),
        ("workers hold identical outer weights", str(report.workers_agree)),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("report", str(paths["json"])),
        ("plot", str(paths["png"])),
    ], indent="  "))
    return 0


def prepare_data(args: argparse.Namespace) -> int:
    from dilonode.train.prepare import prepare_data as run_prepare

    try:
        meta = run_prepare(Path(args.src), Path(args.out), tokenizer=args.tokenizer,
                           eval_fraction=args.eval_fraction, jsonl_field=args.jsonl_field,
                           progress=not args.no_progress, source=args.source,
                           text_column=args.text_column, split=args.split)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    print(key_values([(k, str(v)) for k, v in meta.items()], indent="  "))
    return 0


def memory(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    from dilonode.train.data import load_tokenizer
    from dilonode.train.memory import estimate_memory

    try:
        vocab = args.vocab or cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer).vocab_size
        est = estimate_memory(cfg, vocab, ranks=args.ranks)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(est.as_dict(), indent=2))
        return 0
    card = int(args.device_gb * (1 << 30))
    fits = est.device_bytes + _CUDA_OVERHEAD <= card
    print(key_values([
        ("parameters", f"{est.params:,} (vocabulary {vocab:,})"),
        ("weights + gradients (float32)", human_bytes(est.weights + est.gradients)),
        ("AdamW moments", human_bytes(est.optimizer)),
        ("activations of one micro-batch", f"{human_bytes(est.activations)} "
         f"({est.micro_batch_tokens:,} tokens, activation checkpointing "
         f"{'on' if est.activation_checkpointing else 'off'})"),
        ("loss", f"{human_bytes(est.loss)} ("
         + (f"chunks of {est.loss_chunk:,} tokens" if est.loss_chunk else "whole logits")
         + ")"),
        ("outer state", f"{human_bytes(est.outer_state)} in "
         + ("device memory" if est.outer_on_device else "host RAM")),
        ("device memory, estimated", human_bytes(est.device_bytes)),
        (f"fits a {args.device_gb:g} GiB card", f"{'yes' if fits else 'no'} (leaving "
         f"{human_bytes(_CUDA_OVERHEAD)} for the CUDA context)"),
    ], indent="  "))
    return 0


def _stop_on_signals() -> threading.Event:
    """First SIGINT/SIGTERM asks for a clean stop; a second one aborts at once."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        logging.getLogger("dilonode").warning("signal %d: stopping (again to abort)", signum)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


EXIT_DISAGREE = 3  # the run ended, but this node's outer weights differ from its peers'


def run_node(args: argparse.Namespace) -> int:
    """`dilonode run`: one node. With `--nproc N` (and no torchrun around us) start its N
    ranks and supervise them; as a rank, rank 0 runs the node and the others follow it."""
    import os

    from dilonode.cli.launch_ranks import RankEnv

    env = RankEnv.from_environ(os.environ)
    if env is not None:
        args.nproc = env.world  # torchrun's world size wins
    cfg = run_config_from_args(args)  # refuse bad settings before starting anything
    if env is None and cfg.dist.nproc > 1:  # --nproc or dist.nproc: we launch the ranks
        from dilonode.cli.launch_ranks import launch_ranks

        # The ranks re-run this command line; WORLD_SIZE & co. tell them their places.
        return launch_ranks(sys.argv[1:], cfg.dist.nproc, os.environ,
                            grace=cfg.dist.stop_grace + cfg.network.leave_timeout)
    if env is not None and env.rank > 0:
        return _follow_leader(cfg, env)
    return _run_leader(args, cfg, env)


def _follow_leader(cfg: Any, env: Any) -> int:
    """A rank other than 0: train as the leader says until it stops
    (dilonode/train/ranks/node_ranks.py).
    Signals are the leader's (via the launcher); a terminal's Ctrl+C must not kill us
    mid-collective."""
    from dilonode.cli.launch_ranks import EXIT_RANK_FAILED
    from dilonode.train.ranks.node_ranks import RankFailure, follow, init_node_ranks

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"rank {env.rank} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ranks = init_node_ranks(cfg, env)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        follow(cfg, ranks)
    except RankFailure as exc:
        logging.getLogger("dilonode").error("%s", exc)
        return EXIT_RANK_FAILED
    finally:
        ranks.close()
    return 0


def _run_leader(args: argparse.Namespace, cfg: Any, env: Any) -> int:
    """The node itself (rank 0 of a multi-rank node, or its only process)."""
    from dilonode.cli.logs import progress_line, setup_logging

    fmt = setup_logging(args.log_format)
    stop = _stop_on_signals()
    from dilonode.cli.launch_ranks import EXIT_RANK_FAILED
    from dilonode.node.daemon import Node
    from dilonode.node.summary import summary_json
    from dilonode.statesync.client import RecoveryError
    from dilonode.train.ranks.node_ranks import RankFailure, init_node_ranks

    try:
        ranks = init_node_ranks(cfg, env) if env is not None else None
        node = Node(cfg, worker_id=args.worker_id, resume=args.resume,
                    secret=swarm_secret(cfg), ranks=ranks)
    except ValueError as exc:  # settings only a node refuses (a schedule it cannot snapshot)
        raise UserError(str(exc)) from None
    out = Path(cfg.paths.out_dir)
    try:
        node.start(stop)
        _announce(node, out, fmt)
        if fmt == "json" and (rec := node.keeper.recovery) is not None:
            print(recovered_event(rec), flush=True)
        line = progress_line() if fmt == "text" else None
        try:
            summary = node.run(stop, None if args.forever else -1,
                               on_step=_progress_printer(node, cfg.eval_every, fmt, line))
        finally:
            if line is not None:
                line.close()
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(summary_json(summary) + "\n")
        node.save_outer(out / "outer.pt")
        if node.worker.trace is not None:
            (out / "trace.jsonl").write_text("".join(json.dumps(e) + "\n"
                                                     for e in node.worker.trace))
        if fmt == "json":
            print(summary_json(summary), flush=True)
        else:
            print(summary_text(json.loads(summary_json(summary))), flush=True)
        if node.failure is not None:
            raise NodeFailure(node.failure)
    except (ValueError, TimeoutError, RecoveryError) as exc:
        raise UserError(str(exc)) from None
    except RankFailure as exc:
        logging.getLogger("dilonode").error("node stopping: %s", exc)
        return EXIT_RANK_FAILED
    finally:
        node.close()
        if ranks is not None:
            ranks.close()
    if summary.agreement.get("agrees") is False:
        # Never report success for a run that ended as two models.
        print(f"dilonode run: {summary.agreement['line']}", file=sys.stderr, flush=True)
        return EXIT_DISAGREE
    return 0


def _announce(node: Any, out: Path, fmt: str) -> None:
    """Say the node is up (a JSON event, or a log line) and leave its status URL in `out`
    for `dilonode status`."""
    if node.status_url:
        out.mkdir(parents=True, exist_ok=True)
        (out / "status.url").write_text(node.status_url + "\n")
    if fmt == "json":
        print(started_event(node), flush=True)
    else:
        logging.getLogger("dilonode").info("dashboard: %s", node.status_url or "disabled")


def _progress_printer(node: Any, every: int, fmt: str,
                      line: Any) -> Callable[[Any, Any], None]:
    """JSON events every `every` steps, or a live line on a terminal, or plain log lines."""
    log = logging.getLogger("dilonode")

    def on_step(worker: Any, rep: Any) -> None:
        if line is None and worker.step % every:
            return
        snap = node.status.snapshot()
        if fmt == "json":
            print(progress_event(worker, rep, snap), flush=True)
            return
        text = progress_text(worker, snap)
        if line is not None:
            line.update(text)
        else:
            log.info("%s", text)
    return on_step


def bootstrap(args: argparse.Namespace) -> int:
    from dilonode.cli.logs import setup_logging

    if not 0 <= args.status_port <= 65535:
        raise UserError(f"--status-port = {args.status_port}: must be 0..65535")
    if not args.status_refresh > 0:
        raise UserError(f"--status-refresh = {args.status_refresh}: must be > 0 seconds")
    setup_logging(args.log_format)
    stop = _stop_on_signals()
    from dilonode.swarm.dht import SwarmDHT

    identity = Path(args.identity) if args.identity else None
    try:
        dht = SwarmDHT(args.run_id, [], identity, args.host, args.port).start()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    close_status = None
    close_relay = None
    try:
        if not args.no_relay:
            close_relay = _serve_relay(dht)
        maddrs = dht.visible_maddrs()
        url, close_status = (None, None) if args.no_status else _serve_swarm_view(dht, maddrs,
                                                                                 args)
        if args.maddrs_file:
            Path(args.maddrs_file).write_text("".join(m + "\n" for m in maddrs))
        print(json.dumps({"event": "bootstrap", "peer_id": dht.peer_id, "maddrs": maddrs,
                          "status_url": url}), flush=True)
        stop.wait()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    finally:
        if close_status is not None:
            close_status()
        if close_relay is not None:
            close_relay()
        dht.close()
    return 0


def _serve_relay(dht: Any) -> Callable[[], None]:
    """The bootstrap's relay for data streams between nodes behind NATs (swarm/tunnel.py),
    on a loop of its own; admits peers with a live record. Returns close()."""
    import concurrent.futures
    import contextlib

    from dilonode.net.loop_thread import LoopThread
    from dilonode.swarm.tunnel import LivePeers, Relay

    thread = LoopThread("dilonode-relay")
    thread.start()
    live = LivePeers(dht.fetch_peers)
    try:
        relay = thread.run(Relay.attach(dht.p2p_daemon_maddr(), dht.run_id, live), timeout=30.0)
    except BaseException:
        thread.stop()
        raise
    refresh = thread.submit(live.refresh_forever())

    def close() -> None:
        refresh.cancel()
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            thread.run(relay.aclose(), timeout=15.0)
        thread.stop()
    return close


def _serve_swarm_view(dht: Any, maddrs: list[str],
                      args: argparse.Namespace) -> tuple[str, Callable[[], None]]:
    """The bootstrap's status endpoint: every node's published summary, read from the DHT on
    a background loop. Returns (url, close)."""
    import concurrent.futures
    import contextlib

    from hivemind.utils import get_dht_time

    from dilonode.net.loop_thread import LoopThread
    from dilonode.status.metrics import swarm_metrics
    from dilonode.status.server import StatusServer
    from dilonode.status.swarm import SwarmView

    view = SwarmView(dht.peer_id, dht.run_id, dht.fetch_peers, maddrs=maddrs,
                     dht_time=get_dht_time)
    server = StatusServer(view, swarm_metrics, host=args.status_host, port=args.status_port)
    thread = LoopThread("dilonode-status", use_uvloop=False)
    thread.start()
    try:
        view.url = thread.run(server.start(), timeout=10.0)
    except BaseException:
        thread.stop()
        raise
    refresh = thread.submit(view.refresh_forever(interval=args.status_refresh))

    def close() -> None:
        refresh.cancel()
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            thread.run(server.aclose(), timeout=5.0)
        thread.stop()
    return view.url, close


def identity(args: argparse.Namespace) -> int:
    """Print a key file's peer id and base64 public key: the two forms auth.allowed_peers
    takes. With --create, a missing file gets a new key (the format `dilonode run` uses)."""
    import base64

    from dilonode.net.auth import AuthError, Identity

    path = Path(args.path)
    if not path.exists() and not args.create:
        raise UserError(f"{path}: no such key file (--create makes one)")
    try:
        ident = Identity.load_or_create(path)
    except (AuthError, OSError) as exc:
        raise UserError(str(exc)) from None
    print(json.dumps({"peer_id": ident.peer_id,
                      "public_key": base64.b64encode(ident.public_key).decode()}))
    return 0


def status(args: argparse.Namespace) -> int:
    """`dilonode status [URL]`: a node's or a bootstrap's /status as tables."""
    from dilonode.status.table import fetch_status, format_status

    url = args.url
    if url is None:
        hint = Path(args.out) / "status.url"
        if not hint.is_file():
            raise UserError(f"no URL given and {hint} does not exist: pass the status URL a "
                            "node or bootstrap printed (status_url), or --out its out_dir")
        url = hint.read_text().strip()
    try:
        snap = fetch_status(url, timeout=args.timeout)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(snap, indent=2) if args.json else format_status(snap))
    return 0


def swarm(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    from dilonode.cli.local_swarm import run_local_swarm

    return run_local_swarm(cfg, args.nodes, config_path=args.config,
                           overrides=args.overrides, forever=args.forever)
