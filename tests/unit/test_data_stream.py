"""Streamed Parquet/Arrow data (dilonode.train.stream, dilonode.train.corpus): what each worker
reads, that the eval split is held out, resuming, bounded memory and one-line errors. Every
corpus is written here, in tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dilonode.config import DataConfig
from dilonode.train.corpus import open_corpus
from dilonode.train.data import load_data
from dilonode.train.stream import StreamData, Walk, eval_units, unit_order, walk_start
from dilonode.train.tokens import DOC_SEPARATOR, ByteTokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SEQ, BATCH = 16, 4
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)


def _docs(n: int, seed: int = 0, lo: int = 40, hi: int = 400) -> list[str]:
    """Random letter documents: any 17 bytes of one are found nowhere else."""
    rng = np.random.default_rng(seed)
    return [_LETTERS[rng.integers(0, len(_LETTERS), size=int(rng.integers(lo, hi)))]
            .tobytes().decode() for _ in range(n)]


def _parquet(path: Path, docs: list[str], row_group: int, **kw: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    pq.write_table(table, path, row_group_size=row_group, **kw)
    return path


def _save_to_disk_layout(folder: Path, docs: list[str], batch_rows: int, files: int) -> None:
    """What datasets' save_to_disk writes: Arrow IPC streams named by state.json."""
    folder.mkdir(parents=True)
    per = -(-len(docs) // files)
    names = []
    for i in range(files):
        names.append(f"data-{i:05d}-of-{files:05d}.arrow")
        part = pa.table({"text": docs[i * per:(i + 1) * per]})
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, \
                pa.ipc.new_stream(sink, part.schema) as writer:
            for batch in part.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "test",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))


def _cfg(path: Path, source: str = "parquet", **kw: object) -> DataConfig:
    base: dict[str, object] = {"seq_len": SEQ, "batch_size": BATCH, "eval_fraction": 0.1,
                               "eval_batches": 2}
    return DataConfig(source=source, path=path, **{**base, **kw})


