"""The link emulator: delay, jitter and loss for packets between test bed hosts, without netem.

`linkem.c` (next to this file) forwards packets through a TUN device, holding each for its
one-way delay and dropping some (its header says how). This module compiles it on first
use (`cc -O2`, into `$XDG_CACHE_HOME/dilonode/linkem/` or else the repository's
`runs/cache/linkem/`, reused while the source's hash matches), starts it and talks to it:

    emu = LinkEmulator(["ip", "netns", "exec", router_ns], tun="tun0",
                       links={"10.77.0.1": LinkSpec(delay_ms=40, loss=0.01)}).start()
    emu.set("10.77.0.2", LinkSpec(delay_ms=80))
    emu.stats()   # {"packets": ..., "drops": ..., "queue_peak": ..., ...}
    emu.close()   # the last counters

The process's stdin is a pipe held by its owner: when the owner dies, even by SIGKILL, the
pipe closes and the emulator ends. `testbed.hosts.Testbed` builds the routing around it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CFLAGS", "SOURCE", "LinkEmulator", "LinkSpec", "LinkemError", "binary",
           "cache_dir", "slots_for", "unavailable_reason"]

SOURCE = Path(__file__).with_name("linkem.c")
CFLAGS = ("-O2", "-Wall")
TUN_DEVICE = "/dev/net/tun"
# Packets a queue must hold per second of delay: 1 Gbit/s of 1500-byte packets. The
# emulator touches a slot's memory only once a packet needs it, so the floor (1.5 s of
# such a link, 256 MiB of address space) leaves room for delays raised later by `set`.
PACKETS_PER_S = 85_000
MIN_SLOTS = 1 << 17
REPLY_TIMEOUT_S = 10.0  # a command's answer; the program answers within milliseconds
# The emulator is the network: it runs ahead of the processes whose packets it carries
# (SCHED_FIFO where allowed, else a raised nice), or on a busy machine each packet waits
# for a CPU on top of the delay asked.
RT_PRIORITY = 1
NICE = -10


class LinkemError(RuntimeError):
    """The emulator could not be built, started, or did not answer."""


@dataclass(frozen=True)
class LinkSpec:
    """One host's access link as the emulator sees it (rates are the tbf's).

    A packet from host a to host b is held `a.delay_ms + b.delay_ms`, each side plus a
    uniform jitter in [-jitter_ms, +jitter_ms], and lost with probability
    `1 - (1 - a.loss) * (1 - b.loss)`: each direction of each access link loses `loss`.
    A pair's packets never overtake each other, so those of a busy flow, closer together
    than the jitter, are held nearer the top of that range.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not self.delay_ms >= 0 or not self.jitter_ms >= 0:
            raise ValueError(f"{self}: delay_ms and jitter_ms must be >= 0")
        if not 0 <= self.loss < 1:
            raise ValueError(f"{self}: loss must be in [0, 1)")

    def fields(self) -> str:
        return f"{self.delay_ms:g} {self.jitter_ms:g} {self.loss:g}"


def cache_dir() -> Path:
    """Where compiled emulators are kept."""
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "dilonode" / "linkem"
    return Path(__file__).resolve().parents[1] / "runs" / "cache" / "linkem"


def _cached(cache: Path | None) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()
    return (cache or cache_dir()) / f"linkem-{digest[:16]}"


