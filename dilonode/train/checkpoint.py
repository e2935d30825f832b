"""Local checkpoints of a node's outer state: crash-safe writes, verified reads, last K kept.

A checkpoint is two or three files in one folder, named by the step:

    ckpt-0000001200.safetensors   the `WorkerState` tensors (outer weights, outer momentum,
                                  error-feedback residuals when the run uses them)
    ckpt-0000001200.data.json     where the worker's data stream stood (`BatchStream.state`)
    ckpt-0000001200.json          run id, config digest, step, round counters, outer step
                                  counters, the sha256 of the other files (and the
                                  tensors' size)

All are written to a temp file, fsynced and renamed, tensors first; the JSON is the commit
record, so a checkpoint exists only once its JSON is in place, and the folder is fsynced
after the renames. The data position is the worker's own (taken with the state, between two
steps): `resume_data` hands it back to the worker on resume, so its stream goes on with the
batch after the last one it trained on. A checkpoint without one, or with one that is torn
or belongs to another stream, resumes with the stream from its beginning and one warning.

A kill at any point leaves the previous checkpoints intact and at worst a stray temp, tensor
or data file, which the next save removes; a save that fails (an I/O error, a full disk)
removes its own temp and uncommitted files at once, so a full disk does not fill up further
with every attempt. `load_latest` walks from the newest checkpoint down, checks the hash, run
id and config digest, reports a bad one in one log line and falls back to the one before.

`Checkpointer` is the training thread's handle: `maybe_save(worker)` after each step takes a
copy of the outer state when one is due (`Worker.export_state`: the state after the rounds
landed so far, named by the step at which exactly those have landed) and writes it in a
background thread, so training never waits on the disk; a save still running when the next
is due makes that one skipped, not queued. On a full disk (ENOSPC, EDQUOT) it removes the
oldest checkpoints down to `keep - 1` (never the last one) and retries once, so the newest
`keep` still fit. `age_s()` is the age of the newest good checkpoint, for the status page
and the node's summary.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from dilonode.train.state import WorkerState

__all__ = ["Checkpointer", "data_position", "latest_checkpoints", "load_checkpoint",
           "load_data_position", "load_latest", "resume_data", "save_checkpoint"]

log = logging.getLogger(__name__)

FORMAT = 1
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_NAME = re.compile(r"^ckpt-(\d{10})\.json$")
_DATA_SUFFIX = ".data.json"
# Tensor name prefix of a fragment's error-feedback residual (`WorkerState.residuals`).
_RESIDUAL = "residual."
# Called with the name of each point a save passes ("tensors-written", "tensors-renamed",
# "meta-written"); tests use it to kill or fail a save at a chosen point.
FaultHook = Callable[[str], None]


def _stem(step: int) -> str:
    return f"ckpt-{step:010d}"


def _write_durably(path: Path, data: bytes, hook: FaultHook | None, point: str) -> None:
    """Write `data` to `path` via a temp file: write, fsync, (hook), rename. On failure
    the temp file is removed (on a full disk it would hold space nobody can use)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if hook:
            hook(point)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def data_position(worker: Any) -> dict[str, Any] | None:
    """Where `worker`'s data stream stands (`Worker.data_position`), None if it tells none."""
    get = getattr(worker, "data_position", None)
    return get() if callable(get) else None


def save_checkpoint(directory: Path, state: WorkerState, run_id: str, digest: str,
                    keep: int, hook: FaultHook | None = None,
                    position: dict[str, Any] | None = None) -> Path:
    """Write `state` (and the data stream's `position`, when given) as a checkpoint in
    `directory` and prune to the newest `keep`; returns the JSON path. Runs on any thread;
    `state` and `position` must not be mutated meanwhile (they are copies)."""
    from safetensors.torch import save

    directory.mkdir(parents=True, exist_ok=True)
    # Named by the step the worker was at (not the latest equivalent one joiners adopt).
    if state.taken_at is not None:
        state = dataclasses.replace(state, step=min(state.step, state.taken_at))
    stem = _stem(state.step)
    own = {f"{_RESIDUAL}{p}": r for p, r in state.residuals.items()}
    blob = save({k: v.contiguous() for k, v in {**state.tensors, **own}.items()},
                metadata={"run_id": run_id, "config_digest": digest})
    tensors, path = directory / f"{stem}.safetensors", directory / f"{stem}.json"
    data = directory / f"{stem}{_DATA_SUFFIX}"
    try:
        _write_durably(tensors, blob, hook, "tensors-written")
        if hook:
            hook("tensors-renamed")
        meta = {"format": FORMAT, "run_id": run_id, "config_digest": digest,
                "state": state.meta(), "tensors_file": tensors.name,
                "tensors_bytes": len(blob), "tensors_sha256": hashlib.sha256(blob).hexdigest(),
                "created": time.time()}
        if position is not None:
            text = json.dumps(position).encode()
            _write_durably(data, text, hook, "data-written")
            meta.update(data_file=data.name, data_sha256=hashlib.sha256(text).hexdigest())
        _write_durably(path, json.dumps(meta, indent=1).encode(), hook, "meta-written")
    except BaseException:
        if not path.exists():  # never committed: its other files are strays
            tensors.unlink(missing_ok=True)
            data.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    _prune(directory, keep)
    return path


