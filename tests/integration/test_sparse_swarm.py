"""Two real nodes on 127.0.0.1 with sparse rounds in int2 and error feedback, once with
shared positions (codec.kind = randk) and once with each node's own top-k positions
(codec.kind = topk): they end with one model, bit for bit, and each round's bytes are
exactly the codec's sizes (randk: the round's values alone; topk: positions and values)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hivemind")

from dilonode.algo.codecs import get_codec  # noqa: E402
from dilonode.algo.sparse import sparse_numel  # noqa: E402
from tests.support.config import LOOPBACK_NETWORK, nano_config  # noqa: E402
from tests.support.swarm import assert_one_model, run_swarm  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["randk", "topk"])
def test_two_sparse_nodes_with_error_feedback_end_bit_identical(tmp_path, kind):
    cfg = nano_config(tmp_path, run_id=f"sparse-{kind}", seed=3, total_steps=12,
                      eval_every=12, diloco={"pacing": "steps"}, network=LOOPBACK_NETWORK,
                      codec={"name": "int2", "kind": kind, "topk_density": 0.05,
                             "error_feedback": True, "error_decay": 0.9})
    end = run_swarm(cfg, 2)
    assert end.codes == [0, 0], end.codes
    assert_one_model(end.summaries)
    states = [torch.load(tmp_path / f"node-{i}" / "outer.pt") for i in range(2)]
    for name, ref in states[0].items():
        assert torch.equal(states[1][name].view(torch.int32), ref.view(torch.int32)), name
    # Two members: each sends its peer's part and returns its own part's mean, parts cut
    # at block (randk) or top-k chunk (topk) boundaries, so a round costs each node the
    # encoding of the whole round once.
    sizes = _fragment_sizes(cfg)
    codec = get_codec(cfg.codec.wire_name, cfg.codec.block_size)
    for s in end.summaries.values():
        assert s["skipped_rounds"] == 0, s["dropped_peers"]
        expected = sum(r * codec.encoded_size(_sent(kind, sizes[int(p)]))
                       for p, r in s["rounds_per_fragment"].items())
        assert s["bytes_sent"] == s["bytes_received"] == expected


def _sent(kind: str, numel: int) -> int:
    """Values the round of a `numel`-value fragment encodes: randk gathers its positions'
    values first, topk encodes the fragment itself."""
    return sparse_numel(numel, 0.05) if kind == "randk" else numel


def _fragment_sizes(cfg):
    from dilonode.sim.local_group import LocalGroup
    from dilonode.train.data import load_data
    from dilonode.train.worker import Worker

    w = Worker(cfg, load_data(cfg.data), LocalGroup(1, get_codec("int2")).view(0), identity=0)
    return [f.outer.weights.numel() for f in w.frags]
