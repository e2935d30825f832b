"""A joiner's fetch overtaken by a round, and its publish overlapped with the transfer
(127.0.0.1, servers in this process behind bandwidth-limited proxies).

* A round lands on every server mid-fetch: the joiner switches to the new state before it
  fetches the changed fragment (fetched last, being the next to land), carries over the
  chunks it has, and ends bit for bit on the new state without fetching that fragment twice.
* A round that lands late in the fetch, when most of the changed fragment has arrived, is
  replayed from its encoded result instead (and a replay that does not hash to the new
  state is not kept: the fragment is fetched). A result is replayed as soon as it has
  arrived, while the rest of the fetch goes on.
* With `final_lead`, `before_final` (publish and wait) starts while chunks are still coming,
  and the recovery needs no extra manifest pass for it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable

import pytest
import torch

from dilonode.algo.codecs import get_codec
from dilonode.algo.replay import EncodedResult, replay_round, replayer
from dilonode.config import load_config
from dilonode.statesync.client import Recovery, recover
from dilonode.statesync.server import SnapshotSource, StateServer
from dilonode.train.state import WorkerState, config_digest
from tests.integration.test_join import _assert_same, _state
from tests.support.waiting import wait_until_async

CFG = load_config(overrides={"statesync": {"chunk_bytes": 16384, "request_timeout": 5.0,
                                           "snapshot_wait": 1.0, "window": 2}})
DIGEST = config_digest(CFG)
RATE = 1_000_000  # bytes/s per server (3 servers: ~3 MB/s for the joiner)
OLD = _state(1, numel=250_000)  # 6 MB, rounds (7, 7, 6): fragment 2 lands next


def _landed(state: WorkerState, p: int) -> WorkerState:
    """`state` after one more round of fragment `p` (new weights and momentum)."""
    g = torch.Generator().manual_seed(99)
    tensors = dict(state.tensors)
    for k in ("weights", "momentum"):
        name = f"outer.{p}.{k}"
        tensors[name] = tensors[name] + torch.randn(tensors[name].shape, generator=g)
    rounds = tuple(r + (i == p) for i, r in enumerate(state.rounds))
    return WorkerState(state.step + 30, rounds, rounds, tensors)


A = CFG.diloco.effective()
STEP = functools.partial(replay_round, lr=A.outer_lr, momentum_coef=A.outer_momentum,
                         nesterov=A.outer_nesterov)
REPLAYER = replayer(lambda _p, _r: A.outer_lr, A.outer_momentum, A.outer_nesterov)


def _replayed(state: WorkerState, p: int, served: int = 0, seed: int = 5,
              codec_name: str = "int4") -> WorkerState:
    """`state` after a real outer step on fragment `p` with an int4 (or `codec_name`)
    result, which it serves as the replay after those `state` serves (`served` != 0: a
    different result is served than was applied)."""
    codec = get_codec(codec_name, 64)

    def encoded(seed: int) -> EncodedResult:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(state.tensors[f"outer.{p}.weights"].numel(), generator=g) * 0.01
        return EncodedResult.of_pieces(codec_name, 64, tuple((len(x[a:a + 65536]),
                                                         codec.encode(x[a:a + 65536])[0])
                                                        for a in range(0, x.numel(), 65536)))

    applied = encoded(seed)
    w, m = STEP(state.tensors[f"outer.{p}.weights"], state.tensors[f"outer.{p}.momentum"],
                applied)
    tensors = {**state.tensors, f"outer.{p}.weights": w, f"outer.{p}.momentum": m}
    rounds = tuple(r + (i == p) for i, r in enumerate(state.rounds))
    return WorkerState(state.step + 30, rounds, rounds, tensors,
                       replays={**state.replays, p: (*state.replays.get(p, ()),
                                                     encoded(served) if served else applied)})


class _Worker:
    """Serves `state`, which the test may replace (a round landing) at any time."""

    def __init__(self, state: WorkerState) -> None:
        self.state, self.pending = state, {}
        self.lock = threading.Lock()

    @property
    def step(self) -> int:
        return self.state.step

    def export_state(self, reuse: WorkerState | None = None) -> WorkerState:
        with self.lock:
            return self.state


async def _throttled(target: str) -> tuple[asyncio.Server, str]:
    """A proxy to `target` that carries replies at RATE bytes/s."""
    host, port = target.rsplit(":", 1)

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, rate: bool) -> None:
        try:
            while data := await src.read(8192):
                dst.write(data)
                await dst.drain()
                if rate:
                    await asyncio.sleep(len(data) / RATE)
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pump(reader, up_w, False), pump(up_r, writer, True),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


Job = Callable[[dict[str, str], list[StateServer], list[_Worker]], Awaitable[Recovery | None]]


def _run(job: Job) -> tuple[Recovery | None, list[StateServer]]:
    workers = [_Worker(OLD) for _ in range(3)]
    servers = [StateServer(SnapshotSource(w), CFG.run_id, DIGEST, CFG.statesync,
                           peer_id=f"p{i}") for i, w in enumerate(workers)]

    async def main() -> Recovery | None:
        proxies = []
        try:
            peers = {}
            for s in servers:
                proxy, addr = await _throttled(await s.start())
                proxies.append(proxy)
                peers[s.peer_id] = addr
            return await asyncio.wait_for(job(peers, servers, workers), 60)
        finally:
            for p in proxies:
                p.close()
            for s in servers:
                await s.aclose()

    return asyncio.run(main()), servers


@pytest.mark.timeout(90)
def test_round_landing_mid_fetch_switches_to_the_new_state_without_refetching():
    new = _landed(OLD, 2)
    fragment_bytes = 2 * new.tensors["outer.2.weights"].numel() * 4

    async def job(peers, servers, workers) -> Recovery | None:
        async def land_when_a_fifth_is_served() -> None:
            await wait_until_async(
                lambda: sum(s.bytes_served for s in servers) >= OLD.nbytes // 5, 60,
                interval=0.02, what="a fifth of the state served")
            for w in workers:
                with w.lock:
                    w.state = new

        lander = asyncio.create_task(land_when_a_fifth_is_served())
        rec = await recover(peers, None, CFG.run_id, DIGEST, CFG.statesync, peer_id="joiner")
        assert lander.done()
        return rec

    rec, _ = _run(job)
    assert rec is not None
    _assert_same(rec.state, new, "recovered vs the state after the round")
    assert rec.state.step == new.step
    # Without the switch: all of OLD, then fragment 2 again (nbytes + fragment_bytes).
    assert rec.fetched_bytes < new.nbytes + fragment_bytes // 4, (rec.fetched_bytes,
                                                                  new.nbytes)


@pytest.mark.timeout(90)
def test_publish_wait_overlaps_the_end_of_the_transfer():
    lead = 1.0
    served_at_publish: list[int] = []

    async def job(peers, servers, workers) -> Recovery | None:
        async def before_final() -> None:
            served_at_publish.append(sum(s.bytes_served for s in servers))
            await asyncio.sleep(lead)

        return await recover(peers, None, CFG.run_id, DIGEST, CFG.statesync,
                             before_final=before_final, peer_id="joiner", final_lead=lead)

    rec, servers = _run(job)
    assert rec is not None
    _assert_same(rec.state, OLD, "recovered vs served")
    assert len(served_at_publish) == 1
    # started while chunks were still coming (~1 s before the end of ~2 s at ~3 MB/s)
    assert OLD.nbytes // 5 < served_at_publish[0] < OLD.nbytes, served_at_publish
    # ...and then one pass for the floor: manifests, fetch, manifests after the wait
    assert rec.passes == 2, rec.passes
    assert rec.seconds < rec.fetch_seconds + lead, (rec.seconds, rec.fetch_seconds)


@pytest.mark.timeout(60)
def test_manifest_current_step_is_the_servers_step_when_asked():
    """Not the step of the snapshot taken afterwards: a round started in between may
    already count the joiner, and a floor including it would wait for it to land."""
    class _Ahead(_Worker):
        step = 57  # the trainer's step now; the served state's adoption step is OLD.step

    async def main() -> int:
        server = StateServer(SnapshotSource(_Ahead(OLD)), CFG.run_id, DIGEST, CFG.statesync,
                             peer_id="p0")
        addr = await server.start()
        try:
            from dilonode.statesync.link import Link
            from dilonode.statesync.protocol import Manifest, ManifestRequest

            link = await Link.connect(addr, None, CFG.run_id, "joiner", "p0", 5.0)
            link.send(ManifestRequest(run_id=CFG.run_id))
            msg = await link.recv()
            link.close()
            assert isinstance(msg, Manifest) and msg.step == OLD.step
            return msg.current_step
        finally:
            await server.aclose()

    assert asyncio.run(main()) == 57


def _land_during(landings: list[tuple[float, WorkerState]], replayer=REPLAYER) -> Recovery:
    """Recover while each state of `landings` lands on every server once that share of
    OLD has been served; the joiner must end on the last one, bit for bit."""
    async def job(peers, servers, workers) -> Recovery | None:
        async def land() -> None:
            for share, state in landings:
                await wait_until_async(
                    lambda share=share: sum(s.bytes_served for s in servers)
                    >= OLD.nbytes * share, 60, what=f"{share:.0%} of the state served")
                for w in workers:
                    with w.lock:
                        w.state = state

        lander = asyncio.create_task(land())
        rec = await recover(peers, None, CFG.run_id, DIGEST, CFG.statesync, peer_id="joiner",
                            replayer=replayer)
        assert lander.done()
        return rec

    rec, _ = _run(job)
    assert rec is not None
    _assert_same(rec.state, landings[-1][1], "recovered vs the state after the rounds")
    return rec


def _land_late(new: WorkerState, replayer=REPLAYER) -> Recovery:
    """`new` lands once 85% of OLD has been served (the changed fragment, fetched last,
    about half fetched by then)."""
    return _land_during([(0.85, new)], replayer)


@pytest.mark.timeout(90)
def test_a_round_landing_late_is_replayed_not_fetched_again():
    new = _replayed(OLD, 2)
    fragment_bytes = 2 * new.tensors["outer.2.weights"].numel() * 4
    rec = _land_late(new)
    assert rec.replayed == 1
    # Fetching it again costs the ~half of fragment 2 already fetched; the replay the
    # int4 result (an eighth of the weights), the rest being fetched at the new version.
    assert rec.fetched_bytes < OLD.nbytes + fragment_bytes // 4, (rec.fetched_bytes,
                                                                  OLD.nbytes)


@pytest.mark.timeout(90)
def test_a_topk_round_landing_late_is_replayed_too():
    """A top-k round's result (positions and values, pieces of whole 4096-value chunks)
    is served, fetched and replayed like a dense one."""
    rec = _land_late(_replayed(OLD, 2, codec_name="topk64_int2"))
    assert rec.replayed == 1


@pytest.mark.timeout(90)
def test_a_result_is_replayed_while_the_rest_of_the_fetch_goes_on(caplog):
    """The joiner holds fragment 2 a round old and fragment 0 different from the peers':
    it fetches fragment 2's result first, replays it while fragment 0's chunks are still
    coming (its peers wait for it from its publish on, so nothing is left for after the
    transfer), and ends bit for bit on the peers' state."""
    caplog.set_level("INFO", logger="dilonode.statesync.client")
    new = _replayed(OLD, 2)
    g = torch.Generator().manual_seed(7)
    local = WorkerState(OLD.step, OLD.rounds, OLD.outer_steps,
                        {**OLD.tensors, **{f"outer.0.{k}": torch.randn_like(OLD.tensors[
                            f"outer.0.{k}"], generator=g) for k in ("weights", "momentum")}})

    async def job(peers, servers, workers) -> Recovery | None:
        for w in workers:
            w.state = new
        return await recover(peers, local, CFG.run_id, DIGEST, CFG.statesync,
                             peer_id="joiner", replayer=REPLAYER)

    rec, _ = _run(job)
    assert rec is not None and rec.replayed == 1
    _assert_same(rec.state, new, "recovered vs the peers' state")
    fragment_bytes = 2 * new.tensors["outer.0.weights"].numel() * 4
    assert rec.fetched_bytes < fragment_bytes * 1.2, (rec.fetched_bytes, fragment_bytes)
    assert "replayed rounds 6-6" in caplog.text and "; 0 after the transfer)" in caplog.text


