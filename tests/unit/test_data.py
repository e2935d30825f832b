"""Unit tests for dilonode.train.data and dilonode.train.prepare (small files in tmp_path)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dilonode.config import DataConfig
from dilonode.train.data import (
    DOC_SEPARATOR,
    TokenData,
    builtin_corpus,
    load_data,
    stable_seed,
)
from dilonode.train.prepare import prepare_data

SEQ = 16


def _cfg(**kw: object) -> DataConfig:
    return DataConfig(seq_len=SEQ, **kw)


def _text_folder(root: Path) -> bytes:
    """Writes a small .txt + nested .jsonl corpus; returns the expected byte stream."""
    (root / "sub").mkdir(parents=True)
    a = "The quick brown fox jumps over the lazy dog.\n" * 4
    b = ["first record, long enough to matter " * 2, "second record with ünïcode"]
    (root / "a.txt").write_text(a, encoding="utf-8")
    (root / "ignored.md").write_text("not read", encoding="utf-8")
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(b)]
    (root / "sub" / "b.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    # sorted paths: a.txt before sub/b.jsonl
    return "".join([a + DOC_SEPARATOR] + [t + DOC_SEPARATOR for t in b]).encode("utf-8")


def _all_tokens(data: TokenData) -> np.ndarray:
    return np.concatenate([np.asarray(data.train_tokens), np.asarray(data.eval_tokens)])


def test_builtin_corpus_is_bytes_and_split_at_the_end() -> None:
    corpus = builtin_corpus()
    assert isinstance(corpus, bytes) and len(corpus) > 300_000
    data = load_data(DataConfig())
    assert data.vocab_size == 256
    assert _all_tokens(data).tobytes() == corpus
    assert abs(len(data.eval_tokens) / len(corpus) - 0.1) < 0.001


def test_stable_seed_is_sha256_of_joined_parts() -> None:
    digest = hashlib.sha256(b"7:worker-3").digest()
    assert stable_seed(7, "worker-3") == int.from_bytes(digest[:8], "big") >> 1
    assert 0 <= stable_seed(0, 0) < 2**63
    assert stable_seed(0, 1) != stable_seed(1, 0)


def test_train_streams_reproducible_and_distinct_per_worker() -> None:
    data = load_data(DataConfig())

    def take(worker: int | str, seed: int) -> list[torch.Tensor]:
        stream = data.train_batches(worker, SEQ, 4, seed)
        return [next(stream)[0] for _ in range(3)]

    a = take(0, 5)
    assert all(torch.equal(p, q) for p, q in zip(a, take(0, 5), strict=True))
    for other in (take(1, 5), take("0x", 5), take(0, 6)):
        assert not torch.equal(a[0], other[0])


def test_train_windows_are_shifted_slices() -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 256
    data = TokenData(tokens[:900], tokens[900:], 256)
    x, y = next(data.train_batches(3, SEQ, 5, seed=0))
    assert x.shape == y.shape == (5, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], (x[:, -1] + 1) % 256)


def test_eval_batches_fixed_and_held_out_only() -> None:
    train = np.full(2000, 1, dtype=np.uint16)
    held = np.arange(300, dtype=np.uint16) + 2  # ids >= 2 appear only in the eval split
    data = TokenData(train, held, vocab_size=400)
    batches = data.eval_batches(SEQ, batch_size=4, n_batches=3)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == (4, SEQ) and bool((x >= 2).all()) and bool((y >= 2).all())
    again = data.eval_batches(SEQ, batch_size=4, n_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    first, last = batches[0][0][0, 0].item(), batches[-1][1][-1, -1].item()
    assert first == 2 and last == 301  # evenly spaced from the start to the very end
    x, _ = next(data.train_batches(0, SEQ, 8, seed=0))
    assert bool((x == 1).all())


def test_text_folder_txt_and_jsonl(tmp_path: Path) -> None:
    expected = _text_folder(tmp_path / "corpus")
    data = load_data(_cfg(source="text", path=tmp_path / "corpus", eval_fraction=0.25))
    assert data.vocab_size == 256
    assert _all_tokens(data).tobytes() == expected
    assert len(data.eval_tokens) == round(len(expected) * 0.25)


def test_malformed_jsonl_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=f"{bad}:2: not valid JSON") as err:
        load_data(_cfg(source="text", path=tmp_path))
    assert "\n" not in str(err.value)
    bad.write_text('{"text": "fine"}\n\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=f"{bad}:3: record has no string field 'text'"):
        load_data(_cfg(source="text", path=tmp_path))


def test_user_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("too short", encoding="utf-8")
    cases = [
        (_cfg(source="text", path=tmp_path), "too short"),
        (_cfg(source="text", path=tmp_path / "missing"), "no such file"),
        (_cfg(source="bin", path=tmp_path), "train.bin: no such file"),
        (_cfg(tokenizer=str(tmp_path / "nope.json")), "data.tokenizer"),
    ]
    for cfg, needle in cases:
        with pytest.raises(ValueError, match=needle) as err:
            load_data(cfg)
        assert "\n" not in str(err.value)


def test_prepare_then_load_bin_round_trip(tmp_path: Path) -> None:
    expected = _text_folder(tmp_path / "corpus")
    out = tmp_path / "shards"
    meta = prepare_data(tmp_path / "corpus", out, eval_fraction=0.25, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "bytes"
    assert meta["train_tokens"] + meta["val_tokens"] == len(expected)
    data = load_data(_cfg(source="bin", path=out))
    assert data.vocab_size == 256
    assert _all_tokens(data).astype(np.uint8).tobytes() == expected
    text = load_data(_cfg(source="text", path=tmp_path / "corpus", eval_fraction=0.25))
    assert np.array_equal(np.asarray(data.eval_tokens), text.eval_tokens)
    x, y = next(data.train_batches(0, SEQ, 2, seed=0))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_single_bin_file_and_out_of_range_tokens(tmp_path: Path) -> None:
    tokens = (np.arange(500) % 200).astype(np.uint32)
    tokens.tofile(tmp_path / "tokens.bin")
    data = load_data(_cfg(source="bin", path=tmp_path / "tokens.bin", bin_dtype="uint32"))
    assert np.array_equal(_all_tokens(data), tokens) and len(data.eval_tokens) == 50
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 100, "dtype": "uint32"}))
    with pytest.raises(ValueError, match="token id 199 >= vocab_size 100"):
        load_data(_cfg(source="bin", path=tmp_path / "tokens.bin"))


def _train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog",
                             "first record second record"] * 20, trainer=trainer)
    tok.save(str(path))


def test_local_tokenizer_json_through_prepare_and_load(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    tok_path = tmp_path / "tokenizer.json"
    _train_tokenizer(tok_path)
    _text_folder(tmp_path / "corpus")
    out = tmp_path / "shards"
    meta = prepare_data(tmp_path / "corpus", out, tokenizer=str(tok_path), eval_fraction=0.2,
                        progress=False)
    assert meta["tokenizer"] == str(tok_path) and meta["dtype"] == "uint16"
    binned = load_data(DataConfig(source="bin", path=out, seq_len=4))
    text = load_data(DataConfig(source="text", path=tmp_path / "corpus", seq_len=4,
                                tokenizer=str(tok_path), eval_fraction=0.2))
    assert binned.vocab_size == text.vocab_size == meta["vocab_size"] <= 120
    assert np.array_equal(_all_tokens(binned), _all_tokens(text))
    assert len(_all_tokens(text)) < 100  # BPE words, far fewer than the ~250 bytes
    x, _ = next(text.train_batches(0, 4, 2, seed=0))
    assert int(x.max()) < text.vocab_size


def test_random_windows_resume_from_their_state_and_refuse_another_streams() -> None:
    data = load_data(DataConfig())
    whole = data.train_batches("w", SEQ, 4, seed=2)
    batches = [next(whole) for _ in range(12)]
    stream = data.train_batches("w", SEQ, 4, seed=2)
    for _ in range(7):
        next(stream)
    position = json.loads(json.dumps(stream.state()))  # what a checkpoint keeps
    resumed = data.train_batches("w", SEQ, 4, seed=2)
    resumed.restore(position)
    assert all(torch.equal(next(resumed)[0], want) for want, _ in batches[7:])
    other = data.train_batches("v", SEQ, 4, seed=2)
    assert "key" in other.mismatch(position)
    assert other.mismatch({"kind": "stream"}) == "not the position of a random-window stream"
    with pytest.raises(ValueError, match="data position: made for another key"):
        other.restore(position)


def test_shards_draw_windows_from_their_own_share_of_the_tokens() -> None:
    tokens = np.repeat(np.arange(4, dtype=np.uint16), 500)  # share k holds only token k
    for k in range(4):
        data = TokenData(tokens, tokens[:100], 256, shard=(k, 4))
        x, y = next(data.train_batches("any", SEQ, 64, seed=0))
        assert bool((x == k).all()) and bool((y == k).all())
    cfg = _cfg(shard_index=1, shard_count=3)
    sharded = load_data(cfg)
    x, _ = next(sharded.train_batches(0, SEQ, 64, seed=0))
    third = len(sharded.train_tokens) // 3
    corpus = np.asarray(sharded.train_tokens[third:2 * third + 1])
    assert all(bytes(row.numpy().astype(np.uint8)) in corpus.tobytes() for row in x)
    with pytest.raises(ValueError, match="data.shard_count = 1000: a shard's share"):
        next(TokenData(tokens, tokens[:100], 256, shard=(0, 1000)).train_batches(0, SEQ, 2, 0))


def test_a_32k_tokenizer_gives_a_32k_embedding(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dilonode.config import ModelConfig
    from dilonode.train.model import build_model

    seen = sorted({w for w in builtin_corpus().decode().split()})
    words = ["[UNK]"] + seen + [f"<pad-{i}>" for i in range(32_000 - 1 - len(seen))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    data = load_data(DataConfig(tokenizer=str(tmp_path / "tokenizer.json"), seq_len=SEQ))
    assert data.vocab_size == 32_000
    for preset in ("nano", "tiny"):
        model = build_model(ModelConfig(preset=preset), data.vocab_size)
        assert model.tok_emb.num_embeddings == 32_000
        assert model.tok_emb.weight.shape[0] == 32_000
    x, _ = next(data.train_batches(0, SEQ, 8, seed=0))
    assert int(x.max()) < 32_000


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_prepare_parquet_and_save_to_disk_inputs(tmp_path: Path, layout: str) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"row {i} " + "ünïcode and plain words " * (i % 5 + 1) for i in range(300)]
    table = pa.table({"body": docs, "n": list(range(300))})
    src = tmp_path / "src"
    src.mkdir()
    if layout == "parquet":
        pq.write_table(table.slice(0, 120), src / "a.parquet", row_group_size=50)
        (src / "b").mkdir()
        pq.write_table(table.slice(120), src / "b" / "c.parquet", row_group_size=50)
    else:
        with pa.OSFile(str(src / "data-00000-of-00001.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=64):
                writer.write_batch(batch)
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
        (src / "state.json").write_text(json.dumps(state))
    meta = prepare_data(src, tmp_path / "out", eval_fraction=0.2, text_column="body",
                        progress=False)
    expected = "".join(d + DOC_SEPARATOR for d in docs).encode()
    binned = load_data(_cfg(source="bin", path=tmp_path / "out"))
    assert meta["train_tokens"] + meta["val_tokens"] == len(expected)
    assert _all_tokens(binned).astype(np.uint8).tobytes() == expected
    with pytest.raises(ValueError, match="data.text_column = 'text': no such column"):
        prepare_data(src, tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()
