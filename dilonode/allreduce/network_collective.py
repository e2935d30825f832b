"""`NetworkCollective`: the `Collective` the trainer sees on a networked node.

It runs a `DataPlane` and `SwarmRounds` (`allreduce/retry.py`) on an event loop in a
background thread (`net.loop_thread.LoopThread`, uvloop when installed) and implements
`Collective.begin(request, flat)`; the training thread blocks only in `PendingReduce.wait()`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable

import torch

from dilonode.algo.robust import BanTracker
from dilonode.algo.sliced_encoding import SplicedEncoding
from dilonode.allreduce.plane_limits import PlaneOptions
from dilonode.allreduce.retry import RoundPolicy, SwarmRounds, wire_fragment
from dilonode.allreduce.transport import DataPlane
from dilonode.collective import FormGroup, ReduceResult, RoundReport, RoundRequest, StateSource
from dilonode.net.loop_thread import LoopThread

__all__ = ['NetworkCollective']

log = logging.getLogger(__name__)


class _NetPending:
    """`PendingReduce` backed by a concurrent.futures.Future from the network thread."""

    def __init__(self, fut: concurrent.futures.Future[ReduceResult]) -> None:
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> ReduceResult:
        """Block until the reduction ends; TimeoutError after `timeout` seconds."""
        return self._fut.result(timeout)


class NetworkCollective:
    """`Collective` over the network: a `DataPlane` and `SwarmRounds` in a loop thread.

    `start()` brings up the thread and the plane and returns the plane's address; `close()`
    tears both down. `begin(request, flat)` copies `flat`, so the caller may reuse its
    buffer. SyncKey kind "fragment" uses its fragment index on the wire, kind "grad" the
    reserved index `GRAD_FRAGMENT` (`retry.wire_fragment`).

    `reuse_results=True`: the rounds of one fragment write their results into one buffer,
    so a result is valid only until the next `begin` of the same fragment (the trainer
    lands each round before it starts that fragment's next one). A fresh 40 MB result per
    round costs ~10,000 page faults; reusing it cut a 10M-value round's CPU by ~10%
    (docs/reports/2026-11-23-allreduce-result-buffer.md). `keep_encoded=True`: results
    also carry the encoded values (`ReduceResult.encoded`), which the node serves to joiners.
    """

    def __init__(self, peer_id: str, run_id: str, form_group: FormGroup,
                 policy: RoundPolicy | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 use_uvloop: bool = True, offload: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 plane_options: PlaneOptions | None = None,
                 bans: BanTracker | None = None, reuse_results: bool = False,
                 keep_encoded: bool = False) -> None:
        self.plane = DataPlane(peer_id, run_id, host, port, **(plane_options or {}))
        self.reuse_results = reuse_results
        self._results: dict[int, torch.Tensor] = {}  # fragment -> its result buffer
        self._in_flight: dict[int, concurrent.futures.Future[ReduceResult]] = {}
        self.rounds = SwarmRounds(self.plane, form_group, policy, clock=clock, offload=offload,
                                  bans=bans, keep_encoded=keep_encoded)
        self.thread = LoopThread(f"dilonode-net-{peer_id}", use_uvloop=use_uvloop)

    @property
    def address(self) -> str:
        return self.plane.address

    @property
    def unauthorized_attempts(self) -> int:
        """Data-plane connections refused for failing authentication or authorization
        (credentials go in through `plane_options={"auth": Credentials(...)}`)."""
        return self.plane.unauthorized_attempts

    def start(self, timeout: float = 10.0) -> str:
        self.thread.start()
        self.thread.run(self.plane.start(), timeout)
        return self.plane.address

    def close(self, timeout: float = 5.0) -> None:
        if self.thread.loop is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                self.thread.run(self.plane.aclose(), timeout)
        self.thread.stop()

    def __enter__(self) -> NetworkCollective:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin(self, request: RoundRequest, flat: torch.Tensor, *,
              encoded: SplicedEncoding | None = None,
              state: StateSource | None = None) -> _NetPending:
        """Average `flat` with the swarm in the background; `request` goes down to the
        group former with every attempt. `encoded`: `flat` as a node's ranks already
        encoded it with the round's codec, slice by slice (the round sends those bytes
        instead of encoding again; "mix" rounds travel in float32 and ignore it); `state`:
        our packed outer state, for the state round of a grouped swarm."""
        fragment = wire_fragment(request.key)
        mix_only = request.key.kind == "mix"
        t0 = self.rounds.clock()
        # A copy on flat's own device: on a GPU the round quantizes and reduces there
        # (AllReduceRound's torch data path) and only encoded bytes cross to the host.
        local = flat.detach().to(torch.float32).flatten().clone()
        out = None
        if self.reuse_results and not mix_only:
            out = self._results.get(fragment)
            busy = self._in_flight.get(fragment)
            if busy is not None and not busy.done():  # an abandoned round may still write
                out = None
            elif out is None or out.numel() != local.numel():
                out = self._results[fragment] = torch.empty_like(local)
        fut = self.thread.submit(self._reduce(request, local, t0, out, encoded, state))
        if not mix_only:
            self._in_flight[fragment] = fut
        return _NetPending(fut)

    async def _reduce(self, request: RoundRequest, local: torch.Tensor, t0: float,
                      out_buf: torch.Tensor | None, encoded: SplicedEncoding | None,
                      state: StateSource | None) -> ReduceResult:
        swarm = await self.rounds.reduce(request, local, out_buf, encoded=encoded,
                                         state=state)
        mix_only = request.key.kind == "mix"
        out = swarm.outcome
        assert out.result is not None
        mixed = out if mix_only else swarm.state
        rounds = [*swarm.attempts, *([swarm.state] if swarm.state is not None else [])]
        report = RoundReport(
            group_size=len(out.members),
            payload_bytes_sent=sum(a.payload_bytes_sent for a in rounds),
            payload_bytes_received=sum(a.payload_bytes_received for a in rounds),
            members=tuple(out.members),
            dropped=tuple(f"{peer}: {reason}" for peer, reason in swarm.excluded.items()),
            skipped=out.skipped, attempts=swarm.tries,
            latency_s=self.rounds.clock() - t0, pace_s=swarm.pace_s,
            forming_s=swarm.forming_s,
            rejected=out.rejected, diverged=swarm.diverged, outvoted=swarm.outvoted,
            grouped=swarm.grouped)
        return ReduceResult(
            mean=out.result, report=report, digest=out.digest or "", encoded=out.encoded,
            state_mean=mixed.result if mixed is not None else None,
            state_digest=(mixed.digest or "") if mixed is not None else "")
