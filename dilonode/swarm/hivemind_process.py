"""Running hivemind's DHT process inside a training node: importing hivemind once and undoing
its process-wide side effects (`import_hivemind`), the fork start method it needs, the
functions a `SwarmDHT` runs inside the DHT process (`node_*`: its peer id, p2pd's address
and pid, pings, reconnects), and the guards that keep the process from outliving its node
(`orphan_safe`: it exits when its parent dies, releases the parent's sockets and gets
fresh locks after the fork). `unusable` says why a DHT process cannot take a request now.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing as mp
import os
import signal
import struct
import termios
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["bound_maddr", "ensure_fork_start_method", "exit_text", "host_maddr", "import_hivemind",
           "kill_p2pd", "node_clock_samples", "node_daemon_maddr", "node_p2pd_pid",
           "node_peer_addrs", "node_peer_id", "node_ping_p2pd", "node_reconnect",
           "node_visible_maddrs", "orphan_safe", "proc_state", "unusable"]


log = logging.getLogger(__name__)

_hivemind_ready = False
_hivemind_lock = threading.Lock()
# Bytes of requests waiting in the pipe to the DHT process. A stopped process reads nothing:
# past this, calls fail at once rather than fill the pipe (64 KiB) and block forever.
_MAX_PIPE_BACKLOG = 16 << 10


def import_hivemind() -> Any:
    """Import hivemind once and undo its process-wide logging side effects."""
    global _hivemind_ready
    with _hivemind_lock:
        import hivemind
        from hivemind.utils.logging import use_hivemind_log_handler

        if not _hivemind_ready:
            # hivemind renames WARNING to "WARN" for every logger in the process and installs
            # its own INFO-level handler; route its records through the application's logging
            # instead and keep only its warnings (its INFO lines are p2pd chatter).
            logging.addLevelName(logging.WARNING, "WARNING")
            use_hivemind_log_handler("nowhere")
            logging.getLogger("hivemind").setLevel(logging.WARNING)
            _use_fd_sharing()
            _hivemind_ready = True
        return hivemind


def _use_fd_sharing() -> None:
    """Share hivemind's MPFuture state through file descriptors, not torch_shm_manager.

    hivemind switches torch to the "file_system" strategy, where every process registers its
    shared tensors with one torch_shm_manager process over a socket. A DHT process killed
    in the middle of such a registration crashed the manager ("terminate called after
    throwing an instance of 'std::system_error'"), and from then on every DHT call of the
    node raised "Broken pipe". With file descriptors there is no manager to
    crash; a call costs about 2 ms more (a descriptor is handed over per request).
    """
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_descriptor")


def ensure_fork_start_method() -> None:
    # The DHT is a ForkProcess, but hivemind's MPFuture locks and pipes come from the default
    # context; hivemind is only tested with "fork" there, so make it the default in
    # spawn-started processes (e.g. torch.multiprocessing workers) before the first DHT.
    if mp.get_start_method() != "fork":
        log.info("switching the multiprocessing start method to 'fork' for hivemind")
        mp.set_start_method("fork", force=True)


async def node_peer_id(_dht: Any, node: Any) -> str:
    return node.peer_id.to_base58()


async def node_daemon_maddr(_dht: Any, node: Any) -> Any:
    return node.p2p.daemon_listen_maddr


async def node_visible_maddrs(_dht: Any, node: Any) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs()]


async def node_p2pd_pid(_dht: Any, node: Any) -> int | None:
    child = getattr(node.p2p, "_child", None)  # hivemind's asyncio subprocess of p2pd
    return getattr(child, "pid", None)


async def node_ping_p2pd(_dht: Any, node: Any) -> None:
    # identify() is a round trip to p2pd over its control socket: a dead daemon refuses
    # it, a stopped one never answers.
    await node.p2p.get_visible_maddrs(latest=True)


async def node_peer_addrs(_dht: Any, node: Any) -> dict[str, list[str]]:
    return {info.peer_id.to_base58(): [str(a) for a in info.addrs]
            for info in await node.p2p.list_peers() if info.addrs}


async def node_clock_samples(_dht: Any, node: Any, peers: list[str], rounds: int,
                             timeout: float) -> list[tuple[str, float, float]]:
    """(peer, its DHT time minus the midpoint of our send and receive, round trip) for each
    of `peers` (peer ids), `rounds` pings each, against this host's own clock (`time.time`,
    not the DHT's): what `swarm_time.estimate_offset` reads."""
    import asyncio

    from hivemind.proto import dht_pb2

    async def one(peer: Any) -> list[tuple[str, float, float]]:
        out = []
        for _ in range(rounds):
            request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False)
            try:
                t0 = time.time()
                response = await asyncio.wait_for(
                    node.protocol.get_stub(peer).rpc_ping(request, timeout=timeout), timeout)
                t1 = time.time()
            except Exception:  # not a DHT peer, or gone: no sample from it
                return out
            if response.dht_time:
                out.append((peer.to_base58(), response.dht_time - (t0 + t1) / 2, t1 - t0))
        return out

    from hivemind.p2p import PeerID

    found = await asyncio.gather(*(one(PeerID.from_base58(p)) for p in peers))
    return [s for samples in found for s in samples]


