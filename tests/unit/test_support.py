"""The shared test helpers (tests/support) where they hold logic: the waits' deadlines and
messages, the config merge, the loopback-only port and the end-of-run agreement check."""

from __future__ import annotations

import asyncio
import itertools
import queue
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.config import NANO, merged, nano_config, nano_overrides
from tests.support.ports import free_port
from tests.support.swarm import SwarmEvents, assert_one_model
from tests.support.waiting import WaitTimeout, wait_until, wait_until_async


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 2 and "ready", 5, interval=0.001,
                      what="ready") == "ready"


def test_wait_until_names_what_it_waited_for_when_time_runs_out() -> None:
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"after 0\.05 s waiting for the frame \(last: 0\)"):
        wait_until(lambda: 0, 0.05, interval=0.01, what="the frame")
    assert 0.05 <= time.monotonic() - t0 < 1.0
    assert issubclass(WaitTimeout, AssertionError)  # a failed test, not an error


def test_the_async_twin_lets_the_loop_run_and_times_out_alike() -> None:
    async def main() -> None:
        done: list[int] = []
        asyncio.get_running_loop().call_later(0.02, done.append, 1)
        assert await wait_until_async(lambda: done, 5, what="the callback") == [1]
        with pytest.raises(WaitTimeout, match="waiting for nothing"):
            await wait_until_async(lambda: None, 0.03, what="nothing")

    asyncio.run(main())


def test_free_port_is_loopback_only() -> None:
    assert 0 < free_port() < 65536
    for host in ("0.0.0.0", "192.0.2.1", "::"):
        with pytest.raises(ValueError, match="not a loopback address"):
            free_port(host)


def test_overrides_merge_section_by_section_and_leave_the_base_alone(tmp_path: Path) -> None:
    before = merged(NANO, {})
    got = nano_overrides(seed=4, diloco={"pacing": "steps"}, codec={"name": "float32"})
    assert got["diloco"] == {**NANO["diloco"], "pacing": "steps"}
    assert got["seed"] == 4 and got["codec"] == {"name": "float32"}
    got["data"]["seq_len"] = 1
    assert before == NANO
    cfg = nano_config(tmp_path, paths={"trace": True}, data={"batch_size": 6})
    assert cfg.paths.out_dir == tmp_path and cfg.paths.trace
    assert (cfg.model.preset, cfg.device, cfg.data.seq_len, cfg.data.batch_size) == \
        ("nano", "cpu", 32, 6)


def _summary(digest: str, agrees: bool | None = True, **kw: object) -> dict:
    return {"outer_digest": digest, "stopped_early": False, "dropped_peers": [],
            "agreement": {"agrees": agrees, "line": f"verdict {agrees}"}, **kw}


def test_one_model_passes_on_one_digest_that_every_node_confirmed() -> None:
    assert assert_one_model({"node-0": _summary("ab" * 32), "node-1": _summary("ab" * 32)}) \
        == "ab" * 32
    both = [_summary("cd" * 32, worker_id="0"), _summary("cd" * 32, worker_id="1")]
    assert assert_one_model(both) == "cd" * 32  # a sequence is named by worker id
    both[1]["stopped_early"] = True  # it ran no end-of-run check
    with pytest.raises(AssertionError, match="1 stopped before the end of the run"):
        assert_one_model(both)


def test_one_model_fails_on_differing_digests_naming_the_nodes() -> None:
    with pytest.raises(AssertionError, match=r"nodes disagree: node-0 aaaaaaaaaaaa .*"
                                             r"node-1 bbbbbbbbbbbb \(dropped \['p'\]\)"):
        assert_one_model({"node-0": _summary("a" * 64),
                          "node-1": _summary("b" * 64, dropped_peers=["p"])})


@pytest.mark.parametrize("agrees", [False, None])
def test_one_model_fails_when_a_finished_node_did_not_confirm_it(agrees) -> None:
    with pytest.raises(AssertionError, match=f"node-1: the end-of-run check did not agree: "
                                             f"verdict {agrees}"):
        assert_one_model({"node-0": _summary("a" * 64), "node-1": _summary("a" * 64, agrees)})
    with pytest.raises(AssertionError, match="no node summary"):
        assert_one_model({})


def _events(*items: tuple[str, dict]) -> SwarmEvents:
    q: queue.Queue = queue.Queue()
    for item in items:
        q.put(item)
    return SwarmEvents(SimpleNamespace(events=q, out=Path("/runs/x")))  # type: ignore[arg-type]


def test_swarm_events_keep_what_they_read_and_fail_naming_the_wait() -> None:
    ev = _events(("node-0", {"event": "progress", "step": 3}),
                 ("node-1", {"event": "started"}), ("node-0", {"event": "progress", "step": 5}))
    assert ev.progress("node-0", timeout=1) == {"event": "progress", "step": 3}
    ev.until(lambda: ev.step("node-0") >= 5, 1, "node-0 at step 5")
    assert ev.first("node-1", "started") == {"event": "started"}
    with pytest.raises(AssertionError, match=r"node-1 at step 1: not within 0 s; seen "
                                             r"\{'node-0': 2, 'node-1': 1\}"):
        ev.until(lambda: ev.step("node-1") >= 1, 0.02, "node-1 at step 1")
    ended = _events(("node-1", {"event": "eof"}))
    with pytest.raises(AssertionError, match="node-1 exited while waiting for progress of "
                                             "node-0"):
        ended.progress("node-0", timeout=1)
