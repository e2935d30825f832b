"""benchmarks/sim/quality.py end to end on a nano model for a few steps, so the script keeps
running as the simulator changes (the real benchmark takes hours)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.harness import methods
from benchmarks.sim import frontier_plot, quality

ROOT = Path(__file__).resolve().parents[2]




def test_quality_bench_tiny(tmp_path: Path) -> None:
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    doc = quality.main([
        "--preset", "nano", "--workers", "2", "--steps", "4", "--sync-every", "2",
        "--seq-len", "16", "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1",
        "--warmup", "0", "--seeds", "1", "--sweep", "1e-3,2e-3", "--sweep-rows", "diloco-fp32",
        "--rows", "ddp,diloco-fp32,s-int4-a0.5", "--json", str(out), "--plot", str(png)])
    assert doc["lr"] in (1e-3, 2e-3)
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"ddp", "diloco-fp32", "s-int4-a0.5"}
    # 4 steps of DDP against 2 DiLoCo rounds of the whole model: 2x fewer bytes.
    assert abs(summary["diloco-fp32"]["ratio_vs_ddp"] - 2.0) < 1e-9
    assert summary["s-int4-a0.5"]["ratio_vs_ddp"] > summary["diloco-fp32"]["ratio_vs_ddp"]
    assert png.stat().st_size > 0


NANO = ["--preset", "nano", "--workers", "2", "--steps", "6", "--sync-every", "3",
        "--seq-len", "16", "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1",
        "--warmup", "0"]


def test_rows_are_named_by_codec_density_and_error_feedback(monkeypatch) -> None:
    r = quality.row("s-int4-a0.5")
    assert (r.mode, r.codec, r.alpha, r.density, r.error_feedback) == (
        "streaming", "int4", 0.5, None, False)
    assert quality.row("s-fp32-a0").codec == "float32"
    for bad, words in (("s-int9-a0.5", "not in the codec table"), ("nope", "unknown row"),
                       ("s-int4-rand0-a0.5", "rand-k percentage")):
        with pytest.raises(ValueError, match=words):
            quality.row(bad)
    # As on a build with error feedback and rand-k (dilonode/algo/{error_feedback,sparse}.py).
    monkeypatch.setattr(methods.importlib.util, "find_spec", lambda name: object())
    sparse = quality.row("s-int2-rand1.56-ef-a0.5")
    assert (sparse.codec, sparse.density, sparse.error_feedback) == ("int2", 0.0156, True)
    assert methods.codec_overrides(sparse, 64) == {
        "name": "int2", "block_size": 64, "kind": "randk", "topk_density": 0.0156,
        "error_feedback": True}
    top = quality.row("s-int2-top1.56-ef-a0.5")
    assert (top.sparsity, top.density, top.label) == (
        "topk", 0.0156, "Streaming int2, top-k 1.56%, EF, alpha 0.5")
    assert methods.codec_overrides(top, 64)["kind"] == "topk"
    # Rows run what they say or not at all: a config field without its algorithm is refused.
    monkeypatch.setattr(methods.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="error_feedback.py, which this build lacks"):
        quality.row("s-int2-ef-a0.5")
    monkeypatch.undo()
    assert quality.bits_per_value("s-int4-a0.5", 64) == 4.5  # 4 bits + a float32 per 64
    # rand-k 1.56%: 64 of every 4096 values, each int2 (2 bits + a float32 per 64).
    assert quality.bits_per_value("s-int2-rand1.56-ef-a0.5", 64) == 64 * 2.5 / 4096
    # top-k 1.56%: per chunk of 4096, 64 uint16 offsets, then 64 int2 values and a scale.
    assert quality.bits_per_value("s-int2-top1.56-ef-a0.5", 64) == (128 + 16 + 4) * 8 / 4096
    frontier = quality.frontier_rows()
    assert "s-int2-top3-ef-a0.5" in frontier
    assert frontier[:2] == ["diloco-fp32", "s-int4-a0.5"] and frontier[-1] == "ddp"
    assert quality.parse_args(["--methods", "s-fp*,ddp"]).rows == [
        "s-fp32-a0.5", "s-fp4-a0.5", "s-fp32-a0", "s-fp4-a0", "ddp"]
    with pytest.raises(SystemExit):
        quality.parse_args(["--methods", "s-zz*"])


def test_a_row_names_its_error_decay_and_outer_step(tmp_path: Path) -> None:
    sl = quality.row("s-int2-top1.56-ef-b0.95-m0-o1-a0.5")  # SparseLoCo's recipe
    assert (sl.error_decay, sl.outer_momentum, sl.outer_lr, sl.alpha) == (0.95, 0.0, 1.0, 0.5)
    assert sl.label == ("Streaming int2, top-k 1.56%, EF beta 0.95, outer momentum 0, "
                        "outer lr 1, alpha 0.5")
    assert methods.codec_overrides(sl, 64)["error_decay"] == 0.95
    args = quality.parse_args([])
    cfg = quality.overrides(args, sl.key, 3.75e-4, 0)
    assert (cfg["diloco"]["outer_momentum"], cfg["diloco"]["outer_lr"]) == (0.0, 1.0)
    # Parts left out stay out of the config: runs recorded before them still match.
    plain = quality.overrides(args, "s-int2-top1.56-ef-a0.5", 3.75e-4, 0)
    assert "outer_lr" not in plain["diloco"] and "error_decay" not in plain["codec"]
    h25 = quality.overrides(args, "s-int2-top3-h25-a0.5", 3.75e-4, 0)
    assert h25["diloco"]["sync_every"] == 25 and plain["diloco"]["sync_every"] == 50
    assert quality.row("s-int2-top3-h25-a0.5").label == "Streaming int2, top-k 3%, H 25, alpha 0.5"
    for bad, words in (("s-int2-top1.56-b0.9-a0.5", "unknown row"),  # a decay needs EF
                       ("s-int2-h0-a0.5", "H must be"),
                       ("s-int2-ef-b0-a0.5", "error decay"),
                       ("s-int2-m1-a0.5", "outer momentum")):
        with pytest.raises(ValueError, match=words):
            quality.row(bad)


def test_each_row_keeps_its_own_lr_and_no_run_summarizes(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "f.json", tmp_path / "f.png"
    quality.main([*NANO, "--seed-list", "0", "--lrs", "1e-3,4e-3",
                  "--methods", "diloco-fp32,s-int4-a0.5", "--json", str(out)])
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert len(runs) == 4  # 2 rows x 2 lrs, seed 0
    for key in ("diloco-fp32", "s-int4-a0.5"):
        best = min((r for r in runs.values() if r["row"] == key),
                   key=lambda r: r["report"]["final_eval_loss"])
        assert doc["summary"][key]["lr"] == best["lr"]
    # Without DDP's run its bytes come from DiLoCo's: 6 steps against 2 rounds of fp32.
    assert doc["summary"]["diloco-fp32"]["ratio_vs_ddp"] == pytest.approx(3.0)
    assert doc["summary"]["diloco-fp32"]["ddp_bytes_from"].startswith("DiLoCo fp32")
    capsys.readouterr()
    doc = quality.main([*NANO, "--seed-list", "0,1", "--lrs", "1e-3,4e-3", "--no-run",
                        "--methods", "diloco-fp32,s-int4-a0.5,ddp", "--json", str(out)])
    text = capsys.readouterr().out
    assert "--no-run" in text and "rows without a run: ddp" in text
    assert doc["summary"]["s-int4-a0.5"]["seeds"] == [0]
    assert doc["summary"]["s-int4-a0.5"]["missing_seeds"] == [1]
    assert len(json.loads(out.read_text())["runs"]) == 4  # nothing ran
    frontier_plot.main([str(out), "--out", str(png)])
    assert png.stat().st_size > 0


def test_wan_streaming_run_takes_the_codec_of_a_row(tmp_path: Path) -> None:
    from benchmarks.testbed import wan

    args = argparse.Namespace(steps=4, preset="nano", seq_len=16, batch_size=2, sync_every=2,
                              fragments=2, tau=1, ddp_steps=2, codec="int8", block_size=32,
                              defaults=False)
    cfg = wan.run_config(args, "streaming", 10.0, tmp_path)
    assert (cfg.codec.name, cfg.codec.block_size) == ("int8", 32)
    assert cfg.run_id == "wan-streaming-int8-10"
    assert wan.run_config(args, "diloco", 10.0, tmp_path).codec.name == "float32"


def test_wan_defaults_keep_the_configured_pacing_tau_and_timeouts(tmp_path: Path) -> None:
    from benchmarks.testbed import wan
    from dilonode.config import load_config

    args = argparse.Namespace(steps=4, preset="nano", seq_len=16, batch_size=2, sync_every=2,
                              fragments=2, tau=1, ddp_steps=2, codec="int4", block_size=32,
                              defaults=True)
    cfg, base = wan.run_config(args, "streaming", 20.0, tmp_path), load_config()
    assert cfg.diloco.fragment_sync_delay == base.diloco.fragment_sync_delay
    assert cfg.network.matchmaking_window == base.network.matchmaking_window
    assert cfg.network.bandwidth_mbps == 20.0
    assert wan.per_host("10,40", 3) == {"node-0": 10.0, "node-1": 40.0, "node-2": 40.0}