async def node_reconnect(_dht: Any, node: Any, peers: dict[str, list[str]],
                          timeout: float) -> list[str]:
    """Dial and ping `peers` (peer id -> addresses); those that answer are in our routing
    table again, and we in theirs (a ping carries our node id). Then look up our own
    neighbourhood, as a bootstrap does, so the two halves of a healed partition meet."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def one(peer_id: str, addrs: list[str]) -> str | None:
        try:
            peer = PeerID.from_base58(peer_id)
            await asyncio.wait_for(node.p2p._client.connect(peer, [Multiaddr(a) for a in addrs]),
                                   timeout)
            answered = await asyncio.wait_for(node.protocol.call_ping(peer), timeout)
        except Exception:  # unreachable, refused, not a valid address: try again later
            return None
        return peer_id if answered is not None else None

    found = [p for p in await asyncio.gather(*(one(p, a) for p, a in peers.items())) if p]
    if found:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
    return found


def proc_state(pid: int) -> str | None:
    """The state letter of process `pid` (R, S, T for stopped, Z for a zombie...), or None
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def kill_p2pd(pid: int | None) -> None:
    """SIGKILL the p2pd at `pid` if it still runs (it outlives a SIGKILLed DHT process)."""
    if pid is None or proc_state(pid) in (None, "Z", "X"):
        return
    try:
        if b"p2pd" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return  # the pid was reused by another program
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def host_maddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"


def _die_with_parent(parent_pid: int, forked_by_main: bool) -> None:
    """In a forked child: die when the parent dies, so a SIGKILLed node leaves no DHT
    process behind still answering for its peer id.

    PR_SET_PDEATHSIG fires when the *thread* that forked us ends, so it is used only for a
    fork made by the main thread; a DHT restarted by the supervisor (from a short-lived
    thread) instead checks every half second whether its parent is still there.
    """
    if forked_by_main:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # not Linux: the poll below still works
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    if not forked_by_main:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True,
                         name="dilonode-orphan-watch").start()


