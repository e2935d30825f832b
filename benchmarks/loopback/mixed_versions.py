"""Mixed versions: current nodes and one node of an older release in one swarm on 127.0.0.1.

    .venv/bin/python -m benchmarks.loopback.mixed_versions                  # old = 994ae3d
    .venv/bin/python -m benchmarks.loopback.mixed_versions --old-rev v0.1.0 --current 3

The old release is `git archive REV` unpacked into a temporary folder and run with this
venv's interpreter and packages (PYTHONPATH = that folder, cwd = that folder), offline. A
current bootstrap peer, --current current nodes and one old node start on one run id and
config (the nano model; a partial JSON config both releases read). The table says, per
node, its release and protocol version, its exit code, whether it printed a line naming a
protocol-version mismatch (and the first such line), how many rounds it took part in with
peers, and its final outer digest; the verdict says whether the current nodes ended as one
model and whether anything crashed (a traceback in a node's stderr).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import dilonode
from tests.support.config import LOOPBACK_NETWORK, nano_overrides

ROOT = Path(__file__).resolve().parents[2]
_MISMATCH = re.compile(r"protocol[ _]version", re.IGNORECASE)


def unpack(rev: str, into: Path) -> Path:
    """`git archive rev` of this repository unpacked into `into`; its protocol version."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def protocol_of(tree: Path | None) -> int:
    env = dict(os.environ, PYTHONPATH=str(tree)) if tree else None
    code = "import dilonode; print(dilonode.PROTOCOL_VERSION)"
    out = subprocess.run([sys.executable, "-c", code],
                         cwd=tree or ROOT, env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def _msg(line: str) -> str:
    """The message of a JSON log line from its record kind on (the line itself otherwise)."""
    try:
        text = str(json.loads(line).get("msg", line))
    except (json.JSONDecodeError, AttributeError):
        text = line
    return text[text.find("]: ") + 3:] if "]: " in text else text


class Proc:
    """A `dilonode` child: stdout JSON events kept, stderr into a file."""

    def __init__(self, name: str, args: list[str], out: Path, tree: Path | None) -> None:
        self.name, self.events, self.log = name, [], out / f"{name}.stderr"
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        self.proc = subprocess.Popen([sys.executable, "-m", "dilonode.cli", *args],
                                     cwd=tree or ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=self.log.open("w"), text=True)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                continue

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((e for e in list(self.events) if e.get("event") == kind), None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="mixed-versions-"))
    old_tree = unpack(args.old_rev, tmp / "old")
    out = tmp / "run"
    out.mkdir()
    cfg = nano_overrides(run_id="mixed-versions", total_steps=args.steps,
                         network=dict(LOOPBACK_NETWORK, min_peers=args.current),
                         diloco={"pacing": "steps"})
    cfg_path = out / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    versions = {"current": protocol_of(None), "old": protocol_of(old_tree)}
    boot = Proc("bootstrap", ["bootstrap", "--run-id", "mixed-versions", "--log-format", "json",
                              "--no-status"], out, None)
    deadline = time.monotonic() + 60
    while (ev := boot.first("bootstrap")) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if ev is None:
        raise SystemExit(f"bootstrap did not start: {boot.log.read_text()[-2000:]}")
    maddrs = ev["maddrs"]
    nodes: list[tuple[str, Proc]] = []
    for i in range(args.current + 1):
        release = "old" if i == args.current else "current"
        name = f"node-{i}"
        nodes.append((release, Proc(name, [
            "run", "--config", str(cfg_path), "--worker-id", str(i), "--out", str(out / name),
            "--log-format", "json", "--initial-peers", *maddrs],
            out, old_tree if release == "old" else None)))
    t0 = time.monotonic()
    try:
        for _, p in nodes:
            left = max(args.timeout - (time.monotonic() - t0), 1.0)
            try:
                p.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                p.stop()
    finally:
        for _, p in nodes:
            p.stop()
        boot.stop()
    rows = []
    for release, p in nodes:
        p.thread.join(timeout=5)
        err = p.log.read_text(errors="replace")
        lines = [_msg(ln) for ln in err.splitlines()
                 if _MISMATCH.search(ln) and ("!=" in ln or "mismatch" in ln)]
        summary = p.first("summary") or {}
        rows.append({"node": p.name, "release": release, "protocol": versions[release],
                     "exit": p.proc.returncode, "mismatch_line": lines[0][:120] if lines else "",
                     "last_line": err.strip().splitlines()[-1][:120] if err.strip() else "",
                     "mismatch_lines": len(lines), "crash": "Traceback" in err,
                     "rounds": summary.get("rounds_with_peers", summary.get("rounds")),
                     "digest": str(summary.get("outer_digest", ""))[:12],
                     "stderr": str(p.log)})
    current = [r for r in rows if r["release"] == "current"]
    digests = {r["digest"] for r in current}
    return {"old_rev": args.old_rev, "versions": versions, "rows": rows,
            "current_one_model": len(digests) == 1 and "" not in digests,
            "old_shares_model": rows[-1]["digest"] in digests,
            "any_crash": any(r["crash"] for r in rows), "seconds": time.monotonic() - t0,
            "out": str(out)}


def table(res: dict[str, Any]) -> str:
    head = ("| node | release | protocol | exit | mismatch lines | first such line | crash | "
            "digest |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['node']} | {r['release']} | {r['protocol']} | {r['exit']} | "
                     f"{r['mismatch_lines']} | `{r['mismatch_line']}` | {r['crash']} | "
                     f"{r['digest']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-rev", default="994ae3d", help="git revision of the old release")
    ap.add_argument("--current", type=int, default=2, help="current nodes beside the old one")
    ap.add_argument("--steps", type=int, default=36, help="total_steps of the run")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before killing nodes")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    res = run(args)
    print(f"# mixed versions, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{platform.node()} ({os.cpu_count()} CPUs), dilonode {dilonode.__version__}")
    print(table(res))
    print(f"current nodes one model: {res['current_one_model']}; old node shares it: "
          f"{res['old_shares_model']}; any crash: {res['any_crash']}; "
          f"{res['seconds']:.0f} s; logs in {res['out']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
