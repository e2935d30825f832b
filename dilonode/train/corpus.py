"""Parquet and Arrow corpora on disk: their files, their units, and the texts of one unit.

`open_corpus(cfg)` lists the files of ``data.source = "parquet"`` (a ``.parquet`` file, or a
folder searched recursively, sorted paths) or ``"arrow"`` (a folder written by `datasets`'
``save_to_disk``: the ``data-*.arrow`` files its ``state.json`` names, in that order; a
folder of several splits, ``dataset_dict.json``, is read at ``data.split``; or one
``.arrow`` file) and cuts them into units: a Parquet row group or an Arrow record batch, or
pieces of ``data.unit_rows`` rows of a larger one. Only metadata is read to do so. Units are
what the streams (`dilonode.train.stream`) order, hold out and resume at.

`Corpus.texts(unit, skip)` yields the text column of one unit, a few rows at a time
(`read_rows`), so memory holds one small batch of documents whatever the corpus' size:
Parquet is read with pre-buffering off (a row group is not loaded whole), Arrow files are
memory-mapped. Only pyarrow is needed (the `parquet` extra), not the `datasets` package.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilonode.config import DataConfig

__all__ = ["Corpus", "Unit", "list_arrow_files", "list_parquet_files", "open_corpus",
           "require_pyarrow"]

READ_ROWS = 128  # rows decoded at once: bounds the documents held in memory
_PARQUET_BUFFER = 1 << 20  # bytes per read when a row group is streamed page by page


def require_pyarrow(source: str) -> Any:
    """The pyarrow module, or a one-line ValueError naming the extra that brings it."""
    try:
        import pyarrow
    except ImportError:
        raise ValueError(f"data.source = {source!r}: needs the 'pyarrow' package: "
                         "pip install 'dilonode[parquet]'") from None
    return pyarrow


@dataclass(frozen=True)
class Unit:
    """Rows [start, start + rows) of row group (Parquet) or record batch (Arrow) `group` of
    file number `file` of the corpus."""

    file: int
    group: int
    start: int
    rows: int


def list_parquet_files(path: Path) -> list[Path]:
    """A .parquet file itself, or every .parquet file under a folder in sorted path order."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".parquet":
            raise ValueError(f"data.path = {str(path)!r}: expected a .parquet file or a "
                             "folder of them")
        return [path]
    if not path.is_dir():
        raise ValueError(f"data.path = {str(path)!r}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() == ".parquet")
    if not files:
        raise ValueError(f"data.path = {str(path)!r}: no .parquet files found")
    return files


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({type(exc).__name__})") from None


def _split_folder(path: Path, split: str) -> Path:
    """A save_to_disk DatasetDict folder's split `split`."""
    info = _read_json(path / "dataset_dict.json")
    splits = info.get("splits") if isinstance(info, dict) else None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise ValueError(f"{path / 'dataset_dict.json'}: expected {{\"splits\": [names]}}")
    if split not in splits:
        raise ValueError(f"data.split = {split!r}: {path} holds the splits "
                         f"{', '.join(splits) or '(none)'}")
    return path / split


def _state_files(folder: Path) -> list[Path] | None:
    """The data files a save_to_disk state.json names, in its order; None without one."""
    if not (folder / "state.json").is_file():
        return None
    state = _read_json(folder / "state.json")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries):
        raise ValueError(f"{folder / 'state.json'}: no _data_files list of filenames")
    files = [folder / e["filename"] for e in entries]
    for f in files:
        if not f.is_file():
            raise ValueError(f"{folder / 'state.json'} names {f.name}: no such file")
    return files


def list_arrow_files(path: Path, split: str = "train") -> list[Path]:
    """The Arrow files of a save_to_disk folder (state.json's order, else sorted *.arrow),
    of split `split` of a DatasetDict folder, or one .arrow file."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".arrow":
            raise ValueError(f"data.path = {str(path)!r}: expected a save_to_disk folder or "
                             "an .arrow file")
        return [path]
    if not path.is_dir():
        raise ValueError(f"data.path = {str(path)!r}: no such file or directory")
    if (path / "dataset_dict.json").is_file():
        path = _split_folder(path, split)
    files = _state_files(path)
    if files is None:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".arrow")
    if not files:
        raise ValueError(f"data.path = {str(path)!r}: no .arrow files (expected a folder "
                         "written by datasets' save_to_disk)")
    return files


def _check_column(schema: Any, column: str, where: Path) -> None:
    import pyarrow as pa

    if column not in schema.names:
        raise ValueError(f"data.text_column = {column!r}: no such column in {where} "
                         f"(columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    is_view = getattr(pa.types, "is_string_view", lambda _t: False)
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise ValueError(f"data.text_column = {column!r}: {where} stores it as {kind}, "
                         "expected a string column")


def _cut(file: int, sizes: list[int], unit_rows: int) -> list[Unit]:
    return [Unit(file, g, start, min(unit_rows, rows - start))
            for g, rows in enumerate(sizes) for start in range(0, rows, unit_rows)]


def _open_arrow(path: Path) -> Any:
    """A reader over a memory-mapped Arrow IPC file: the file format (random access to
    batches) or the stream format save_to_disk writes."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(source)


