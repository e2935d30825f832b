"""A peer of another protocol version in a swarm: refused with one line naming both versions
on both sides, never averaged with; the current nodes end as one model. The other release is
a current node run with DILONODE_TEST_PROTOCOL_VERSION (the real previous release runs in
benchmarks/loopback/mixed_versions.py). 127.0.0.1, about 40 s."""

from __future__ import annotations

import json

import pytest

from dilonode import PROTOCOL_VERSION
from tests.support.config import LOOPBACK_NETWORK, nano_config
from tests.support.swarm import assert_one_model, nodes_by_hand

pytestmark = pytest.mark.slow

OLD = PROTOCOL_VERSION - 1


def _summary(node, timeout: float) -> dict:
    return node.wait_for("summary", timeout)


def test_a_peer_of_another_protocol_version_is_refused_with_one_line(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = nano_config(tmp_path, run_id="versions-test", total_steps=18,
                      network=dict(LOOPBACK_NETWORK, min_peers=2),
                      diloco={"pacing": "steps"})
    with nodes_by_hand(cfg) as hand:
        current = [hand.start(0), hand.start(1)]
        monkeypatch.setenv("DILONODE_TEST_PROTOCOL_VERSION", str(OLD))
        # Alone on its version, it waits for a peer of its own at most start_timeout.
        old = hand.start(2, "--set", "network.start_timeout=20")
        monkeypatch.delenv("DILONODE_TEST_PROTOCOL_VERSION")
        summaries = {n.out.name: _summary(n, 150) for n in current}
        assert_one_model(summaries)
        assert old.proc.wait(timeout=60) != 0
        for node in current:
            node.proc.wait(timeout=60)
    ours = f"protocol version {OLD} != {PROTOCOL_VERSION} (the peer speaks {OLD}, this node " \
           f"{PROTOCOL_VERSION})"
    theirs = f"protocol version {PROTOCOL_VERSION} != {OLD} (the peer speaks " \
             f"{PROTOCOL_VERSION}, this node {OLD})"
    for node in current:
        lines = [ln for ln in node.log.read_text().splitlines() if ours in ln]
        peer_lines = {json.loads(ln)["msg"].split("[")[1].split("]")[0] for ln in lines
                      if ln.startswith("{")}
        assert lines, f"{node.out.name}: no line naming protocol versions {OLD} and " \
                      f"{PROTOCOL_VERSION}"
        assert len(lines) == len(peer_lines), f"{node.out.name}: repeated lines {lines}"
        assert "Traceback" not in node.log.read_text()
    old_log = old.log.read_text()
    assert theirs in old_log
    assert "Traceback" not in old_log
