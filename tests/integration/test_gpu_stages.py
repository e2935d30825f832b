"""benchmarks/gpu.sh end to end at toy sizes on the CPU (`SMOKE=1`): the memory, memory-1b,
daemon-cost, quality and swarm stages through the script itself, so the commands its header
gives a GPU host cannot rot. The swarm and daemon-cost stages start real bootstraps and
`dilonode run` processes. One
quality stage: the others differ only in `--method`, and
tests/unit/test_gpu_bench.py runs every method through gpu_quality.py's entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_gpu_sh_stages_in_smoke_mode(tmp_path: Path) -> None:
    results, pack = tmp_path / "gpu", tmp_path / "out"
    env = {**os.environ, "SMOKE": "1", "RESULTS": str(results), "PACK_TO": str(pack)}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu.sh"), "setup", "memory",
                           "memory-1b", "daemon-cost", "quality-int4", "swarm"], env=env,
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("memory.json", "memory-estimate.md", "memory-1b.json", "daemon-cost.json",
                 "daemon-cost.md", "quality-int4.json", "quality.md", "swarm.json",
                 "swarm.md", "summary.txt"):
        assert (results / name).is_file(), name
    assert "Streaming" in (results / "quality.md").read_text()
    swarm = json.loads((results / "swarm.json").read_text())
    assert swarm["identical_outer_weights"] and len(swarm["nodes"]) == 2
    with tarfile.open(pack / "gpu-results.tar.gz") as tar:
        assert "gpu/swarm.json" in tar.getnames()
    summary = (pack / "summary.txt").read_text()
    assert summary.count("-- ") == 6 and "FAILED" not in summary
    mem = json.loads((results / "memory-1b.json").read_text())
    assert mem["activation_checkpointing"] and mem["micro_batch_size"] == 2
    assert mem["estimate_device_bytes"] > 0 and mem["vocab_size"] == 512
    cost = json.loads((results / "daemon-cost.json").read_text())
    assert len(cost["rows"]) == 1 and len(cost["rows"][0]["c_tokens_per_s"]) == 2
    assert "b/a median" in (results / "daemon-cost.md").read_text()
