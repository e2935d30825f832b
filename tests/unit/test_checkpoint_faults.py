"""Checkpoints on a failing or full disk: a failed save leaves no temp or uncommitted file,
a full disk prunes older checkpoints and retries once, and the age of the newest good one
is reported (status snapshot, metrics). Faults are injected through the save's hook; one
test fills a real tmpfs when this process may mount one (root), and is skipped otherwise."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from dilonode.status.metrics import node_metrics, render
from dilonode.status.snapshot import NodeStatus, QuietFacts
from dilonode.train.checkpoint import Checkpointer, latest_checkpoints, load_latest, save_checkpoint
from dilonode.train.state import WorkerState

RUN, DIGEST = "ckpt-faults", "ef" * 32


def _state(step: int, numel: int = 100) -> WorkerState:
    g = torch.Generator().manual_seed(step)
    tensors = {f"outer.{p}.{k}": torch.randn(numel, generator=g)
               for p in range(2) for k in ("weights", "momentum")}
    return WorkerState(step, (1, 1), (1, 1), tensors)


class FullDisk:
    """The save hook: the next `times` saves fail with ENOSPC once their tensors are
    written (as a write running out of space would), the ones after succeed."""

    def __init__(self, times: int) -> None:
        self.times = times

    def __call__(self, point: str) -> None:
        if point == "tensors-written" and self.times > 0:
            self.times -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _steps(d: Path) -> list[int]:
    return [int(p.stem.split("-")[1]) for p in latest_checkpoints(d)]


@pytest.mark.parametrize("point", ["tensors-written", "tensors-renamed", "meta-written"])
def test_a_failed_save_removes_its_own_files(tmp_path, point):
    save_checkpoint(tmp_path, _state(10), RUN, DIGEST, keep=3)
    before = _names(tmp_path)

    def fail(at: str) -> None:
        if at == point:
            raise OSError(errno.EIO, "injected")

    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, _state(20), RUN, DIGEST, keep=3, hook=fail)
    assert _names(tmp_path) == before  # no .tmp, no uncommitted tensors file


def test_a_full_disk_prunes_beyond_keep_and_retries_once(tmp_path, caplog):
    ck = Checkpointer(tmp_path, RUN, DIGEST, every_steps=10, keep=3)
    for step in (10, 20, 30):
        ck.save_async(_state(step))
    ck.wait(30)
    ck.hook = FullDisk(times=1)
    ck.save_async(_state(40))
    ck.wait(30)
    assert ck.failed == 0 and _steps(tmp_path) == [40, 30, 20]
    assert not [n for n in _names(tmp_path) if n.endswith(".tmp")]
    assert any("retrying once" in r.getMessage() for r in caplog.records)
    assert load_latest(tmp_path, RUN, DIGEST)[0].step == 40


def test_a_disk_still_full_after_pruning_fails_cleanly_and_keeps_the_newest(tmp_path):
    ck = Checkpointer(tmp_path, RUN, DIGEST, every_steps=10, keep=3)
    for step in (10, 20, 30):
        ck.save_async(_state(step))
    ck.wait(30)
    good_at = ck.newest_good
    ck.hook = FullDisk(times=2)
    ck.save_async(_state(40))
    ck.wait(30)
    assert ck.failed == 1 and ck.newest_good == good_at
    assert _steps(tmp_path) == [30, 20]  # pruned for room; the failed one left nothing
    assert all(n.startswith("ckpt-") and not n.endswith(".tmp") for n in _names(tmp_path))


def test_keep_one_never_prunes_the_last_good_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path, RUN, DIGEST, every_steps=10, keep=1)
    ck.save_async(_state(10))
    ck.wait(30)
    ck.hook = FullDisk(times=2)
    ck.save_async(_state(20))
    ck.wait(30)
    assert ck.failed == 1 and _steps(tmp_path) == [10]


def test_age_of_the_newest_good_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path, RUN, DIGEST, every_steps=10, keep=3)
    assert ck.age_s() is None
    path = save_checkpoint(tmp_path, _state(10), RUN, DIGEST, keep=3)
    ck.note_good(path)  # as a resume does
    assert 0.0 <= ck.age_s() < 60.0
    assert ck.age_s(now=ck.newest_good + 90.0) == pytest.approx(90.0)
    class Checkpointed(QuietFacts):
        def checkpoint_age(self) -> float | None:
            return 12.34

    status = NodeStatus(RUN, facts=Checkpointed())
    assert status.snapshot()["checkpoint_age_s"] == 12.3
    assert "dilonode_checkpoint_age_seconds 12.3\n" in render(node_metrics(status.snapshot()))
    assert NodeStatus(RUN).snapshot()["checkpoint_age_s"] is None


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, timeout=10)
    return done.returncode == 0


def test_a_real_full_tmpfs(tmp_path, caplog):
    """Checkpoints of ~400 KB on a 1 MiB tmpfs: the third does not fit until the oldest
    goes; a state that never fits fails without leaving a byte behind."""
    disk = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        ck = Checkpointer(disk, RUN, DIGEST, every_steps=10, keep=2)
        for step in (10, 20, 30):
            ck.save_async(_state(step, numel=25_000))
            ck.wait(30)
        assert ck.failed == 0 and _steps(disk) == [30, 20]
        assert any("No space left" in r.getMessage() and "retrying once" in r.getMessage()
                   for r in caplog.records)  # the third one made room by pruning
        ck.save_async(_state(40, numel=200_000))  # 3.2 MB: never fits
        ck.wait(30)
        assert ck.failed == 1 and _steps(disk) == [30]  # pruned to keep - 1, then gave up
        assert _names(disk) == ["ckpt-0000000030.json", "ckpt-0000000030.safetensors"]
        assert load_latest(disk, RUN, DIGEST)[0].step == 30
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=10)