def binary(cache: Path | None = None, compiler: str = "cc") -> Path:
    """The compiled emulator, built now when no binary of this source is cached."""
    path = _cached(cache)
    if os.access(path, os.X_OK):
        return path
    if shutil.which(compiler) is None:
        raise LinkemError(f"the link emulator needs a C compiler (`{compiler}`) to build")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    proc = subprocess.run([compiler, *CFLAGS, "-o", str(tmp), str(SOURCE)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise LinkemError(f"compiling {SOURCE.name} failed: {proc.stderr.strip()[-500:]}")
    os.replace(tmp, path)  # atomic: a parallel build leaves one whole binary
    return path


def unavailable_reason(tun: bool = True, compiler: str = "cc") -> str | None:
    """Why the emulator cannot run here (None: it can): it needs a C compiler unless a
    binary of this source is cached, and `/dev/net/tun` unless it forwards over `--fd`."""
    if not os.access(_cached(None), os.X_OK) and shutil.which(compiler) is None:
        return (f"the link emulator needs a C compiler (`{compiler}`) to build "
                f"{SOURCE.name} (Debian: apt-get install gcc)")
    if tun and not os.access(TUN_DEVICE, os.R_OK | os.W_OK):
        return f"the link emulator needs {TUN_DEVICE} (modprobe tun)"
    return None


def slots_for(max_hold_ms: float) -> int:
    """Queue slots enough for 1 Gbit/s of full-size packets held `max_hold_ms`."""
    return max(MIN_SLOTS, int(PACKETS_PER_S * max_hold_ms / 1e3 * 1.25))


class LinkEmulator:
    """One emulator process; see the module docstring.

    `prefix` runs it elsewhere (`ip netns exec NS`); it forwards over the TUN device `tun`
    (which must exist where it runs), or over the inherited datagram socket `fd`. `links`
    maps IPv4 addresses to their `LinkSpec`; `seed` fixes its random draws. With
    `realtime` it runs SCHED_FIFO where this process may set that (root), else at nice
    `NICE` where it may, else as we do.
    """

    def __init__(self, prefix: Sequence[str] = (), *, tun: str | None = None,
                 fd: int | None = None, links: Mapping[str, LinkSpec] | None = None,
                 seed: int | None = None, slots: int | None = None,
                 cache: Path | None = None, realtime: bool = True) -> None:
        if (tun is None) == (fd is None):
            raise ValueError("give exactly one of tun and fd")
        self.prefix, self.tun, self.fd = list(prefix), tun, fd
        self.links = dict(links or {})
        self.seed = seed
        spans = [s.delay_ms + s.jitter_ms for s in self.links.values()]
        self.slots = slots or slots_for(2 * max(spans, default=0.0))
        self.cache = cache
        self.realtime = realtime
        self.proc: subprocess.Popen[str] | None = None
        self.final: dict[str, Any] | None = None
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()

    def argv(self) -> list[str]:
        argv = [*self.prefix, str(binary(self.cache)), "--control", "--slots", str(self.slots)]
        argv += ["--tun", self.tun] if self.tun is not None else ["--fd", str(self.fd)]
        if self.seed is not None:
            argv += ["--seed", str(self.seed)]
        for addr, spec in self.links.items():
            argv += ["--host", f"{addr},{spec.fields().replace(' ', ',')}"]
        return argv

    def start(self, timeout: float = REPLY_TIMEOUT_S) -> LinkEmulator:
        """Start the process and wait until it forwards."""
        pass_fds = () if self.fd is None else (self.fd,)
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, pass_fds=pass_fds)
        if self.realtime:
            _raise_priority(self.proc.pid)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True,
                         name="linkem-stdout").start()
        try:
            self._reply("ready", timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def _reply(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if msg is None:
                raise LinkemError(f"the link emulator ended: {_stderr(self.proc)}")
            if msg.get("event") == "error":
                raise LinkemError(f"the link emulator refused {msg.get('line')!r}")
            if msg.get("event") == event:
                return msg
        raise LinkemError(f"the link emulator did not answer {event!r} within {timeout} s")

    def _command(self, line: str, event: str, timeout: float) -> dict[str, Any]:
        with self._lock:
            if self.proc is None or self.proc.stdin is None or self.proc.poll() is not None:
                raise LinkemError("the link emulator is not running")
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError as exc:
                raise LinkemError(f"the link emulator ended: {_stderr(self.proc)}") from exc
            return self._reply(event, timeout)

    def set(self, addr: str, spec: LinkSpec, timeout: float = REPLY_TIMEOUT_S) -> None:
        """Give the host at `addr` these link settings from now on (queued packets keep
        their release times)."""
        self._command(f"host {addr} {spec.fields()}", "host", timeout)
        self.links[addr] = spec

    def stats(self, reset: bool = False, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """The counters now: packets and bytes read, `sent`, `drops` (loss), `overflow`
        (queue full), `other` (not IPv4, or too long), `write_errors`, `queue_peak`
        (packets) and `queue_peak_bytes`, `late_max_us` and `late_sum_us` (after their
        release times); with `reset`, zeroed after reading."""
        return self._command("reset" if reset else "stats", "stats", timeout)

    def close(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """End the process (idempotent); its last counters, also kept in `final`."""
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return self.final
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()  # its end of input ends it, counters printed
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
        with contextlib.suppress(LinkemError):
            self.final = self._reply("exit", timeout)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        return self.final


def _raise_priority(pid: int) -> None:
    try:
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
    except OSError:  # not root, or no realtime budget (RT throttling, containers)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, NICE)


def _stderr(proc: subprocess.Popen[str] | None) -> str:
    """What an ended emulator said on stderr (it says why it stopped there)."""
    if proc is None or proc.stderr is None:
        return "(no process)"
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "(still running)"
    return proc.stderr.read().strip()[-500:] or f"exit status {proc.returncode}"
