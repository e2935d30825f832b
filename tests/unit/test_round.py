"""Tests of the sans-IO all-reduce round, driven over MemNet or by hand with a fake clock."""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from dilonode import PROTOCOL_VERSION
from dilonode.algo.butterfly import part_bounds, reduce_mean
from dilonode.algo.codecs import CodecMeta, get_codec, max_abs_error_bound
from dilonode.allreduce.memnet import Faults, MemNet
from dilonode.allreduce.round import (
    AllReduceRound,
    Done,
    Failed,
    GroupSpec,
    RoundState,
    Send,
    chunk_hash,
    group_digest,
    part_digest,
    result_digest,
)
from dilonode.wire.errors import LocalProtocolError
from dilonode.wire.framing import encode_frame
from dilonode.wire.messages import Abort, Contribution, Hello, Message, Result

TIMEOUT = 30.0


def make_spec(n: int, numel: int = 1000, *, codec: str = "float32", block_size: int = 64,
              chunk_numel: int = 128, weights: Sequence[float] | None = None) -> GroupSpec:
    return GroupSpec(run_id="run-a", fragment=1, round=9,
                     members=tuple(f"peer-{i}" for i in range(n)),
                     weights=tuple(weights) if weights is not None else (1.0,) * n,
                     numel=numel, codec=codec, block_size=block_size, chunk_numel=chunk_numel)


def make_inputs(spec: GroupSpec, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(spec.numel, generator=gen) * (i + 1) for i in range(spec.size)]


def make_rounds(spec: GroupSpec, xs: list[torch.Tensor]) -> list[AllReduceRound]:
    return [AllReduceRound(spec, i, x, timeout=TIMEOUT) for i, x in enumerate(xs)]


def run_net(spec: GroupSpec, faults: Faults | None = None, seed: int = 0, wire: bool = True,
            ) -> tuple[list[AllReduceRound], MemNet, list[torch.Tensor]]:
    xs = make_inputs(spec, seed)
    rounds = make_rounds(spec, xs)
    net = MemNet(rounds, faults, start=100.0, wire=wire)
    net.run()
    return rounds, net, xs


def reference(spec: GroupSpec, xs: list[torch.Tensor]) -> torch.Tensor:
    """The protocol written out independently: per chunk, quantize, mean, quantize."""
    codec = get_codec(spec.codec, spec.block_size)

    def qd(t: torch.Tensor) -> torch.Tensor:
        return codec.decode(*codec.encode(t))

    out = torch.empty(spec.numel)
    for start, end in part_bounds(spec.numel, spec.weights, align=spec.align):
        for a in range(start, end, spec.chunk_numel):
            b = min(a + spec.chunk_numel, end)
            out[a:b] = qd(reduce_mean([qd(x[a:b]) for x in xs]))
    return out


def assert_all_failed(rounds: list[AllReduceRound], net: MemNet) -> None:
    assert all(r.state is RoundState.FAILED for r in rounds)
    assert not any(isinstance(o, Done) for o in net.outcomes.values())
    for r in rounds:
        with pytest.raises(LocalProtocolError):
            _ = r.result


# ---------------------------------------------------------------------- correct averages

WEIGHTS = {
    1: [(1.0,)],
    2: [(1.0, 1.0), (1.0, 3.0)],
    3: [(1.0, 1.0, 1.0), (5.0, 1.0, 2.5), (1.0, 0.0, 1.0)],
    4: [(1.0,) * 4, (0.1, 0.2, 0.3, 0.4)],
    5: [(1.0,) * 5, (100.0, 1.0, 1.0, 1.0, 7.0)],
}


@pytest.mark.parametrize(("n", "weights"),
                         [(n, w) for n, ws in WEIGHTS.items() for w in ws])
def test_float32_equals_plain_mean(n: int, weights: tuple[float, ...]) -> None:
    spec = make_spec(n, numel=1000, weights=weights)
    rounds, net, xs = run_net(spec)
    expected = reduce_mean(xs)
    for i, r in enumerate(rounds):
        assert r.state is RoundState.DONE, net.outcomes.get(i)
        assert torch.equal(r.result, expected)
        assert r.digest == result_digest(expected, spec)
        assert net.outcomes[i] == Done(r.digest)