@pytest.mark.timeout(90)
def test_a_replay_that_does_not_match_the_new_state_is_dropped_for_a_fetch(caplog):
    caplog.set_level("INFO", logger="dilonode.statesync.client")
    rec = _land_late(_replayed(OLD, 2, served=6))
    assert rec.replayed == 0
    assert "digests differ" in caplog.text


def _land_often(replayer) -> tuple[Recovery, WorkerState]:
    """Six rounds (two per fragment, real int4 results, each server keeping all of them)
    land one after the other as OLD is served: a joiner slower than the rounds, whose
    fetch every fragment outruns."""
    states = [OLD]
    for k, p in enumerate([2, 0, 1, 2, 0, 1]):
        states.append(_replayed(states[-1], p, seed=10 + k))
    landings = [((k + 1) * 0.15, state) for k, state in enumerate(states[1:])]
    return _land_during(landings, replayer), states[-1]


@pytest.mark.timeout(120)
def test_rounds_landing_all_through_a_slow_fetch_are_replayed_on_the_chunks_held():
    replayed, final = _land_often(REPLAYER)
    fetched_again, _ = _land_often(None)
    assert replayed.replayed >= 2
    results = sum(len(enc.blob()) for kept in final.replays.values() for enc in kept)
    # Replays cost the results (an eighth of a fragment's weights each) where fetching
    # again costs whatever part of a fragment a round overtook.
    assert replayed.fetched_bytes < fetched_again.fetched_bytes - results, \
        (replayed.fetched_bytes, fetched_again.fetched_bytes, results, OLD.nbytes)


