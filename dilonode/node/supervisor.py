"""Supervision of a node's long-lived parts: health checks with a deadline, one-for-one
restarts with exponential backoff and a bound, then a loud exit (STYLE habit 13).

A `Part` has a `name`, `health(timeout)` (returns when healthy, raises otherwise: the
exception's text is the reason) and `restart(timeout)` (brings the part back in place, same
identity and address). `Supervisor.check()` makes one pass over every part; `start()` makes a
pass every `check_interval` seconds on a daemon thread, `close()` stops it. The clock and the
way calls are bounded are injected, so the policy is tested with a fake clock and fake parts
(tests/unit/test_supervise.py), with no sleeping.

The policy, per part (one-for-one: restarting a part never touches the others):

* healthy -> down: one ERROR line with the reason, then an immediate restart. A check that
  only ran out of time (`PartDown(certain=False)`) counts after `unanswered_checks` in a
  row, so a slow moment is not taken for a wedged part;
* still down: another restart once its backoff has passed (`backoff_initial`, doubled after
  each restart, at most `backoff_max`); a failed restart is one WARNING line;
* healthy again: one INFO line saying how long it was down and how many restarts it took;
* down for longer than `give_up_after`, or down for the (`max_outages` + 1)-th time within
  `outage_window` (it keeps dying): `on_fatal(reason)`, once, with a one-line reason, and
  the supervisor stops. The node then writes a checkpoint and exits non-zero, so that
  systemd's Restart=on-failure starts it afresh.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dilonode.config import SuperviseConfig
from dilonode.wire.errors import one_line

__all__ = ["Backoff", "BoundedCall", "Part", "PartDown", "Supervisor", "bounded_call"]

log = logging.getLogger(__name__)


class PartDown(RuntimeError):
    """A part is not healthy; the message says why, on one line.

    `certain=False` marks a check that only ran out of time (a loaded machine can do that
    to a healthy part): such failures count only after `supervise.unanswered_checks` in a
    row. Any other exception from a health check is certain.
    """

    def __init__(self, reason: str, *, certain: bool = True) -> None:
        super().__init__(reason)
        self.certain = certain


class Part(Protocol):
    """A supervised part: see the module docstring."""

    name: str

    def health(self, timeout: float) -> None:
        """Return if healthy within `timeout` seconds; raise (any exception) if not."""
        ...

    def restart(self, timeout: float) -> None:
        """Bring the part back in place within `timeout` seconds; raise if it failed."""
        ...


# How a part's call is bounded: (call, timeout) -> None, raising PartDown on overrun.
BoundedCall = Callable[[Callable[[float], None], float], None]


def bounded_call(fn: Callable[[float], None], timeout: float) -> None:
    """Run `fn(timeout)` on a daemon thread and wait at most `timeout` plus a second.

    Parts bound their own calls; this is the backstop for one that does not (a call stuck
    in a C extension), so one wedged part cannot stop the supervisor from checking the
    others or from giving up. The thread of a call that overran is left behind.
    """
    box: list[BaseException] = []

    def target() -> None:
        try:
            fn(timeout)
        except BaseException as exc:  # handed to the caller's thread as is
            box.append(exc)

    thread = threading.Thread(target=target, name="dilonode-supervise-call", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    if thread.is_alive():
        raise PartDown(f"no answer within {timeout:g}s", certain=False)
    if box:
        raise box[0]


@dataclass
class Backoff:
    """Exponential backoff: `next()` gives the wait before the next try and doubles it."""

    initial: float
    maximum: float
    _current: float = 0.0

    def next(self) -> float:
        self._current = (self.initial if self._current == 0.0
                         else min(self._current * 2.0, self.maximum))
        return self._current

    def reset(self) -> None:
        self._current = 0.0


@dataclass
class _PartState:
    """What the supervisor knows about one part."""

    backoff: Backoff
    down_since: float | None = None  # None: healthy
    strikes: int = 0  # uncertain failed checks in a row while healthy
    reason: str = ""
    next_restart: float = 0.0
    restarts: int = 0  # in the current episode of being down
    total_restarts: int = 0
    outages: deque[float] = field(default_factory=deque)  # when each began
    last_heal_s: float | None = None  # how long the last episode lasted


class Supervisor:
    """Watches `parts`; see the module docstring for the policy."""

    def __init__(self, parts: Sequence[Part], cfg: SuperviseConfig,
                 on_fatal: Callable[[str], None], *,
                 clock: Callable[[], float] = time.monotonic,
                 call: BoundedCall = bounded_call,
                 on_change: Callable[[str, bool], None] | None = None) -> None:
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"part names must be unique: {names}")
        self.parts = list(parts)
        self.cfg = cfg
        self.on_fatal = on_fatal
        self.clock = clock
        self.call = call
        self.on_change = on_change  # (part, down) when a part goes down or heals
        self.failure: str | None = None  # the reason given to on_fatal, once given
        self._state = {p.name: _PartState(Backoff(cfg.backoff_initial, cfg.backoff_max))
                       for p in parts}
        self._lock = threading.Lock()  # snapshot() reads from other threads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Check every part every `check_interval` seconds on a daemon thread."""
        self._thread = threading.Thread(target=self._loop, name="dilonode-supervisor",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop checking (idempotent); a restart under way is left to finish on its own."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.check_interval):
            self.check()

    # -- one pass --------------------------------------------------------------------------
    def check(self) -> None:
        """Check every part once; restart or give up as the policy says."""
        for part in self.parts:
            if self.failure is not None or self._stop.is_set():
                return
            self._check_part(part)

    def _check_part(self, part: Part) -> None:
        st = self._state[part.name]
        try:
            self.call(part.health, self.cfg.check_timeout)
        except Exception as exc:
            st.strikes += 1
            if (st.down_since is not None or getattr(exc, "certain", True)
                    or st.strikes >= self.cfg.unanswered_checks):
                self._down(part, st, _reason(exc))
            else:
                log.warning("%s did not answer its health check: %s", part.name, _reason(exc))
            return
        st.strikes = 0
        if st.down_since is not None:
            self._healed(part, st)

    def _down(self, part: Part, st: _PartState, reason: str) -> None:
        now = self.clock()
        with self._lock:
            first = st.down_since is None
            if first:
                st.down_since, st.next_restart = now, now
                st.outages.append(now)
            st.reason = reason
        if first:
            log.error("%s is down: %s; restarting it", part.name, reason)
            self._changed(part.name, True)
        if (why := self._give_up_reason(part, st, now)) is not None:
            self._fatal(why)
        elif now >= st.next_restart:
            self._restart(part, st, now)

    def _give_up_reason(self, part: Part, st: _PartState, now: float) -> str | None:
        assert st.down_since is not None
        down_for = now - st.down_since
        if down_for > self.cfg.give_up_after:
            return (f"{part.name} down for {down_for:.0f}s after {st.restarts} restart(s) "
                    f"(supervise.give_up_after = {self.cfg.give_up_after:g}): {st.reason}")
        while st.outages and now - st.outages[0] > self.cfg.outage_window:
            st.outages.popleft()
        if len(st.outages) > self.cfg.max_outages:
            return (f"{part.name} went down {len(st.outages)} times within "
                    f"{self.cfg.outage_window:g}s (supervise.max_outages = "
                    f"{self.cfg.max_outages}): {st.reason}")
        return None

    def _restart(self, part: Part, st: _PartState, now: float) -> None:
        with self._lock:
            st.restarts += 1
            st.total_restarts += 1
            st.next_restart = now + st.backoff.next()
        t0 = self.clock()
        try:
            self.call(part.restart, self.cfg.restart_timeout)
        except Exception as exc:
            log.warning("restart %d of %s failed after %.1fs: %s (next try in %.0fs)",
                        st.restarts, part.name, self.clock() - t0, _reason(exc),
                        max(st.next_restart - self.clock(), 0.0))
            return
        log.info("restarted %s in %.1fs (restart %d)", part.name, self.clock() - t0,
                 st.restarts)

    def _healed(self, part: Part, st: _PartState) -> None:
        assert st.down_since is not None
        took = self.clock() - st.down_since
        log.info("%s is healthy again after %.1fs down (%d restart(s))", part.name, took,
                 st.restarts)
        with self._lock:
            st.down_since, st.reason, st.restarts = None, "", 0
            st.last_heal_s = took
            st.backoff.reset()
        self._changed(part.name, False)

    def _changed(self, name: str, down: bool) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(name, down)
        except Exception as exc:  # the node's reaction must not stop the supervision
            log.warning("reacting to %s %s failed: %s", name, "down" if down else "healthy",
                        _reason(exc))

    def is_down(self, name: str) -> bool:
        """Whether part `name` is in an outage now (False for an unknown name)."""
        return self.down_for(name) is not None

    def down_for(self, name: str) -> float | None:
        """Seconds part `name` has been down, or None while it is healthy (or unknown)."""
        st = self._state.get(name)
        since = st.down_since if st is not None else None
        return None if since is None else self.clock() - since

    def _fatal(self, reason: str) -> None:
        with self._lock:
            self.failure = reason
        self._stop.set()
        log.error("giving up: %s", reason)
        self.on_fatal(reason)

    # -- readers ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Per part: "ok" or "down", why, restarts, how long the last outage lasted; plus
        the reason the node gave up, if it did. JSON-ready, for the status endpoint."""
        now = self.clock()
        with self._lock:
            parts = {name: {"state": "ok" if st.down_since is None else "down",
                            "down_s": None if st.down_since is None
                            else round(now - st.down_since, 1),
                            "reason": st.reason or None, "restarts": st.total_restarts,
                            "last_outage_s": None if st.last_heal_s is None
                            else round(st.last_heal_s, 1)}
                     for name, st in self._state.items()}
            return {"parts": parts, "failure": self.failure}


def _reason(exc: BaseException) -> str:
    """One line naming what went wrong (the exception's text, else its type)."""
    text = str(exc).strip()
    return one_line(text if text else type(exc).__name__)