@pytest.mark.parametrize("codec", ["int4", "int8", "fp4", "bfloat16"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_quantized_members_agree_bitwise_and_stay_within_bound(codec: str, n: int) -> None:
    spec = make_spec(n, numel=999, codec=codec, block_size=32, chunk_numel=96,
                     weights=[1.0 + i for i in range(n)])
    rounds, net, xs = run_net(spec)
    assert {r.digest for r in rounds} == {rounds[0].digest}
    got = rounds[0].result
    assert torch.equal(got, reference(spec, xs))
    codec_obj = get_codec(codec, 32)
    quantized = [codec_obj.decode(*codec_obj.encode(x)) for x in xs]
    mean_q = reduce_mean(quantized)
    true_mean = reduce_mean(xs).double()
    bound = (max_abs_error_bound(codec_obj, mean_q)
             + sum(max_abs_error_bound(codec_obj, x) for x in xs) / n
             + 1e-6 * true_mean.abs() + 1e-30)
    assert bool(((got.double() - true_mean).abs() <= bound).all())


@pytest.mark.parametrize("path", ["host", "torch"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_topk_members_agree_bitwise_with_exact_bytes(n: int, path: str) -> None:
    """Each member sends its own top-k of every other part; each owner sends back the top-k
    of its float32 mean: parts and chunks cut at the 4096-value top-k chunks."""
    spec = make_spec(n, numel=7 * 4096 + 300, codec="topk64_int2", block_size=64,
                     chunk_numel=2 * 4096, weights=[1.0 + i for i in range(n)])
    assert all(a % 4096 == 0 for a, _ in spec.parts)
    xs = make_inputs(spec)
    rounds = [AllReduceRound(spec, i, x, timeout=TIMEOUT, data_path=path)
              for i, x in enumerate(xs)]
    MemNet(rounds, None, start=100.0).run()
    expected = reference(spec, xs)
    codec = spec.codec_obj
    for i, r in enumerate(rounds):
        assert r.state is RoundState.DONE and torch.equal(r.result, expected)
        assert r.digest == rounds[0].digest == result_digest(expected, spec)
        mine = spec.parts[i]
        own, others = [0], [0]
        for j, (a, b) in enumerate(spec.parts):
            for c in range(a, b, spec.chunk_numel):
                size = codec.encoded_size(min(spec.chunk_numel, b - c))
                (own if j == i else others)[0] += size
        assert r.payload_bytes_sent == others[0] + (n - 1) * own[0], mine
    # At most k = 64 values of each 4096 survive the owners' re-sparsified means.
    counts = (expected[:7 * 4096].view(7, 4096) != 0).sum(dim=1)
    assert int(counts.max()) <= 64


@pytest.mark.parametrize("seed", range(4))
def test_reordered_delivery_gives_identical_results(seed: int) -> None:
    spec = make_spec(4, numel=1500, codec="int4", chunk_numel=64, weights=(1, 2, 3, 4))
    ordered, _, _ = run_net(spec)
    shuffled, net, _ = run_net(spec, Faults(reorder=True, reorder_window=0.05, seed=seed))
    assert [r.digest for r in shuffled] == [r.digest for r in ordered]
    assert all(isinstance(o, Done) for o in net.outcomes.values())


def test_delayed_link_still_completes() -> None:
    spec = make_spec(3, numel=700)
    rounds, net, xs = run_net(spec, Faults().delay(2, 0, 5.0))
    assert all(r.state is RoundState.DONE for r in rounds)
    assert torch.equal(rounds[0].result, reduce_mean(xs))
    assert net.now >= 105.0


def test_group_of_one_completes_at_start() -> None:
    spec = make_spec(1, numel=300, codec="int4")
    x = make_inputs(spec)[0]
    r = AllReduceRound(spec, 0, x)
    actions = r.start(now=0.0)
    codec = get_codec("int4", 64)
    expected = codec.decode(*codec.encode(x))
    assert actions == [Done(result_digest(expected, spec))]
    assert torch.equal(r.result, expected)
    assert r.bytes_sent == r.payload_bytes_sent == 0


def test_empty_fragment_completes() -> None:
    rounds, net, _ = run_net(make_spec(3, numel=0))
    assert all(r.state is RoundState.DONE for r in rounds)
    assert rounds[0].result.numel() == 0


# ---------------------------------------------------------------------- byte accounting


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_payload_bytes_match_butterfly_ideal(n: int) -> None:
    exact = make_spec(n, numel=n * 64 * 7)
    rounds, _, _ = run_net(exact)
    ideal = 2 * (n - 1) / n * exact.numel * 4
    assert all(r.payload_bytes_sent == ideal for r in rounds)
    ragged = make_spec(n, numel=1001)
    rounds, _, _ = run_net(ragged)
    ideal = 2 * (n - 1) / n * ragged.numel * 4
    # A part may be one block larger or smaller than numel/N; it is resent to N-2 extra peers.
    slack = max(n - 2, 1) * ragged.block_size * 4
    assert all(abs(r.payload_bytes_sent - ideal) <= slack for r in rounds)


def test_frame_bytes_sent_equal_frame_bytes_received() -> None:
    rounds, net, _ = run_net(make_spec(4, numel=2000, codec="int8"))
    sent = sum(r.bytes_sent for r in rounds)
    assert sent == sum(r.bytes_received for r in rounds)
    assert sum(r.payload_bytes_sent for r in rounds) == sum(
        r.payload_bytes_received for r in rounds)
    assert all(r.bytes_sent > r.payload_bytes_sent for r in rounds)


# ---------------------------------------------------------------------- failures


def test_silenced_peer_fails_everyone_at_the_deadline() -> None:
    spec = make_spec(4, numel=1000)
    rounds, net, _ = run_net(spec, Faults().silence(2))
    assert_all_failed(rounds, net)
    assert net.now == 100.0 + TIMEOUT
    for i in (0, 1, 3):
        failure = rounds[i].failure
        assert failure.culprits == (2,)
        assert "peer-2" in failure.reason and "timed out" in failure.reason
        assert net.outcomes[i] == Failed(failure)


def test_dropped_link_blames_the_silent_sender() -> None:
    rounds, net, _ = run_net(make_spec(3, numel=500), Faults().drop(1, 0))
    assert_all_failed(rounds, net)
    assert rounds[0].failure.culprits == (1,)


def _flip_payload(msg: Message) -> Message:
    payload = bytearray(msg.payload)
    payload[0:4] = struct.pack("<f", float("nan"))
    return msg.model_copy(update={"payload": bytes(payload)})


def _scale(value: float) -> Callable[[Message], Message]:
    def fn(msg: Message) -> Message:
        return msg.model_copy(update={"payload": struct.pack("<f", value) + msg.payload[4:]})
    return fn


def _update(**fields: Any) -> Callable[[Message], Message]:
    return lambda msg: msg.model_copy(update=fields)


CONTRIBUTION_FAULTS: list[tuple[str, str, Callable[[Message], Any], str]] = [
    ("nan-float32", "float32", _flip_payload, "bad payload"),
    ("nan-scale", "int4", _flip_payload, "invalid block scale"),
    ("negative-scale", "int8", _scale(-1.0), "invalid block scale"),
    # The codec may refuse the scale itself, or the round catches the overflow after decode.
    ("inf-after-decode", "int8", _scale(3e38), "invalid block scale|decodes to NaN/Inf"),
    ("short-payload", "int4", lambda m: m.model_copy(update={"payload": m.payload[:-1]}),
     "payload is"),
    ("wrong-run", "float32", _update(run_id="run-b"), "run/fragment/round"),
    ("wrong-round", "float32", _update(round=8), "run/fragment/round"),
    ("wrong-version", "float32", _update(version=PROTOCOL_VERSION + 1),
     f"version mismatch: expected {PROTOCOL_VERSION}, got {PROTOCOL_VERSION + 1}"),
    ("wrong-attempt", "float32", _update(attempt=1), "membership mismatch: contribution for "
     "attempt 1 of group -, expected attempt 0"),
    ("wrong-group", "float32", _update(group="f" * 64), "membership mismatch"),
    ("hello-in-round", "float32", lambda m: Hello(run_id="run-a", peer_id="peer-1"),
     "hello message inside a round"),
    ("sender-mismatch", "float32", _update(sender=2), "claims sender 2"),
    ("wrong-owner", "float32", _update(owner=2), "part of member 2"),
    ("wrong-offset", "float32", _update(offset=64), "offset/numel"),
    ("wrong-numel", "float32", _update(numel=5), "offset/numel"),
    ("wrong-n-chunks", "float32", _update(n_chunks=99), "n_chunks 99"),
    ("codec-mismatch", "float32", _update(codec="int8"), "codec int8"),
    ("block-mismatch", "int4", _update(block_size=32), "codec int4/32"),
    ("frame-garbage", "float32", lambda m: b"\x00\x00\x00\x02\xc1\xc1", "not valid msgpack"),
]


@pytest.mark.parametrize("wire", [True, False], ids=["wire", "objects"])
@pytest.mark.parametrize(("codec", "fn", "needle"),
                         [c[1:] for c in CONTRIBUTION_FAULTS],
                         ids=[c[0] for c in CONTRIBUTION_FAULTS])
def test_bad_contribution_fails_naming_the_peer(codec: str, fn: Callable[[Message], Any],
                                               needle: str, wire: bool) -> None:
    spec = make_spec(4, numel=1000, codec=codec)
    rounds, net, _ = run_net(spec, Faults().corrupt(1, 0, fn, once=True), wire=wire)
    assert_all_failed(rounds, net)
    failure = rounds[0].failure
    assert failure.culprits == (1,)
    assert "peer-1" in failure.reason and re.search(needle, failure.reason), failure.reason
    assert "\n" not in failure.reason
    # The others learn from member 0's abort long before the deadline.
    assert net.now < 100.0 + TIMEOUT
    assert failure.exclude == (1,)
    for i in (1, 2, 3):
        assert rounds[i].failure.culprits == (0,)
        assert "aborted" in rounds[i].failure.reason
        # Member 0's abort names member 1, so every member leaves out the same peer.
        assert rounds[i].failure.reported == (1,)
        assert rounds[i].failure.exclude == (1,)


def _is_result(fn: Callable[[Result], Message]) -> Callable[[Message], Message]:
    return lambda msg: fn(msg) if isinstance(msg, Result) else msg


RESULT_FAULTS: list[tuple[str, Callable[[Result], Message], str]] = [
    ("contributors", lambda m: m.model_copy(update={"contributors": (0, 1, 2)}),
     "expected all"),
    ("digest", lambda m: m.model_copy(update={"digest": "0" * 64}) if m.digest else m,
     "digest mismatch"),
    ("values", lambda m: _scale(1.5)(m) if m.digest else m, "digest mismatch"),
    ("owner", lambda m: m.model_copy(update={"owner": 0}), "not its owner"),
]


@pytest.mark.parametrize(("fn", "needle"), [f[1:] for f in RESULT_FAULTS],
                         ids=[f[0] for f in RESULT_FAULTS])
def test_bad_result_fails_naming_the_owner(fn: Callable[[Result], Message],
                                           needle: str) -> None:
    spec = make_spec(4, numel=1000, codec="int4")
    rounds, net, xs = run_net(spec, Faults().corrupt(2, 0, _is_result(fn)))
    assert rounds[0].state is RoundState.FAILED
    assert rounds[0].failure.culprits == (2,)
    assert needle in rounds[0].failure.reason, rounds[0].failure.reason
    # Only member 0 saw the bad result; members that had every part verified before its
    # abort arrived may be DONE, but only ever with the complete, correct average.
    for r in rounds[1:]:
        if r.state is RoundState.DONE:
            assert torch.equal(r.result, reference(spec, xs))
        else:
            assert r.failure.culprits == (0,)


def test_abort_frame_fails_the_receiver_without_an_abort_storm() -> None:
    abort = Abort(run_id="run-a", fragment=1, round=9, sender=1, reason="bye")
    spec = make_spec(3, numel=600)
    rounds, net, _ = run_net(spec, Faults().corrupt(1, 0, lambda m: encode_frame(abort)))
    assert rounds[0].failure.culprits == (1,)
    assert "aborted the round: [bye]" in rounds[0].failure.reason
    # Member 0 does not relay the abort; the others time out waiting for its part.
    assert net.now == 100.0 + TIMEOUT
    assert rounds[1].failure.culprits == rounds[2].failure.culprits == (0,)


def test_group_digest_mismatch_with_the_spec_fails_naming_the_sender() -> None:
    members = tuple(f"peer-{i}" for i in range(3))
    spec = dataclasses.replace(make_spec(3, numel=600), group_digest=group_digest(members))
    other = dataclasses.replace(spec, group_digest=group_digest(members[::-1]))
    xs = make_inputs(spec)
    rounds = [AllReduceRound(spec, 0, xs[0]), AllReduceRound(other, 1, xs[1]),
              AllReduceRound(spec, 2, xs[2])]
    net = MemNet(rounds)
    net.run()
    assert_all_failed(rounds, net)
    assert 1 in rounds[0].failure.exclude and "membership mismatch" in rounds[0].failure.reason


def test_group_digest_is_order_sensitive_and_validated() -> None:
    a = group_digest(["x", "y"])
    assert a == group_digest(("x", "y")) and a != group_digest(["y", "x"])
    assert group_digest(["a,b"]) != group_digest(["a", "b"])
    assert len(a) == 64
    with pytest.raises(ValueError, match="group_digest"):
        dataclasses.replace(make_spec(2), group_digest="ABC")
    with pytest.raises(ValueError, match="attempt"):
        dataclasses.replace(make_spec(2), attempt=-1)


def test_abort_carries_the_culprits_and_receivers_report_them() -> None:
    spec = make_spec(3)
    r = AllReduceRound(spec, 0, make_inputs(spec)[0])
    r.start(0.0)
    actions = r.peer_error(2, "bad frame", 1.0)
    aborts = [a.msg for a in actions if isinstance(a, Send)]
    assert aborts and all(isinstance(m, Abort) and m.culprits == (2,) for m in aborts)
    r1 = AllReduceRound(spec, 1, make_inputs(spec)[1])
    r1.start(0.0)
    r1.receive(0, aborts[0], 1.0)
    assert r1.failure.culprits == (0,) and r1.failure.reported == (2,)
    assert r1.failure.exclude == (2,)
    # Indices outside the group are ignored; an empty report blames the sender.
    r2 = AllReduceRound(spec, 2, make_inputs(spec)[2])
    r2.start(0.0)
    r2.receive(0, aborts[0].model_copy(update={"culprits": (7,), "sender": 0}), 1.0)
    assert r2.failure.reported == () and r2.failure.exclude == (0,)


def test_peer_gone_fails_only_while_the_peer_is_still_needed() -> None:
    spec = make_spec(2, numel=256)
    r0, r1 = make_rounds(spec, make_inputs(spec))
    r0.start(0.0)
    r1.start(0.0)
    assert r0.peer_gone(1, "connection closed", 0.5)[-1] == Failed(r0.failure)
    assert r0.failure.culprits == (1,) and "connection closed" in r0.failure.reason
    # A peer that already gave us everything may leave: we only owe it our results.
    spec3 = make_spec(3, numel=300, weights=(1.0, 1.0, 0.0))
    xs = make_inputs(spec3)
    rounds = make_rounds(spec3, xs)
    starts = [r.start(0.0) for r in rounds]
    for m in _sends(starts[2], 0):
        rounds[0].receive(2, m, 1.0)
    assert rounds[0].peer_gone(2, "connection closed", 1.0) == []
    assert rounds[0].state is RoundState.RUNNING


def test_duplicate_contribution_is_a_culprit() -> None:
    spec = make_spec(3, numel=500)
    xs = make_inputs(spec)
    r0, r1 = (AllReduceRound(spec, i, xs[i]) for i in range(2))
    r0.start(0.0)
    to_0 = [a for a in r1.start(0.0) if isinstance(a, Send) and a.to == 0]
    assert r0.receive(1, to_0[0].msg, 1.0) == []
    actions = r0.receive(1, to_0[0].msg, 1.0)
    assert r0.failure.culprits == (1,)
    assert "duplicate contribution chunk 0" in r0.failure.reason
    aborts = [a for a in actions if isinstance(a, Send)]
    assert {a.to for a in aborts} == {1, 2}
    assert all(isinstance(a.msg, Abort) for a in aborts)
    assert isinstance(actions[-1], Failed)


# ---------------------------------------------------------------------- hand-driven


def _sends(actions: list[Any], to: int) -> list[Message]:
    return [a.msg for a in actions if isinstance(a, Send) and a.to == to]


def test_owner_pipelines_chunks_and_holds_the_last_for_the_digest() -> None:
    spec = make_spec(3, numel=3 * 256, chunk_numel=64)  # 4 chunks per part
    xs = make_inputs(spec)
    rounds = make_rounds(spec, xs)
    starts = [r.start(0.0) for r in rounds]
    owner = rounds[0]
    by_chunk = {(m.sender, m.chunk): m for i in (1, 2) for m in _sends(starts[i], 0)}
    # The last chunk completes first: nothing is sent, it waits for the part digest.
    assert owner.receive(1, by_chunk[(1, 3)], 1.0) == []
    assert owner.receive(2, by_chunk[(2, 3)], 1.0) == []
    # Chunk 0 completes: its result goes out at once, before other chunks are in.
    owner.receive(1, by_chunk[(1, 0)], 1.0)
    out = owner.receive(2, by_chunk[(2, 0)], 1.0)
    assert [(m.type, m.chunk) for m in _sends(out, 1)] == [("result", 0)]
    assert set(owner._pending) == set()  # completed chunks are not kept
    for k in (1, 2):
        owner.receive(1, by_chunk[(1, k)], 1.0)
        out = owner.receive(2, by_chunk[(2, k)], 1.0)
    results = _sends(out, 2)
    assert [(m.chunk, m.digest is not None) for m in results] == [(2, False), (3, True)]
    ref = reference(spec, xs)
    chunks = [ref[a:a + spec.chunk_numel] for a in range(*spec.parts[0], spec.chunk_numel)]
    assert len(chunks) == 4
    assert results[-1].digest == part_digest([chunk_hash(c) for c in chunks])


def test_messages_after_done_are_ignored_and_counted() -> None:
    spec = make_spec(2, numel=256)
    rounds = make_rounds(spec, make_inputs(spec))
    net = MemNet(rounds)
    net.run()
    stray = _sends(rounds[1]._send_contributions(), 0)[0]  # a late duplicate
    assert rounds[0].receive(1, stray, 200.0) == []
    assert rounds[0].messages_ignored == 1
    assert rounds[0].state is RoundState.DONE


def test_abort_received_fails_naming_its_sender() -> None:
    spec = make_spec(3)
    r = AllReduceRound(spec, 0, make_inputs(spec)[0])
    r.start(0.0)
    abort = Abort(run_id="run-a", fragment=1, round=9, sender=2, reason="disk\nfull")
    actions = r.receive(2, abort, 1.0)
    assert actions == [Failed(r.failure)]  # no abort storm
    assert r.failure.culprits == (2,)
    assert "peer-2" in r.failure.reason and "[disk full]" in r.failure.reason


def test_deadline_applies_to_late_receive_and_tick() -> None:
    spec = make_spec(2, numel=128)
    xs = make_inputs(spec)
    r0, r1 = make_rounds(spec, xs)
    r0.start(10.0)
    contrib = _sends(r1.start(10.0), 0)[0]
    assert r0.tick(39.9) == []
    assert r0.deadline == 40.0
    actions = r0.receive(1, contrib, 40.0)
    assert actions == [Failed(r0.failure)]
    assert r0.failure.culprits == (1,)
    assert r0.tick(50.0) == []


def test_timeout_blames_owners_when_all_contributions_arrived() -> None:
    spec = make_spec(2, numel=256)
    r0, r1 = make_rounds(spec, make_inputs(spec))
    r0.start(0.0)
    for msg in _sends(r1.start(0.0), 0):
        r0.receive(1, msg, 1.0)  # r0's part is reduced; r1 never gets anything back
    r0.tick(TIMEOUT)
    assert r0.failure.culprits == (1,)


def test_peer_error_fails_and_aborts() -> None:
    spec = make_spec(3)
    r = AllReduceRound(spec, 1, make_inputs(spec)[1])
    r.start(0.0)
    actions = r.peer_error(0, "connection reset", 2.0)
    assert r.failure.culprits == (0,)
    assert {a.to for a in actions if isinstance(a, Send)} == {0, 2}


def test_api_misuse_is_a_local_error() -> None:
    spec = make_spec(2)
    xs = make_inputs(spec)
    r = AllReduceRound(spec, 0, xs[0])
    msg = Contribution(run_id="run-a", fragment=1, round=9, sender=1, owner=0, chunk=0,
                       n_chunks=1, offset=0, numel=1, codec="float32", block_size=64,
                       weight=1.0, payload=bytes(4))
    with pytest.raises(LocalProtocolError):
        r.receive(1, msg, 0.0)  # before start
    r.start(0.0)
    with pytest.raises(LocalProtocolError):
        r.start(0.0)
    with pytest.raises(LocalProtocolError):
        r.receive(0, msg, 0.0)  # from ourselves
    with pytest.raises(LocalProtocolError):
        r.receive(5, msg, 0.0)
    with pytest.raises(LocalProtocolError):
        _ = r.digest


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"chunk_numel": 100}, "multiple of block_size"),
    ({"weights": (1.0,)}, "weights"),
    ({"weights": (0.0, 0.0)}, "part_bounds"),
    ({"codec": "int3"}, "unknown codec"),
    ({"chunk_numel": 64 * 2**20}, "frames of"),
])
def test_groupspec_validation(kwargs: dict[str, Any], needle: str) -> None:
    fields = {"run_id": "r", "fragment": 0, "round": 0, "members": ("a", "b"),
              "weights": (1.0, 1.0), "numel": 10, "codec": "float32", "block_size": 64,
              "chunk_numel": 128}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        GroupSpec(**fields)


def test_local_input_is_validated() -> None:
    spec = make_spec(2, numel=4)
    with pytest.raises(ValueError, match="NaN"):
        AllReduceRound(spec, 0, torch.tensor([1.0, math.nan, 0.0, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        AllReduceRound(spec, 0, torch.zeros(5))
    with pytest.raises(ValueError, match="my_index"):
        AllReduceRound(spec, 2, torch.zeros(4))


def test_chunks_decode_with_the_group_block_size() -> None:
    spec = make_spec(2, numel=200, codec="int4", block_size=16, chunk_numel=48)
    rounds = make_rounds(spec, make_inputs(spec))
    msgs = _sends(rounds[0].start(0.0), 1)
    lo, hi = spec.parts[1]
    assert sum(m.numel for m in msgs) == hi - lo
    assert [m.offset for m in msgs] == list(range(0, hi - lo, 48))
    codec = get_codec("int4", 16)
    for m in msgs:
        meta = CodecMeta(codec="int4", numel=m.numel, block_size=16)
        assert codec.decode(m.payload, meta).numel() == m.numel
