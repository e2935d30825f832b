"""benchmarks/sim/quality.py end to end on a nano model for a few steps, so the script keeps
running as the simulator changes (the real benchmark takes hours)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sim import quality

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