def _arrow_batches(reader: Any) -> Iterator[Any]:
    if hasattr(reader, "num_record_batches"):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


class Corpus:
    """The files and units of one Parquet or Arrow corpus (see the module docstring)."""

    def __init__(self, kind: str, root: Path, files: list[Path], column: str,
                 unit_rows: int, read_rows: int = READ_ROWS) -> None:
        self.kind, self.root, self.files, self.column = kind, root, files, column
        self.read_rows = read_rows
        sizes = [self._group_sizes(f) for f in files]
        self.units = [u for i, s in enumerate(sizes) for u in _cut(i, s, unit_rows)]
        listing = [[self._name(f), f.stat().st_size, s] for f, s in zip(files, sizes,
                                                                           strict=True)]
        blob = json.dumps([kind, column, unit_rows, listing]).encode()
        # Names the corpus and its cut: a resume position is only valid for the same one.
        self.fingerprint = hashlib.sha256(blob).hexdigest()[:16]

    def _name(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else path.name

    def _group_sizes(self, path: Path) -> list[int]:
        """Rows per row group / record batch, from metadata only; checks the text column."""
        import pyarrow as pa

        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                with pq.ParquetFile(str(path)) as pf:
                    meta = pf.metadata
                _check_column(meta.schema.to_arrow_schema(), self.column, path)
                return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            reader = _open_arrow(path)
            _check_column(reader.schema, self.column, path)
            return [b.num_rows for b in _arrow_batches(reader)]
        except (OSError, pa.ArrowException) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{path}: unreadable {self.kind} file ({first})") from None

    def texts(self, unit: Unit, skip: int = 0) -> Iterator[list[str | None]]:
        """The unit's texts from its row `skip` on, a few rows per list (None: a null)."""
        first = unit.start + skip
        end = unit.start + unit.rows
        seen = 0  # rows of the group before the current batch
        for batch in self._group_batches(unit):
            n = batch.num_rows
            lo, hi = max(first - seen, 0), min(end - seen, n)
            seen += n
            if lo < hi:
                yield batch.column(0).slice(lo, hi - lo).to_pylist()
            if seen >= end:
                return

    def _group_batches(self, unit: Unit) -> Iterator[Any]:
        """Record batches of the text column alone, over the unit's row group / batch."""
        path = self.files[unit.file]
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            with pq.ParquetFile(str(path), pre_buffer=False,
                                buffer_size=_PARQUET_BUFFER) as pf:
                yield from pf.iter_batches(batch_size=self.read_rows, row_groups=[unit.group],
                                           columns=[self.column], use_threads=False)
            return
        reader = _open_arrow(path)
        for g, batch in enumerate(_arrow_batches(reader)):
            if g == unit.group:  # memory-mapped: slices are views, only touched pages load
                column = batch.select([self.column])
                for lo in range(0, batch.num_rows, self.read_rows):
                    yield column.slice(lo, self.read_rows)
                return


def open_corpus(cfg: DataConfig, read_rows: int = READ_ROWS) -> Corpus:
    """The corpus `cfg` names (source parquet or arrow); ValueError names a bad field or file."""
    require_pyarrow(cfg.source)
    assert cfg.path is not None  # DataConfig guarantees a path for these sources
    root = Path(cfg.path)
    if cfg.source == "parquet":
        files = list_parquet_files(root)
    elif cfg.source == "arrow":
        files = list_arrow_files(root, cfg.split)
    else:
        raise ValueError(f"data.source = {cfg.source!r}: not a Parquet or Arrow source")
    base = root if root.is_dir() else root.parent
    return Corpus(cfg.source, base, files, cfg.text_column, cfg.unit_rows, read_rows)