def _release_parent_sockets() -> None:
    """In a forked child: let go of the parent's TCP sockets (listeners, connections).

    A DHT process forked by a running node (a restart) inherits every socket the node has
    open. Its copy kept the node's listening ports taken (a listener restarted in place got
    EADDRINUSE, and the kernel went on queueing connections nobody accepted) and kept
    closed connections open (peers saw no hang-up). Each such descriptor is pointed at
    /dev/null instead of closed, so that a socket object of the parent's that this child
    garbage-collects later closes that copy, never an unrelated descriptor of the child.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return  # not Linux
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            if fd != devnull and _is_tcp_socket(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _is_tcp_socket(fd: int) -> bool:
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        return sock.family in (socket.AF_INET, socket.AF_INET6)
    finally:
        sock.detach()  # the descriptor stays open: only asked


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _fresh_mpfuture_locks() -> None:
    """New objects for hivemind's class-wide MPFuture locks (multiprocessing locks, shared
    with every process forked while they are set).

    A DHT process SIGKILLed (or SIGSTOPped) while it held one, sending a result or making
    its shared state, left it held for good: the next DHT process hung at start-up, and a
    parent thread creating an MPFuture could hang too. Called around each fork, a child gets
    locks of its own and the parent keeps locks no child holds. Nothing needs them shared:
    each process takes them for its own pipe writes and allocations.
    """
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    MPFuture._initialization_lock = mp.Lock()
    MPFuture._update_lock = mp.Lock()
    SharedBytes._lock = mp.Lock()


# In the DHT process: the request tasks in flight (see `_hold_current_task`).
_REQUESTS: set[Any] = set()


def _hold_current_task() -> None:
    """Keep a strong reference to the running task until it is done.

    hivemind's DHT process runs each request as `asyncio.create_task(...)` and keeps no
    reference to it; asyncio holds tasks weakly, so a request waiting on p2pd could be
    garbage-collected mid-call ("Task was destroyed but it is pending!", GeneratorExit) and
    its caller waited out its whole timeout. Seen under load as health checks and
    matchmaking reads that got no answer.
    """
    import asyncio

    task = asyncio.current_task()
    if task is not None:
        _REQUESTS.add(task)
        task.add_done_callback(_REQUESTS.discard)


def orphan_safe(dht_class: Any) -> Any:
    """hivemind.DHT subclass whose process dies with the process that started it, shares no
    lock with it (`_fresh_mpfuture_locks`) and keeps its requests alive until answered
    (`_hold_current_task`)."""

    class OrphanSafeDHT(dht_class):  # type: ignore[misc, valid-type]
        _dilonode_p2pd_flags: dict[str, Any] = {}

        async def _get(self, *args: Any, **kwargs: Any) -> Any:
            _hold_current_task()
            return await super()._get(*args, **kwargs)

        async def _store(self, *args: Any, **kwargs: Any) -> Any:
            _hold_current_task()
            return await super()._store(*args, **kwargs)

        async def _run_coroutine(self, *args: Any, **kwargs: Any) -> Any:
            _hold_current_task()
            return await super()._run_coroutine(*args, **kwargs)

        def start(self) -> None:
            _fresh_mpfuture_locks()  # the child's
            try:
                super().start()  # forks
            finally:
                _fresh_mpfuture_locks()  # the parent's from now on

        def run(self) -> None:
            _die_with_parent(self._dilonode_parent, self._dilonode_by_main)
            _release_parent_sockets()
            if self._dilonode_p2pd_flags:  # before the node starts its p2pd
                from dilonode.swarm.reachability import add_p2pd_flags

                add_p2pd_flags(self._dilonode_p2pd_flags)
            super().run()

        def run_in_background(self, *args: Any, **kwargs: Any) -> Any:
            self._dilonode_parent = os.getpid()
            self._dilonode_by_main = threading.current_thread() is threading.main_thread()
            return super().run_in_background(*args, **kwargs)

    return OrphanSafeDHT


def unusable(dht: Any) -> str | None:
    """Why DHT process `dht` cannot take a request now (None: it can)."""
    if not dht.is_alive():
        return f"DHT process {dht.pid} {exit_text(dht.exitcode)}"
    if (backlog := _pipe_backlog(dht)) > _MAX_PIPE_BACKLOG:
        return f"DHT process {dht.pid} is not reading its requests ({backlog} bytes waiting)"
    return None


def exit_text(code: int | None) -> str:
    if code is None:
        return "is running"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def bound_maddr(host_maddr: str, visible: list[str]) -> str:
    """`host_maddr` with the port p2pd actually listens on (for a restart on the same port)."""
    prefix = host_maddr.rsplit("/", 1)[0] + "/"
    for maddr in visible:
        if maddr.startswith(prefix):
            port = maddr[len(prefix):].split("/", 1)[0]
            if port.isdigit():
                return prefix + port
    return host_maddr


def _pipe_backlog(dht: Any) -> int:
    """Bytes written to the DHT process's request pipe that it has not read yet."""
    try:
        raw = fcntl.ioctl(dht._outer_pipe.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError, AttributeError):
        return 0  # not a pipe we can ask (another platform): no early refusal
    return int(struct.unpack("i", raw)[0])
