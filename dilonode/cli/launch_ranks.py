"""`dilonode run --nproc N`: start one node's N ranks as local processes and supervise them.

Each rank is `python -m dilonode.cli run ...` (the same arguments) with torchrun's
variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a node
launched by torchrun instead behaves the same. Rank 0 is the node's leader (network side,
status, output); the others follow it (dilonode/train/ranks/node_ranks.py).

Faults inside the node never leave a hung host: when a rank other than the leader dies,
the launcher asks the leader to stop (SIGTERM: it leaves the swarm, so its peers see one
peer leave) and kills every rank still running `grace` seconds later; when the leader
ends, the others (told to stop, or failing on their next collective) get the same grace.
The first SIGINT/SIGTERM to the launcher goes to the leader (a clean stop), a second one
kills every rank; the ranks run in their own session (a terminal's Ctrl+C reaches the
launcher alone) and die with the launcher. Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dilonode.train.ranks.slices import RankEnv, rank_environ

__all__ = ["EXIT_RANK_FAILED", "RankEnv", "launch_ranks", "rank_environ"]

log = logging.getLogger(__name__)

EXIT_RANK_FAILED = 4  # a rank of the node died or a collective inside it failed
_POLL_S = 0.1


def _die_with_parent() -> None:
    """In a rank, before exec: SIGKILL when the launcher dies (Linux), so no rank outlives
    a killed launcher."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Supervisor:
    """Watches the ranks; see the module docstring for what it does when one ends."""

    def __init__(self, procs: list[subprocess.Popen[Any]], grace: float) -> None:
        self.procs, self.grace = procs, grace
        self.signals = 0

    def on_signal(self, signum: int, _frame: object) -> None:
        self.signals += 1
        if self.signals == 1:
            self._term(self.procs[0])
        else:
            self.kill_all()

    def wait(self) -> int:
        """Until every rank has ended; the node's exit status."""
        while True:
            leader = self.procs[0].poll()
            failed = [(r, p.returncode) for r, p in enumerate(self.procs[1:], 1)
                      if p.poll() not in (None, 0)]
            if leader is not None:
                self._reap()
                late = [r for r, p in enumerate(self.procs[1:], 1) if p.returncode != 0]
                return leader if leader or not late else EXIT_RANK_FAILED
            if failed:
                rank, code = failed[0]
                log.error("rank %d exited with status %s: stopping the node", rank, code)
                print(f"dilonode: rank {rank} exited with status {code}: stopping the node",
                      file=sys.stderr, flush=True)
                self._term(self.procs[0])
                self._reap()
                return EXIT_RANK_FAILED
            time.sleep(_POLL_S)

    def _reap(self) -> None:
        """Wait up to `grace` s for every rank, then kill those still running."""
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        self.kill_all()

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    @staticmethod
    def _term(p: subprocess.Popen[Any]) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)


def launch_ranks(argv: Sequence[str], nproc: int, environ: Mapping[str, str],
                 grace: float, python: str = sys.executable) -> int:
    """Run `dilonode <argv>` as ranks 0..nproc-1 of one node; their exit status: the
    leader's, or `EXIT_RANK_FAILED` when another rank failed."""
    port = _free_port()
    # Their own session: a terminal's Ctrl+C reaches the launcher alone, which forwards it
    # once (rank 0 would otherwise count it twice and abort); and they die with us.
    procs = [subprocess.Popen([python, "-m", "dilonode.cli", *argv],
                              env=rank_environ(environ, r, nproc, port),
                              start_new_session=True, preexec_fn=_die_with_parent)
             for r in range(nproc)]
    sup = _Supervisor(procs, grace)
    previous = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return sup.wait()
    finally:
        sup.kill_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
