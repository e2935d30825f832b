"""The GPU benchmark stages (benchmarks/gpu.sh) kept runnable without a GPU: the corpus
builder is deterministic and its shards load; every stage's Python entry point runs a toy
configuration on the CPU in seconds; the quality runs' DeviceGroup averages bit for bit as
the simulator's LocalGroup; the GPU-only parts skip cleanly without CUDA and run on one.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import corpus
from benchmarks.gpu import memory as gpu_memory
from benchmarks.gpu import quality as gpu_quality
from benchmarks.gpu import swarm as gpu_swarm
from dilonode.algo.codecs import get_codec
from dilonode.collective import RoundRequest, SyncKey
from dilonode.config import DataConfig, load_config
from dilonode.sim.local_group import LocalGroup
from dilonode.train.data import load_data
from dilonode.train.model import build_model, param_count

ROOT = Path(__file__).resolve().parents[2]

CUDA = torch.cuda.is_available()
TOY = ["--device", "cpu", "--preset", "nano", "--data", "builtin", "--steps", "4",
       "--workers", "2", "--sync-every", "3", "--fragments", "3", "--seq-len", "32",
       "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--warmup", "1"]


def _sources(root: Path) -> Path:
    """A few source files: nested, one not UTF-8, one in __pycache__, one of another kind."""
    src = root / "src"
    for i in range(12):
        path = src / ("pkg" if i % 2 else "") / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"def f{i}(x):\n    return x * {i}  # é\n" * (i + 1), encoding="utf-8")
    (src / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "cached.py").write_text("never = 1\n")
    (src / "notes.txt").write_text("not python\n")
    return src


def test_corpus_build_is_deterministic_and_loads(tmp_path: Path) -> None:
    src = _sources(tmp_path)
    metas = [corpus.build(tmp_path / f"out{i}", [str(src)], val_every=3) for i in (1, 2)]
    assert metas[0]["sha256"] == metas[1]["sha256"]
    assert (tmp_path / "out1/manifest.tsv").read_bytes() == \
        (tmp_path / "out2/manifest.tsv").read_bytes()
    meta = metas[0]
    assert meta["skipped_not_utf8"] == ["src/latin1.py"]
    assert meta["sources"][0]["files"] == 12  # not __pycache__, .txt or the latin-1 file
    texts = [p.read_bytes() + b"\n\n" for p in sorted(src.rglob("mod_*.py"),
                                                      key=lambda p: f"src/{p.relative_to(src)}")]
    assert meta["train_tokens"] + meta["val_tokens"] == sum(len(t) for t in texts)
    assert meta["val_tokens"] > 0 and meta["train_tokens"] > 0
    data = load_data(DataConfig(source="bin", path=tmp_path / "out1", seq_len=8))
    assert data.vocab_size == 256 and len(data.train_tokens) == meta["train_tokens"]
    # The training split holds the files in sorted name order, bytes as tokens.
    train = [t for (name, t) in zip(sorted(f"src/{p.relative_to(src).as_posix()}"
                                           for p in src.rglob("mod_*.py")), texts, strict=True)
             if not corpus.is_val(name, 3)]
    assert bytes(data.train_tokens.astype("uint8")) == b"".join(train)


def test_corpus_pack_round_trip_and_refuses_a_bad_shard(tmp_path: Path) -> None:
    src = _sources(tmp_path)
    meta = corpus.build(tmp_path / "out", [str(src)], val_every=3)
    corpus.pack(tmp_path / "out", tmp_path / "pack")
    assert corpus.unpack(tmp_path / "pack", tmp_path / "again")["sha256"] == meta["sha256"]
    (tmp_path / "again/val.bin").write_bytes(b"\x00\x00")
    with pytest.raises(SystemExit, match="sha256"):
        corpus.verify(tmp_path / "again")


@pytest.mark.parametrize("codec", ["float32", "int4"])
def test_device_group_matches_local_group(codec: str) -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=gen) * 1e-2 for _ in range(3)]
    results = []
    for cls in (LocalGroup, gpu_quality.DeviceGroup):
        group = cls(3, get_codec(codec, 64), chunk_numel=256, align=64)
        handles = [group.view(i).begin(RoundRequest(SyncKey("fragment", 0, 0), float(i + 1)), x)
                   for i, x in enumerate(xs)]
        results.append([h.wait() for h in handles])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.mean, b.mean.cpu())
        assert (a.report.payload_bytes_sent, a.report.payload_bytes_received, a.digest) == \
            (b.report.payload_bytes_sent, b.report.payload_bytes_received, b.digest)


@pytest.mark.parametrize("method", ["ddp", "int4"])
def test_simulator_with_device_group_ends_on_the_same_weights(method: str) -> None:
    reports = [gpu_quality.main_report(["--method", method, "--group", group, *TOY])
               for group in ("local", "device")]
    assert reports[0]["outer_digest"] == reports[1]["outer_digest"]
    assert reports[0]["bytes_sent_per_worker"] == reports[1]["bytes_sent_per_worker"]


def test_quality_entry_point_every_method(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    for method in gpu_quality.METHODS:
        out = tmp_path / f"quality-{method}.json"
        assert gpu_quality.main(["run", "--method", method, "--group", "device",
                                 "--json", str(out), *TOY]) == 0
        report = json.loads(out.read_text())
        assert report["steps"] == 4 and report["workers_agree"]
        assert report["machine"]["torch"] == torch.__version__
        assert (tmp_path / f"quality-{method}.progress.jsonl").read_text().count("\n") == 2
    capsys.readouterr()
    assert gpu_quality.main(["table", *map(str, sorted(tmp_path.glob("quality-*.json")))]) == 0
    table = capsys.readouterr().out
    assert "DDP (fp32, every step)" in table and "(fp4)" in table and "+" in table


def test_quality_run_stops_early_when_projected_too_long(
        capsys: pytest.CaptureFixture[str]) -> None:
    pace = gpu_quality.Pace(steps=1000, max_s=0.5, method="ddp", first=1, span=1)
    pace(1, [None] * 4)
    time.sleep(0.01)
    with pytest.raises(SystemExit, match="smaller --batch-size"):
        pace(2, [None] * 4)
    assert "projected" in capsys.readouterr().out
    unbounded = gpu_quality.Pace(steps=1000, max_s=0.0, method="ddp", first=1, span=1)
    unbounded(1, [None] * 4)
    unbounded(2, [None] * 4)  # no limit: it only reports


def test_memory_estimate_counts_what_the_model_holds(tmp_path: Path) -> None:
    assert gpu_memory.main(["estimate", "--presets", "nano", "--measure-outer", "nano",
                            "--json", str(tmp_path / "m.json")]) == 0
    row = json.loads((tmp_path / "m.json").read_text())["presets"]["nano"]
    torch.manual_seed(0)
    n = param_count(build_model(load_config(overrides={"model": {"preset": "nano"}}).model, 256))
    assert row["params"] == n and row["outer_state_bytes"] == 8 * n
    assert sum(row["fragment_params"]) == n
    assert row["act_bytes_per_token_per_block"] > 0
    assert "outer_state_measured_bytes" in row


def test_memory_node_runs_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_memory.main(["node", "--device", "cpu", "--preset", "nano", "--data", "builtin",
                            "--batch-size", "2", "--seq-len", "16", "--steps", "3"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["rounds"] == 3  # nano: 3 blocks, 3 fragments, each synced once
    assert res["outer_state_bytes"] == 8 * res["params"]


@pytest.mark.skipif(CUDA, reason="checks the skip without a GPU")
def test_gpu_only_parts_skip_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_memory.main(["gpu"]) == 0
    assert gpu_memory.main(["node", "--device", "cuda"]) == 0
    out = capsys.readouterr()
    assert "no CUDA GPU" in out.out and "no CUDA GPU" in out.err


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_memory_node_on_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_memory.main(["node", "--device", "cuda", "--preset", "nano", "--data",
                            "builtin", "--batch-size", "2", "--seq-len", "16", "--steps",
                            "3"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["gpu_peak_allocated_bytes"] > 0 and res["rounds"] == 3


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_device_group_on_the_gpu_matches_the_cpu() -> None:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(5000, generator=gen) * 1e-2 for _ in range(4)]
    means = []
    for dev in ("cpu", "cuda"):  # CPU inputs, averaged on `dev`
        group = gpu_quality.DeviceGroup(4, get_codec("int4", 64), chunk_numel=1024, align=64,
                                        device=dev)
        handles = [group.view(i).begin(RoundRequest(SyncKey("grad", 0, 0)), x)
                   for i, x in enumerate(xs)]
        mean = handles[0].wait().mean
        assert mean.device.type == dev
        means.append(mean.cpu())
    assert torch.equal(*means)


def test_swarm_stage_config_and_collect(tmp_path: Path) -> None:
    args = gpu_swarm.main_args(["start", "--dir", str(tmp_path), "--minutes", "11"])
    cfg = load_config(overrides=gpu_swarm.swarm_config(args))
    assert cfg.total_steps == 6600 and cfg.diloco.pacing == "time"
    assert cfg.model.preset == "150m" and cfg.codec.name == "int4"
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    (tmp_path / "pids.json").write_text(json.dumps({"swarm_pid": 2**22 + 7, "nodes": 2,
                                                    "started": 0.0}))
    for i in range(2):
        (tmp_path / f"node-{i}").mkdir()
        (tmp_path / f"node-{i}/summary.json").write_text(json.dumps({
            "steps": 100, "tokens": 1000, "wall_s": 10.0, "compute_utilization": 0.99,
            "step_share": 0.9, "bytes_sent": 5, "bytes_received": 5,
            "rounds_per_fragment": {"0": 2, "1": 2}, "skipped_rounds": 0,
            "retried_rounds": 0, "final_eval_loss": 2.5, "outer_digest": "abc",
            "round_latency_s": {"0": {"n": 2, "mean": 1.0, "max": 2.0},
                                "1": {"n": 2, "mean": 3.0, "max": 4.0}}}))
    (tmp_path / "gpu.csv").write_text("t,what,util_pct,memory_mib,power_w\n"
                                      "0,gpu,90,2048,300\n0,node-0,,1024,\n")
    res = gpu_swarm.collect(gpu_swarm.main_args(["collect", "--dir", str(tmp_path)]))
    assert res["identical_outer_weights"] and not res["swarm_running"]
    node = res["nodes"]["node-0"]
    assert node["tokens_per_s"] == 100 and node["round_latency_mean_s"] == 2.0
    assert res["gpu"]["util_mean_pct"] == 90 and res["gpu"]["process_memory_max_mib"] == \
        {"node-0": 1024.0}
    assert "identical outer weights on all nodes: True" in gpu_swarm.collect_md(res)


def test_gpu_sh_parses_and_lists_its_stages() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu.sh")]).returncode == 0
    out = subprocess.run(["bash", str(ROOT / "benchmarks/gpu.sh")], capture_output=True,
                         text=True)
    assert out.returncode == 2
    for stage in ("codecs", "memory", "quality-ddp", "quality-fp4", "swarm-start",
                  "swarm-collect", "prepare"):
        assert stage in out.stdout