def latest_checkpoints(directory: Path) -> list[Path]:
    """Committed checkpoints (their JSON files), newest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _prune(directory: Path, keep: int) -> int:
    """Keep the newest `keep` checkpoints, remove the rest and stray files; returns how
    many files it removed."""
    committed = latest_checkpoints(directory)
    keep_stems = {p.stem for p in committed[:keep]}
    removed = 0
    for meta in committed[keep:]:
        meta.unlink(missing_ok=True)  # uncommit first: a half-pruned one is never "valid"
        removed += 1
    for p in directory.iterdir():
        stray = p.name.endswith(".tmp") or (p.suffix == ".safetensors"
                                            and p.stem not in keep_stems) \
            or (p.name.endswith(_DATA_SUFFIX)
                and p.name.removesuffix(_DATA_SUFFIX) not in keep_stems)
        if stray and p.name.startswith((".ckpt-", "ckpt-")):
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def load_checkpoint(meta_path: Path, run_id: str, digest: str) -> WorkerState:
    """Read and verify one checkpoint; ValueError with a one-line reason if it is unusable."""
    from safetensors.torch import load

    name = meta_path.stem
    try:
        meta = json.loads(meta_path.read_text())
        blob = (meta_path.parent / str(meta["tensors_file"])).read_bytes()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint {name}: unreadable ({type(exc).__name__}: {exc})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {name}: format {meta.get('format')!r} != {FORMAT}")
    if meta.get("run_id") != run_id:
        raise ValueError(f"checkpoint {name}: run id {meta.get('run_id')!r} != {run_id!r}")
    if meta.get("config_digest") != digest:
        raise ValueError(f"checkpoint {name}: made with different model/diloco/codec/seed "
                         "settings (config digest differs)")
    if len(blob) != meta.get("tensors_bytes") or \
            hashlib.sha256(blob).hexdigest() != meta.get("tensors_sha256"):
        raise ValueError(f"checkpoint {name}: tensors file is torn or corrupt (sha256 or size "
                         "does not match its metadata)")
    try:
        tensors = load(blob)
        residuals = {int(k.removeprefix(_RESIDUAL)): tensors.pop(k)
                     for k in [k for k in tensors if k.startswith(_RESIDUAL)]}
        state = WorkerState.from_meta(meta["state"], tensors)
        return dataclasses.replace(state, residuals=residuals) if residuals else state
    except Exception as exc:  # a hash-valid file can still hold nonsense written by a bug
        raise ValueError(f"checkpoint {name}: {exc}") from None


def load_latest(directory: Path, run_id: str,
                digest: str) -> tuple[WorkerState, Path] | None:
    """The newest checkpoint that verifies, logging one line per one skipped; None if none."""
    for meta_path in latest_checkpoints(directory):
        try:
            return load_checkpoint(meta_path, run_id, digest), meta_path
        except ValueError as exc:
            log.warning("%s; trying the previous one", exc)
    return None


def load_data_position(meta_path: Path) -> dict[str, Any] | None:
    """The data position saved with a checkpoint; None, with one warning, when there is
    none or it is torn (the stream then starts from its beginning)."""
    name = meta_path.stem
    try:
        meta = json.loads(meta_path.read_text())
        file = meta.get("data_file")
        if file is None:
            log.warning("checkpoint %s holds no data position; the data stream starts from "
                        "its beginning", name)
            return None
        text = (meta_path.parent / str(file)).read_bytes()
        if hashlib.sha256(text).hexdigest() != meta.get("data_sha256"):
            raise ValueError("sha256 does not match the checkpoint's")
        position = json.loads(text)
        if not isinstance(position, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("checkpoint %s: data position unreadable (%s: %s); the data stream "
                    "starts from its beginning", name, type(exc).__name__, exc)
        return None
    return position


def resume_data(worker: Any, meta_path: Path) -> bool:
    """Continue `worker`'s data stream where it stood when the checkpoint at `meta_path`
    was taken (`Worker.restore_data`); False, with one warning, when it cannot."""
    position = load_data_position(meta_path)
    if position is None:
        return False
    why = worker.restore_data(position)
    if why:
        log.warning("checkpoint %s: data position %s; the data stream starts from its "
                    "beginning", meta_path.stem, why)
        return False
    return True


class _Exportable(Protocol):
    step: int

    def export_state(self) -> WorkerState: ...


class Checkpointer:
    """Periodic background checkpoints of one worker; see the module docstring."""

    def __init__(self, directory: Path, run_id: str, digest: str, every_steps: int,
                 keep: int, hook: FaultHook | None = None) -> None:
        self.directory, self.run_id, self.digest = directory, run_id, digest
        self.every, self.keep, self.hook = every_steps, keep, hook
        self._next_due = every_steps
        self._thread: threading.Thread | None = None
        self.saved: list[Path] = []
        self.skipped = 0
        self.failed = 0
        self.newest_good: float | None = None  # unix time the newest good one was written

    def age_s(self, now: float | None = None) -> float | None:
        """Seconds since the newest good checkpoint was written (None: none yet); any
        thread."""
        newest = self.newest_good
        return None if newest is None else max((now or time.time()) - newest, 0.0)

    def note_good(self, meta_path: Path) -> None:
        """A checkpoint found good (resumed from): its age counts until the next save."""
        try:
            created = float(json.loads(meta_path.read_text())["created"])
        except (OSError, ValueError, KeyError, TypeError):
            created = meta_path.stat().st_mtime if meta_path.exists() else time.time()
        self.newest_good = max(self.newest_good or 0.0, created)

    def _save(self, state: WorkerState, position: dict[str, Any] | None) -> Path:
        """`save_checkpoint`; on a full disk, prune to `keep - 1` (at least one) and retry
        once: the newest `keep` then still fit, the new one included."""
        try:
            return save_checkpoint(self.directory, state, self.run_id, self.digest,
                                   self.keep, self.hook, position)
        except OSError as exc:
            if exc.errno not in _DISK_FULL:
                raise
            removed = _prune(self.directory, max(self.keep - 1, 1))
            log.warning("checkpoint at step %d: %s; removed %d older checkpoint file(s), "
                        "retrying once", state.step, exc.strerror or exc, removed)
        return save_checkpoint(self.directory, state, self.run_id, self.digest, self.keep,
                               self.hook, position)

    def start_from(self, step: int) -> None:
        """After a resume or a join: the next checkpoint is due a period after `step`."""
        if self.every:
            self._next_due = (step // self.every + 1) * self.every

    def maybe_save(self, worker: _Exportable) -> bool:
        """Training thread, after each step: start a background save if one is due."""
        if not self.every or worker.step < self._next_due:
            return False
        self.start_from(worker.step)
        if self._thread is not None and self._thread.is_alive():
            self.skipped += 1
            log.warning("checkpoint at step %d skipped: the previous one is still being "
                        "written", worker.step)
            return False
        try:
            state = worker.export_state()
        except RuntimeError as exc:  # the schedule has no step without a round in flight
            self.skipped += 1
            log.warning("checkpoint at step %d skipped: %s", worker.step, exc)
            return False
        self.save_async(state, data_position(worker))
        return True

    def save_async(self, state: WorkerState, position: dict[str, Any] | None = None) -> None:
        """Write `state` and the data `position` (copies nobody mutates) in the background,
        after any save running."""
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(state, position),
                                        name="dilonode-checkpoint", daemon=True)
        self._thread.start()

    def save_now(self, worker: _Exportable) -> Path | None:
        """Write a checkpoint of the current state and wait for it (clean shutdown)."""
        self.wait()
        try:
            state = worker.export_state()
        except RuntimeError as exc:  # nothing exportable: say so, never fail the shutdown
            self.failed += 1
            log.error("exit checkpoint skipped: %s", exc)
            return None
        self._write(state, data_position(worker))
        return self.saved[-1] if self.saved else None

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _write(self, state: WorkerState, position: dict[str, Any] | None = None) -> None:
        t0 = time.perf_counter()
        try:
            path = self._save(state, position)
        except Exception as exc:  # a full disk must not stop training; say it and go on
            self.failed += 1
            log.error("checkpoint at step %d failed: %s: %s", state.step,
                      type(exc).__name__, exc)
            return
        self.saved.append(path)
        self.newest_good = time.time()
        log.info("checkpoint %s: %d bytes in %.2f s", path.name, state.nbytes,
                 time.perf_counter() - t0)