@pytest.mark.timeout(90)
def test_a_joiner_reports_the_rate_its_link_moved_and_the_round_results_once(monkeypatch):
    """What the node asks the swarm clock for (`pacing.link_busy_seconds`) comes from this
    report: the rate chunks arrived at through the throttled proxies (3 x RATE, not
    loopback's hundreds of MB/s), each fragment's result bytes the manifests list, and the
    peers counting the joiner."""
    from dilonode.statesync import client as service

    # The fetch takes ~2 s here.
    monkeypatch.setattr(service, "_LINK_FROM_S", 0.3)
    monkeypatch.setattr(service, "_LINK_AFTER_S", 1.5)
    served = _replayed(OLD, 2)
    reports: list[tuple[float, dict[int, int], int]] = []

    async def job(peers, servers, workers) -> Recovery | None:
        for w in workers:
            w.state = served
        return await recover(peers, None, CFG.run_id, DIGEST, CFG.statesync, peer_id="joiner",
                             on_link=lambda *report: reports.append(report))

    rec, _ = _run(job)
    assert rec is not None
    _assert_same(rec.state, served, "recovered vs served")
    assert len(reports) == 1, reports
    rate, sizes, peers = reports[0]
    assert 0.3 * 3 * RATE < rate < 1.3 * 3 * RATE, rate
    assert sizes == {2: len(served.replays[2][-1].blob())} and peers == 4
