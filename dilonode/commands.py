"""Command implementations behind `dilonode.cli`: build config, run, print results."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from dilonode.config import ConfigError, RunConfig, load_config, parse_overrides

__all__ = ["UserError", "bootstrap", "prepare_data", "run_config_from_args", "run_node",
           "simulate", "swarm"]


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """Config file + --set overrides + the common shortcut flags, validated once."""
    try:
        overrides: dict[str, Any] = parse_overrides(args.overrides)
        shortcuts = {("total_steps",): getattr(args, "steps", None),
                     ("diloco", "mode"): getattr(args, "mode", None),
                     ("codec", "name"): getattr(args, "codec", None),
                     ("paths", "out_dir"): getattr(args, "out", None),
                     ("sim", "workers"): getattr(args, "workers", None),
                     ("network", "initial_peers"): getattr(args, "initial_peers", None)}
        for keys, value in shortcuts.items():
            if value is not None:
                node = overrides
                for k in keys[:-1]:
                    node = node.setdefault(k, {})
                node[keys[-1]] = value
        return load_config(args.config, overrides)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def simulate(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    from tqdm import tqdm

    from dilonode.sim import simulate as run_sim
    from dilonode.sim import write_report

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
    print(_table([
        ("final eval loss (outer)", f"{report.final_eval_loss:.4f}"),
        ("tokens (all workers)", f"{report.tokens:,}"),
        ("bytes sent per worker", human_bytes(report.bytes_sent_per_worker)),
        ("peak bytes in one sync", human_bytes(report.peak_sync_bytes)),
        ("rounds per fragment", str(report.rounds_per_fragment or "-")),
        ("workers hold identical outer weights", str(report.workers_agree)),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("report", str(paths["json"])),
        ("plot", str(paths["png"])),
    ]))
    return 0


def prepare_data(args: argparse.Namespace) -> int:
    from dilonode.train.prepare import prepare_data as run_prepare

    try:
        meta = run_prepare(Path(args.src), Path(args.out), tokenizer=args.tokenizer,
                           eval_fraction=args.eval_fraction, jsonl_field=args.jsonl_field,
                           progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    print(_table([(k, str(v)) for k, v in meta.items()]))
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


def run_node(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    from dilonode.logs import setup_logging

    setup_logging(args.log_format)
    stop = _stop_on_signals()
    from dilonode.node import Node, summary_json

    node = Node(cfg, worker_id=args.worker_id)
    try:
        node.start()
        print(json.dumps({"event": "started", "peer_id": node.peer_id,
                          "data_addr": node.collective.address}), flush=True)
        summary = node.run(stop, None if args.forever else -1,
                           on_step=_progress_printer(cfg.eval_every))
        out = Path(cfg.paths.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(summary_json(summary) + "\n")
        node.save_outer(out / "outer.pt")
        print(summary_json(summary), flush=True)
    except (ValueError, TimeoutError) as exc:
        raise UserError(str(exc)) from None
    finally:
        node.close()
    return 0


def _progress_printer(every: int):
    def on_step(worker, rep) -> None:
        if worker.step % every == 0:
            print(json.dumps({"event": "progress", "step": worker.step, "tokens": rep.tokens,
                              "loss": round(worker.stats.last_loss, 4),
                              "eval_loss": round(rep.eval_history[-1][1], 4)
                              if rep.eval_history else None,
                              "bytes_sent": worker.stats.bytes_sent,
                              "utilization": round(rep.compute_utilization, 4)}), flush=True)
    return on_step


def bootstrap(args: argparse.Namespace) -> int:
    from dilonode.logs import setup_logging

    setup_logging(args.log_format)
    stop = _stop_on_signals()
    from dilonode.swarm.dht import SwarmDHT

    identity = Path(args.identity) if args.identity else None
    try:
        dht = SwarmDHT(args.run_id, [], identity, args.host, args.port).start()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        print(json.dumps({"event": "bootstrap", "peer_id": dht.peer_id,
                          "maddrs": dht.visible_maddrs()}), flush=True)
        stop.wait()
    finally:
        dht.close()
    return 0


def swarm(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    from dilonode.swarm.local import run_local_swarm

    return run_local_swarm(cfg, args.nodes, config_path=args.config,
                           overrides=args.overrides, forever=args.forever)
