"""The supervisor's policy with a fake clock and fake parts: one ERROR line per outage, an
immediate first restart, exponential backoff, one-for-one, a bounded outage or restart rate
ends in one call to on_fatal with a one-line reason. No sleeping, no threads (the calls are
made directly)."""

from __future__ import annotations

import logging

import pytest

from dilonode.config import ConfigError, SuperviseConfig, load_config
from dilonode.node.supervisor import Backoff, PartDown, Supervisor, bounded_call


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakePart:
    """Healthy unless `broken`; a restart heals it unless `restart_fails`."""

    def __init__(self, name: str, clock: Clock | None = None) -> None:
        self.name = name
        self.broken = False
        self.restart_fails = False
        self.restarts: list[float] = []
        self.clock = clock

    def health(self, timeout: float) -> None:
        if self.broken:
            raise PartDown(f"{self.name} is broken\nsecond line")

    def restart(self, timeout: float) -> None:
        self.restarts.append(self.clock() if self.clock else 0.0)
        if self.restart_fails:
            raise OSError("address already in use")
        self.broken = False


def direct(fn, timeout):
    fn(timeout)


CFG = SuperviseConfig(check_interval=1.0, check_timeout=2.0, backoff_initial=1.0,
                      backoff_max=8.0, give_up_after=60.0, max_outages=5,
                      outage_window=300.0)


def make(*names: str, cfg: SuperviseConfig = CFG):
    clock = Clock()
    parts = [FakePart(n, clock) for n in names]
    fatal: list[str] = []
    sup = Supervisor(parts, cfg, fatal.append, clock=clock, call=direct)
    return sup, clock, parts, fatal


def test_healthy_parts_are_left_alone():
    sup, clock, (a, b), fatal = make("a", "b")
    for _ in range(10):
        sup.check()
        clock.t += 1
    assert a.restarts == b.restarts == [] and fatal == []
    assert sup.snapshot()["parts"]["a"] == {"state": "ok", "down_s": None, "reason": None,
                                            "restarts": 0, "last_outage_s": None}


def test_one_error_line_an_immediate_restart_and_a_heal_line(caplog):
    sup, clock, (a, b), fatal = make("a", "b")
    a.broken = True
    with caplog.at_level(logging.INFO, logger="dilonode.node.supervisor"):
        sup.check()
        clock.t += 1
        sup.check()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].getMessage() == "a is down: a is broken second line; restarting it"
    assert a.restarts == [1000.0] and b.restarts == []  # one-for-one
    assert any("a is healthy again after 1.0s down (1 restart(s))" in r.getMessage()
               for r in caplog.records)
    snap = sup.snapshot()["parts"]["a"]
    assert snap["state"] == "ok" and snap["restarts"] == 1 and snap["last_outage_s"] == 1.0
    assert fatal == []


def test_failed_restarts_back_off_exponentially_up_to_the_maximum():
    sup, clock, (a,), fatal = make("a")
    a.broken, a.restart_fails = True, True
    for _ in range(50):
        sup.check()
        clock.t += 0.5
    gaps = [t1 - t0 for t0, t1 in zip(a.restarts, a.restarts[1:], strict=False)]
    # first restart at once, then waits of 1, 2, 4, 8, 8 ... s (checks every 0.5 s)
    assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 8.0], gaps
    assert sup.snapshot()["parts"]["a"]["state"] == "down"
    assert fatal == []


def test_a_part_down_too_long_gives_up_once_with_a_one_line_reason():
    sup, clock, (a, b), fatal = make("a", "b")
    a.broken, a.restart_fails = True, True
    for _ in range(200):
        sup.check()
        clock.t += 1
    assert len(fatal) == 1
    assert "\n" not in fatal[0]
    assert fatal[0].startswith("a down for 61s after ")
    assert "supervise.give_up_after = 60" in fatal[0] and "a is broken" in fatal[0]
    assert sup.failure == fatal[0]
    assert sup.snapshot()["failure"] == fatal[0]
    restarts = len(a.restarts)
    sup.check()  # stopped: nothing more happens
    assert len(a.restarts) == restarts and len(fatal) == 1