def _stream_bytes(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> bytes:
    """The token stream the batches cover: each batch's x, in order, then the last target."""
    flat = [x.flatten() for x, _ in batches] + [batches[-1][1][-1, -1:]]
    return torch.cat(flat).numpy().astype(np.uint8).tobytes()


def _windows(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> set[bytes]:
    """Every window (x row plus its last target) of the batches, as bytes."""
    out = set()
    for x, y in batches:
        full = torch.cat([x, y[:, -1:]], dim=1).numpy().astype(np.uint8)
        out.update(row.tobytes() for row in full)
    return out


def _unit_text(data: StreamData, docs: list[str], unit_ids: np.ndarray, row_group: int) -> str:
    """The documents of the given training units (one file, groups of row_group rows)."""
    parts = []
    for i in unit_ids:
        u = data.train_units[int(i)]
        first = u.group * row_group + u.start
        parts.extend(d + DOC_SEPARATOR for d in docs[first:first + u.rows])
    return "".join(parts)


def _take(stream, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(stream) for _ in range(n)]


def test_a_stream_is_the_walks_documents_packed_in_order(tmp_path: Path) -> None:
    docs = _docs(600)
    _parquet(tmp_path / "c" / "part-0.parquet", docs, row_group=50)
    data = load_data(_cfg(tmp_path / "c", unit_rows=20))
    assert isinstance(data, StreamData) and data.vocab_size == 256
    assert len(data.corpus.units) == 36 and len(data.eval_units) == 4  # 50 -> 20 + 20 + 10
    walk = Walk(len(data.train_units), 0, 7, None)
    batches = _take(data.train_batches(7, SEQ, BATCH, seed=0), 200)
    got = _stream_bytes(batches)
    assert got.decode() == _unit_text(data, docs, walk.units(0), 50)[:len(got)]
    x, y = batches[0]
    assert x.shape == y.shape == (BATCH, SEQ) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[1:, 0], y[:-1, -1])


def test_the_walk_wraps_into_the_next_epochs_order(tmp_path: Path) -> None:
    docs = _docs(60, lo=20, hi=40)
    _parquet(tmp_path / "c.parquet", docs, row_group=10)
    data = load_data(_cfg(tmp_path / "c.parquet", eval_fraction=0.2))  # 6 units, 1 held out
    stream = data.train_batches(0, SEQ, BATCH, seed=3)
    text = "".join(_unit_text(data, docs, Walk(5, 3, 0, None).units(e), 10) for e in range(3))
    batches = []
    while stream.state()["epoch"] < 2:
        batches.append(next(stream))
    got = _stream_bytes(batches).decode()
    assert got == text[:len(got)] and len(got) > len(text) // 3 * 2
    assert not np.array_equal(unit_order(5, 3, 0), unit_order(5, 3, 1))


def test_save_to_disk_folders_read_with_pyarrow_alone(tmp_path: Path) -> None:
    docs = _docs(300)
    _save_to_disk_layout(tmp_path / "ds", docs, batch_rows=25, files=3)
    arrow = load_data(_cfg(tmp_path / "ds", "arrow", unit_rows=1000))
    assert len(arrow.corpus.units) == 12 and arrow.corpus.files[0].name.startswith("data-0")
    _parquet(tmp_path / "p.parquet", docs, row_group=25)
    parquet = load_data(_cfg(tmp_path / "p.parquet"))
    for a, b in zip(_take(arrow.train_batches(1, SEQ, BATCH, 0), 40),
                    _take(parquet.train_batches(1, SEQ, BATCH, 0), 40), strict=True):
        assert torch.equal(a[0], b[0])  # the same rows, the same cut: the same stream
    # One Arrow IPC file in the file format (random access to its batches) reads alike.
    table = pa.table({"text": docs})
    with pa.OSFile(str(tmp_path / "one.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=25):
            writer.write_batch(batch)
    single = load_data(_cfg(tmp_path / "one.arrow", "arrow"))
    assert torch.equal(next(single.train_batches(1, SEQ, BATCH, 0))[0],
                       next(parquet.train_batches(1, SEQ, BATCH, 0))[0])
    # A folder of several splits is read at data.split.
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    _save_to_disk_layout(tmp_path / "dd" / "train", docs, batch_rows=25, files=1)
    _save_to_disk_layout(tmp_path / "dd" / "test", docs[:50], batch_rows=25, files=1)
    assert len(load_data(_cfg(tmp_path / "dd", "arrow")).corpus.units) == 12
    with pytest.raises(ValueError, match="data.split = 'valid': .* holds the splits train, test"):
        load_data(_cfg(tmp_path / "dd", "arrow", split="valid"))


def test_a_folder_datasets_wrote_when_it_is_installed(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = _docs(400)
    datasets.Dataset.from_dict({"text": docs, "n": list(range(400))}).save_to_disk(
        str(tmp_path / "ds"), num_shards=2)
    data = load_data(_cfg(tmp_path / "ds", "arrow", unit_rows=50))
    assert len(data.corpus.units) == 8
    seen = "".join(d + DOC_SEPARATOR for d in docs)
    batches = _take(data.train_batches(0, SEQ, BATCH, 0), 30)
    assert all(w.decode() in seen for w in _windows(batches))


def test_eval_units_are_never_in_any_train_stream(tmp_path: Path) -> None:
    docs = _docs(400)
    _parquet(tmp_path / "c.parquet", docs, row_group=20)
    data = load_data(_cfg(tmp_path / "c.parquet", eval_fraction=0.25))
    assert eval_units(20, 0.25) == [2, 6, 10, 14, 18]  # evenly spaced, seed-independent
    held = "".join(d + DOC_SEPARATOR for u in data.eval_units
                   for d in docs[u.group * 20:u.group * 20 + u.rows]).encode()
    grams = {held[i:i + SEQ + 1] for i in range(len(held) - SEQ)}
    evals = data.eval_batches(SEQ, BATCH, 2)
    assert _windows(evals) <= grams  # the eval batches come from the held-out units
    streams = [data.train_batches(w, SEQ, BATCH, seed=1) for w in (0, 1, "peer-a")]
    streams.append(load_data(_cfg(tmp_path / "c.parquet", eval_fraction=0.25, shard_index=1,
                                  shard_count=3)).train_batches(0, SEQ, BATCH, seed=1))
    for stream in streams:
        batches = []
        while stream.state()["epoch"] < 2:  # every training unit, twice
            batches.append(next(stream))
        assert not _windows(batches) & grams


def test_streams_are_reproducible_in_another_process(tmp_path: Path) -> None:
    _parquet(tmp_path / "c.parquet", _docs(300), row_group=30)
    data = load_data(_cfg(tmp_path / "c.parquet"))
    here = [b[0].tolist() for b in _take(data.train_batches("peer-x", SEQ, BATCH, 5), 5)]
    code = ("import json, sys; from dilonode.config import DataConfig; "
            "from dilonode.train.data import load_data; "
            f"d = load_data(DataConfig(source='parquet', path=sys.argv[1], seq_len={SEQ}, "
            f"batch_size={BATCH}, eval_batches=2)); s = d.train_batches('peer-x', {SEQ}, "
            f"{BATCH}, 5); print(json.dumps([next(s)[0].tolist() for _ in range(5)]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.parquet")],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == here
    again = [b[0].tolist() for b in _take(data.train_batches("peer-x", SEQ, BATCH, 5), 5)]
    assert again == here


def test_workers_by_identity_start_apart_and_share_no_window(tmp_path: Path) -> None:
    for n_units in (50, 1000, 20000):
        for m in range(2, 33):
            starts = sorted(walk_start(i, n_units, seed=4) for i in range(m))
            gaps = [(starts[(k + 1) % m] - starts[k]) % n_units for k in range(m)]
            assert min(gaps) >= n_units / (3 * m) - 1, (n_units, m)
    assert walk_start("peer-a", 1000, 0) == walk_start("peer-a", 1000, 0)
    _parquet(tmp_path / "c.parquet", _docs(1000), row_group=25)
    data = load_data(_cfg(tmp_path / "c.parquet"))  # 36 training units
    a, b = (_take(data.train_batches(w, SEQ, BATCH, seed=0), 150) for w in (0, 1))
    assert not _windows(a) & _windows(b)


def test_strict_shards_partition_every_epoch_and_share_no_window(tmp_path: Path) -> None:
    _parquet(tmp_path / "c.parquet", _docs(500), row_group=20)
    walks = [Walk(23, 9, "ignored", (k, 3)) for k in range(3)]
    for epoch in (0, 1):
        placed = np.concatenate([w.units(epoch) for w in walks])
        assert sorted(placed.tolist()) == list(range(23))
    windows = []
    for k in range(3):
        cfg = _cfg(tmp_path / "c.parquet", shard_index=k, shard_count=3)
        stream = load_data(cfg).train_batches(f"any-{k}", SEQ, BATCH, seed=9)
        batches = []
        while True:  # every batch whose tokens all lie in epoch 0
            batch = next(stream)
            if stream.state()["epoch"] > 0:
                break
            batches.append(batch)
        windows.append(_windows(batches))
    assert all(windows) and not (windows[0] & windows[1] or windows[0] & windows[2]
                                 or windows[1] & windows[2])
    with pytest.raises(ValueError, match="data.shard_count = 40: the corpus has only 23"):
        load_data(_cfg(tmp_path / "c.parquet", shard_index=0, shard_count=40))


def test_restore_continues_exactly_where_the_stream_was(tmp_path: Path) -> None:
    docs = _docs(120, lo=10, hi=3000)  # long rows are cut into several tokenizer pieces
    _parquet(tmp_path / "c.parquet", docs, row_group=7)
    cfg = _cfg(tmp_path / "c.parquet", unit_rows=5)
    data = StreamData(open_corpus(cfg, read_rows=3), ByteTokenizer(), cfg, piece_chars=256)
    whole = _take(data.train_batches(2, SEQ, BATCH, 0), 400)
    for k in (0, 1, 13, 77, 250, 399):
        stream = data.train_batches(2, SEQ, BATCH, 0)
        _take(stream, k)
        position = json.loads(json.dumps(stream.state()))
        resumed = data.train_batches(2, SEQ, BATCH, 0)
        assert resumed.mismatch(position) is None
        resumed.restore(position)
        for want, got in zip(whole[k:k + 3], _take(resumed, 3), strict=False):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    other = data.train_batches(3, SEQ, BATCH, 0)
    assert "walk" in (other.mismatch(position) or "")
    assert "seed" in (data.train_batches(2, SEQ, BATCH, 1).mismatch(position) or "")
    with pytest.raises(ValueError, match="data position: made for another walk"):
        other.restore(position)


def test_restore_with_a_bpe_tokenizer_mid_row(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    docs = _docs(80, lo=50, hi=2000)
    tok.train_from_iterator(docs, tokenizers.trainers.BpeTrainer(vocab_size=300,
                                                                 special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    _parquet(tmp_path / "c.parquet", docs, row_group=8)
    data = load_data(_cfg(tmp_path / "c.parquet", tokenizer=str(tmp_path / "tokenizer.json")))
    assert data.vocab_size == tok.get_vocab_size()
    whole = _take(data.train_batches(0, SEQ, BATCH, 0), 60)
    stream = data.train_batches(0, SEQ, BATCH, 0)
    _take(stream, 31)
    assert stream.state()["token"] > 0  # the next batch starts inside a row
    resumed = data.train_batches(0, SEQ, BATCH, 0)
    resumed.restore(stream.state())
    assert all(torch.equal(w[0], g[0]) for w, g in zip(whole[31:], _take(resumed, 29),
                                                       strict=True))


def test_memory_stays_bounded_on_a_file_much_larger(tmp_path: Path) -> None:
    """16 MB of text through the stream; it never holds more than a batch and one tokenizer
    call of tokens, and pyarrow never more than a few pages of the file."""
    rng = np.random.default_rng(1)
    blob = _LETTERS[rng.integers(0, len(_LETTERS), size=16 << 20)].tobytes().decode()
    cuts = np.cumsum(rng.integers(500, 1500, size=len(blob) // 500))
    cuts = cuts[cuts < len(blob)]
    docs = [blob[a:b] for a, b in zip(np.r_[0, cuts[:-1]], cuts, strict=True)]
    _parquet(tmp_path / "big.parquet", docs, row_group=8000, data_page_size=1 << 16,
             use_dictionary=False)
    del blob
    size = (tmp_path / "big.parquet").stat().st_size
    cfg = _cfg(tmp_path / "big.parquet", seq_len=256, batch_size=8, unit_rows=2000)
    piece = 4096
    data = StreamData(open_corpus(cfg, read_rows=64), ByteTokenizer(), cfg, piece_chars=piece)
    del docs
    token_bound, arrow_bound = 8 * 256 + 2 * piece, 4 << 20
    assert size > 4 * arrow_bound
    base, peak, n = pa.total_allocated_bytes(), 0, 0
    stream = data.train_batches(0, 256, 8, seed=0)
    while stream.state()["epoch"] == 0:  # the whole training part of the file
        next(stream)
        n += 1
        peak = max(peak, pa.total_allocated_bytes() - base)
        assert stream.peak_buffer <= token_bound
    assert n * 8 * 256 > 0.8 * size and peak < arrow_bound


def test_user_errors_are_one_line_naming_the_field(tmp_path: Path, monkeypatch) -> None:
    _parquet(tmp_path / "c.parquet", _docs(100), row_group=10)
    _parquet(tmp_path / "one.parquet", _docs(100), row_group=100)
    (tmp_path / "ints").mkdir()
    pq.write_table(pa.table({"text": list(range(20))}), tmp_path / "ints" / "i.parquet")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    cases = [
        (_cfg(tmp_path / "c.parquet", text_column="body"),
         "data.text_column = 'body': no such column in .* \\(columns: text, id\\)"),
        (_cfg(tmp_path / "ints"), "data.text_column = 'text': .* expected a string column"),
        (_cfg(tmp_path / "empty"), "no .parquet files found"),
        (_cfg(tmp_path / "empty", "arrow"), "no .arrow files"),
        (_cfg(tmp_path / "missing"), "no such file or directory"),
        (_cfg(tmp_path / "junk.parquet"), "junk.parquet: unreadable parquet file"),
        (_cfg(tmp_path / "one.parquet", unit_rows=100), "1 unit\\(s\\): need at least 2"),
        (_cfg(tmp_path / "c.parquet", eval_batches=500), "the eval units .* hold fewer"),
    ]
    for cfg, needle in cases:
        with pytest.raises(ValueError, match=needle) as err:
            load_data(cfg)
        assert "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if the extra were not installed
    with pytest.raises(ValueError, match=r"needs the 'pyarrow' package: .*dilonode\[parquet\]"):
        load_data(_cfg(tmp_path / "c.parquet"))


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path: Path) -> None:
    _parquet(tmp_path / "c.parquet", _docs(100), row_group=10)
    cfg = _cfg(tmp_path / "c.parquet")

    class Small(ByteTokenizer):
        vocab_size = 100  # letters are ids 97..122

    data = StreamData(open_corpus(cfg), Small(), cfg)
    with pytest.raises(ValueError, match="token id 1.. >= vocab_size 100") as err:
        next(data.train_batches(0, SEQ, BATCH, 0))
    assert "\n" not in str(err.value)
