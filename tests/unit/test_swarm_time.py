"""Swarm time: the offset from ping samples (the shortest round trip of each peer, the
median over peers), and hivemind reading it once installed, in this process and in a
fork (the offset lives in shared memory)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from dilonode.swarm import swarm_time


def test_the_offset_is_the_median_of_each_peers_best_sample():
    samples = [("a", 30.2, 0.4), ("a", 30.0, 0.01), ("b", 29.0, 0.02), ("b", 50.0, 0.9),
               ("c", 31.0, 0.05)]
    assert swarm_time.estimate_offset(samples) == 30.0
    assert swarm_time.estimate_offset([]) is None
    assert swarm_time.estimate_offset([("a", 5.0, -1.0)]) is None  # no valid round trip


def _child(ready: mp.Event, queue: mp.Queue) -> None:
    from hivemind.utils import get_dht_time

    ready.wait(30)  # the parent has set the offset after forking us
    queue.put(get_dht_time() - time.time())


@pytest.fixture
def restore_offset():
    yield
    swarm_time.set_offset(0.0)


def test_hivemind_reads_swarm_time_here_and_in_a_fork(restore_offset):
    from dilonode.swarm.hivemind_process import import_hivemind

    import_hivemind()
    swarm_time.install(max_offset=120.0)
    import hivemind.dht.protocol as protocol
    from hivemind.utils import get_dht_time

    assert protocol.MAX_DHT_TIME_DISCREPANCY_SECONDS >= 123.0
    swarm_time.set_offset(-42.0)
    assert get_dht_time() - time.time() == pytest.approx(-42.0, abs=0.5)
    ctx = mp.get_context("fork")
    queue: mp.Queue = ctx.Queue()
    ready = ctx.Event()
    child = ctx.Process(target=_child, args=(ready, queue))
    child.start()
    swarm_time.set_offset(7.0)  # after the fork: the child reads the shared value
    ready.set()
    got = queue.get(timeout=30)
    child.join(timeout=30)
    assert got == pytest.approx(7.0, abs=0.5)