def test_a_part_that_keeps_dying_gives_up_on_the_outage_rate():
    sup, clock, (a,), fatal = make("a")
    for _ in range(20):
        a.broken = True  # dies again after every heal
        sup.check()  # down: restarted, healed
        clock.t += 1
        sup.check()  # healthy
        clock.t += 1
        if fatal:
            break
    assert len(a.restarts) == CFG.max_outages  # the sixth outage is not ridden out
    assert len(fatal) == 1 and "went down 6 times within 300s" in fatal[0]
    assert "supervise.max_outages = 5" in fatal[0]


def test_outages_outside_the_window_do_not_count():
    sup, clock, (a,), fatal = make("a")
    for _ in range(12):
        a.broken = True
        sup.check()
        clock.t += 100  # one death every 100 s: at most 3 within the 300 s window
        sup.check()
    assert fatal == [] and len(a.restarts) == 12


def test_a_health_check_that_hangs_counts_as_down():
    def hangs(timeout: float) -> None:
        import threading

        threading.Event().wait(timeout + 5)

    with pytest.raises(PartDown, match="no answer within 0.05s"):
        bounded_call(hangs, 0.05)
    with pytest.raises(OSError, match="boom"):
        bounded_call(lambda t: (_ for _ in ()).throw(OSError("boom")), 1.0)
    bounded_call(lambda t: None, 1.0)


def test_backoff_doubles_and_resets():
    b = Backoff(0.5, 3.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next() == 0.5


def test_config_is_validated_in_one_line_per_problem():
    with pytest.raises(ConfigError, match="supervise.backoff_max = 1.0: must be >= "):
        load_config(overrides={"supervise": {"backoff_initial": 2.0, "backoff_max": 1.0}})
    with pytest.raises(ConfigError, match="supervise.give_up_after"):
        load_config(overrides={"supervise": {"give_up_after": 1.0, "check_timeout": 5.0}})
    with pytest.raises(ConfigError, match="supervise.check_interval"):
        load_config(overrides={"supervise": {"check_interval": 0}})
    with pytest.raises(ValueError, match="unique"):
        Supervisor([FakePart("a"), FakePart("a")], CFG, print)


def test_a_check_that_only_ran_out_of_time_counts_after_unanswered_checks(caplog):
    sup, clock, (a,), fatal = make("a", cfg=CFG.model_copy(update={"unanswered_checks": 2}))
    slow = {"on": True}

    def health(timeout: float) -> None:
        if slow["on"]:
            raise PartDown("a did not answer within 2s", certain=False)

    a.health = health
    with caplog.at_level(logging.WARNING, logger="dilonode.node.supervisor"):
        sup.check()  # one slow answer: a warning, no restart
        assert a.restarts == [] and "did not answer its health check" in caplog.text
        slow["on"] = False
        sup.check()  # answered again: the strikes start over
        slow["on"] = True
        sup.check()
        assert a.restarts == []
        sup.check()  # two in a row: down, restarted
    assert len(a.restarts) == 1
    assert [r.levelno for r in caplog.records].count(logging.ERROR) == 1


def test_on_change_hears_of_each_outage_once_and_of_its_end():
    clock = Clock()
    part = FakePart("data", clock)
    changes = []
    sup = Supervisor([part], CFG, print, clock=clock, call=direct,
                     on_change=lambda name, down: changes.append((name, down)))
    part.broken, part.restart_fails = True, True
    for _ in range(3):
        sup.check()
        clock.t += 2
        assert sup.is_down("data")
    part.broken = False
    sup.check()
    assert changes == [("data", True), ("data", False)]
    assert not sup.is_down("data") and not sup.is_down("nothing")
    assert sup.down_for("data") is None
