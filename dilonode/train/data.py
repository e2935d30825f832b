"""Token data for training and evaluation: loading, tokenizing and cutting batches.

`load_data(cfg.data)` returns the training and eval data of the configured source and the
vocabulary size (`TrainData`). Sources:

* ``builtin``: the English help text shipped with every CPython (`pydoc_data.topics`), so a
  run needs no download;
* ``text``: a folder (searched recursively, sorted paths) of ``.txt`` and ``.jsonl`` files;
* ``bin``: a nanoGPT-layout folder (``train.bin``, ``val.bin``, optional ``meta.json``) as
  written by `dilonode.train.prepare.prepare_data`, or one ``.bin`` file;
* ``parquet`` and ``arrow``: Parquet files or a `datasets` save_to_disk folder, streamed
  (`dilonode.train.stream`, which documents what each worker reads).

The first three give a `TokenData`, 1-D train and eval token arrays in memory or memmapped.
Tokenization is byte-level (vocab 256) unless ``cfg.tokenizer`` names a local
``tokenizer.json`` (`dilonode.train.tokens`). `list_text_files` and `iter_file_tokens` are
shared with `prepare.py` so both read files identically.

`TokenData.train_batches(worker, ...)` is an infinite stream of random windows whose RNG is
seeded by `stable_seed(seed, worker)`: reproducible in any process, distinct per worker.
With ``data.shard_index``/``shard_count`` each shard draws from its own contiguous share of
the train tokens only. `eval_batches` is a fixed list of evenly spaced windows from the eval
split only. Every train stream (`BatchStream`) tells where it stands with `state()`, a small
JSON-able dict the checkpoints keep, and continues from one with `restore(state)`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dilonode.config import DataConfig
from dilonode.train.tokens import (
    DOC_SEPARATOR,
    PIECE_CHARS,
    ByteTokenizer,
    FileTokenizer,
    TextTokenizer,
    load_tokenizer,
    stable_seed,
    token_dtype,
)

__all__ = [
    "DOC_SEPARATOR",
    "BatchStream",
    "ByteTokenizer",
    "FileTokenizer",
    "RandomBatches",
    "TextTokenizer",
    "TokenData",
    "TrainData",
    "builtin_corpus",
    "iter_file_tokens",
    "list_text_files",
    "load_data",
    "load_tokenizer",
    "split_point",
    "stable_seed",
    "token_dtype",
]

TEXT_SUFFIXES = (".txt", ".jsonl")
_FULL_SCAN_TOKENS = 1 << 28  # larger memmaps are range-checked per batch instead of up front
_BIN_DTYPES = ("uint16", "uint32")


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> bytes:
    """CPython's pydoc help topics (~465 KB of English prose), values in sorted-key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


class BatchStream(Protocol):
    """A worker's endless training batches, resumable from a JSON-able position."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state(self) -> dict[str, Any]:
        """Where the stream stands: the next batch is the one after this position."""
        ...

    def mismatch(self, state: Any) -> str | None:
        """Why `state` is not a position of this stream (one line), or None."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state`; ValueError when `mismatch` says why not."""
        ...


class TrainData(Protocol):
    """What the workers and evaluations need from a data source."""

    vocab_size: int
    source: str

    def train_batches(self, worker: int | str, seq_len: int, batch_size: int,
                      seed: int) -> BatchStream: ...

    def eval_batches(self, seq_len: int, batch_size: int,
                     n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def list_text_files(path: Path) -> list[Path]:
    """A .txt/.jsonl file itself, or all such files under a folder in sorted path order."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise ValueError(f"data.path = {str(path)!r}: expected a .txt or .jsonl file")
        return [path]
    if not path.is_dir():
        raise ValueError(f"data.path = {str(path)!r}: no such file or directory")
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"data.path = {str(path)!r}: no .txt or .jsonl files found")
    return files


def _txt_pieces(path: Path) -> Iterator[str]:
    """A text file in ~1M-character pieces cut at line ends, then the document separator."""
    buf: list[str] = []
    size = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= PIECE_CHARS:
                yield "".join(buf)
                buf, size = [], 0
    buf.append(DOC_SEPARATOR)
    yield "".join(buf)


def _jsonl_pieces(path: Path, field: str) -> Iterator[str]:
    """The `field` text of each record plus the separator; bad lines name file:line."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: record has no string field {field!r} "
                                 "(data.jsonl_field)")
            yield text + DOC_SEPARATOR


def _group_pieces(pieces: Iterable[str]) -> Iterator[list[str]]:
    """Batch small pieces (jsonl records) so the tokenizer sees ~1M characters per call."""
    group: list[str] = []
    size = 0
    for piece in pieces:
        group.append(piece)
        size += len(piece)
        if size >= PIECE_CHARS:
            yield group
            group, size = [], 0
    if group:
        yield group


def iter_file_tokens(path: Path, tokenizer: TextTokenizer,
                     jsonl_field: str = "text") -> Iterator[np.ndarray]:
    """Token chunks (1-D arrays) of one .txt or .jsonl file, in order."""
    path = Path(path)
    is_jsonl = path.suffix.lower() == ".jsonl"
    pieces = _jsonl_pieces(path, jsonl_field) if is_jsonl else _txt_pieces(path)
    for group in _group_pieces(pieces):
        yield tokenizer.encode_batch(group)


def split_point(n_tokens: int, eval_fraction: float) -> int:
    """Index where the eval split (the last eval_fraction of n_tokens, at least 1) starts."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction = {eval_fraction}: must be between 0 and 1")
    if n_tokens < 2:
        raise ValueError(f"dataset has {n_tokens} tokens: need at least 2 to split off eval")
    n_eval = min(max(round(n_tokens * eval_fraction), 1), n_tokens - 1)
    return n_tokens - n_eval


def _max_token(tokens: np.ndarray) -> int:
    chunk = 1 << 24  # bounded reads, so scanning a memmap does not fault it all in at once
    return max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))


class TokenData:
    """Train and eval token arrays (1-D ndarray or memmap) and the vocabulary they index."""

    def __init__(self, train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int,
                 source: str = "tokens", verified: bool = False,
                 shard: tuple[int, int] | None = None) -> None:
        if train_tokens.ndim != 1 or eval_tokens.ndim != 1:
            raise ValueError(f"data ({source}): token arrays must be 1-D")
        self.train_tokens = train_tokens
        self.eval_tokens = eval_tokens
        self.vocab_size = int(vocab_size)
        self.source = source
        self.shard = shard  # (index, count): train windows only from that share of the tokens
        # Out-of-range ids crash embeddings (device asserts on CUDA): check once, or per batch.
        self._check_batches = not verified
        if not verified and max(len(train_tokens), len(eval_tokens)) <= _FULL_SCAN_TOKENS:
            for tokens in (train_tokens, eval_tokens):
                if len(tokens):
                    self._check_ids(_max_token(tokens))
            self._check_batches = False

    def _check_ids(self, top: int) -> None:
        if top >= self.vocab_size:
            raise ValueError(f"data ({self.source}): token id {top} >= vocab_size "
                             f"{self.vocab_size}; fix meta.json vocab_size or data.tokenizer")

    def _need(self, tokens: np.ndarray, seq_len: int, split: str) -> None:
        if seq_len < 1:
            raise ValueError(f"data.seq_len = {seq_len}: must be >= 1")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"data ({self.source}): {split} split has {len(tokens)} tokens, "
                             f"too short for data.seq_len = {seq_len} (needs {seq_len + 1})")

    def _windows(self, tokens: np.ndarray,
                 starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(seq_len + 1)  # [B, T+1]
        chunk = np.asarray(tokens[idx]).astype(np.int64)  # [B, T+1]
        if self._check_batches and chunk.size:
            self._check_ids(int(chunk.max()))
        t = torch.from_numpy(chunk)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()  # x, y: [B, T]

    def train_batches(self, worker: int | str, seq_len: int, batch_size: int,
                      seed: int) -> RandomBatches:
        """Endless (x, y) int64 [B, T] random windows; y is x shifted by one token.

        The generator is seeded by `stable_seed(seed, worker)`, so the stream depends only on
        (seed, worker) and the data, not on the process or Python's hash randomisation.
        A shard (index k of M) draws its windows from the k-th of M equal, contiguous
        shares of the train tokens."""
        self._need(self.train_tokens, seq_len, "train")
        low, end = 0, len(self.train_tokens)
        if self.shard is not None:
            index, count = self.shard
            low, end = index * end // count, (index + 1) * end // count
            if end - low < seq_len + 1:
                raise ValueError(f"data.shard_count = {count}: a shard's share of the train "
                                 f"split ({end - low} tokens) is too short for data.seq_len "
                                 f"= {seq_len}")
        # exclusive high: the last window ends at the share's last token
        return RandomBatches(self, stable_seed(seed, worker), low, end - seq_len, seq_len,
                             batch_size)

    def eval_batches(self, seq_len: int, batch_size: int,
                     n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`n_batches` fixed (x, y) batches of evenly spaced windows from the eval split."""
        self._need(self.eval_tokens, seq_len, "eval")
        total = batch_size * n_batches
        last = len(self.eval_tokens) - seq_len - 1
        starts = np.linspace(0, last, total).round().astype(np.int64)  # [n_batches * B]
        return [self._windows(self.eval_tokens, starts[i:i + batch_size], seq_len)
                for i in range(0, total, batch_size)]


class RandomBatches:
    """`TokenData`'s random windows; its position is its random generator's state."""

    def __init__(self, data: TokenData, key: int, low: int, high: int, seq_len: int,
                 batch_size: int) -> None:
        self._data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.low, self.high = low, high
        self._rng = np.random.Generator(np.random.PCG64(key))
        self._describe = {"kind": "windows", "key": key, "low": low, "high": high}

    def __iter__(self) -> RandomBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._rng.integers(self.low, self.high, size=self.batch_size,
                                    dtype=np.int64)  # [B]
        return self._data._windows(self._data.train_tokens, starts, self.seq_len)

    def state(self) -> dict[str, Any]:
        return {**self._describe, "rng": self._rng.bit_generator.state}

    def mismatch(self, state: Any) -> str | None:
        if not isinstance(state, dict) or state.get("kind") != "windows":
            return "not the position of a random-window stream"
        for key, want in self._describe.items():
            if state.get(key) != want:
                return f"made for another {key} ({state.get(key)!r}, this stream {want!r})"
        rng = state.get("rng")
        if not isinstance(rng, dict) or rng.get("bit_generator") != "PCG64":
            return "no PCG64 generator state"
        try:
            np.random.PCG64().state = rng
        except (TypeError, ValueError, KeyError) as exc:
            return f"bad generator state ({type(exc).__name__}: {exc})"
        return None

    def restore(self, state: dict[str, Any]) -> None:
        if why := self.mismatch(state):
            raise ValueError(f"data position: {why}")
        self._rng.bit_generator.state = state["rng"]


def _shard(cfg: DataConfig) -> tuple[int, int] | None:
    return None if cfg.shard_count is None else (cfg.shard_index or 0, cfg.shard_count)


def _split(tokens: np.ndarray, cfg: DataConfig, vocab_size: int, source: str) -> TokenData:
    if len(tokens) == 0:
        raise ValueError(f"data ({source}): no tokens")
    cut = split_point(len(tokens), cfg.eval_fraction)
    data = TokenData(tokens[:cut], tokens[cut:], vocab_size, source, shard=_shard(cfg))
    data._need(data.train_tokens, cfg.seq_len, "train")
    data._need(data.eval_tokens, cfg.seq_len, "eval (data.eval_fraction)")
    return data


def _load_builtin(cfg: DataConfig) -> TokenData:
    tok = load_tokenizer(cfg.tokenizer)
    corpus = builtin_corpus()
    if isinstance(tok, ByteTokenizer):
        tokens = np.frombuffer(corpus, dtype=np.uint8)  # zero-copy view of the cached bytes
    else:
        tokens = tok.encode_batch([corpus.decode("utf-8")])
    return _split(tokens, cfg, tok.vocab_size, "builtin")


def _load_text(cfg: DataConfig) -> TokenData:
    assert cfg.path is not None  # DataConfig guarantees a path for source=text
    tok = load_tokenizer(cfg.tokenizer)
    parts = [chunk for path in list_text_files(cfg.path)
             for chunk in iter_file_tokens(path, tok, cfg.jsonl_field)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return _split(tokens, cfg, tok.vocab_size, str(cfg.path))


def _read_meta(path: Path) -> dict[str, Any]:
    """meta.json's vocab_size and dtype, validated; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object")
    vocab = meta.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or vocab < 2):
        raise ValueError(f"{path}: vocab_size = {vocab!r}: expected an integer >= 2")
    dtype = meta.get("dtype")
    if dtype is not None and dtype not in _BIN_DTYPES:
        raise ValueError(f"{path}: dtype = {dtype!r}: expected one of {', '.join(_BIN_DTYPES)}")
    return meta


def _memmap(path: Path, dtype: str) -> np.ndarray:
    if not path.is_file():
        raise ValueError(f"data.path: {path}: no such file")
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise ValueError(f"data.path: {path}: file is empty")
    if size % itemsize:
        raise ValueError(f"data.path: {path}: size {size} is not a multiple of {itemsize} "
                         f"bytes ({dtype}); check data.bin_dtype or meta.json dtype")
    return np.memmap(path, dtype=dtype, mode="r")


def _load_bin(cfg: DataConfig) -> TokenData:
    assert cfg.path is not None  # DataConfig guarantees a path for source=bin
    root = Path(cfg.path)
    if not root.exists():
        raise ValueError(f"data.path = {str(root)!r}: no such file or directory")
    folder = root if root.is_dir() else root.parent
    meta = _read_meta(folder / "meta.json")
    dtype = meta.get("dtype", cfg.bin_dtype)
    vocab = meta.get("vocab_size") or load_tokenizer(cfg.tokenizer).vocab_size
    if root.is_file():
        return _split(_memmap(root, dtype), cfg, vocab, str(root))
    data = TokenData(_memmap(root / "train.bin", dtype), _memmap(root / "val.bin", dtype),
                     vocab, str(root), shard=_shard(cfg))
    data._need(data.train_tokens, cfg.seq_len, "train")
    data._need(data.eval_tokens, cfg.seq_len, "eval (val.bin)")
    return data


def load_data(cfg: DataConfig) -> TrainData:
    """Load and tokenize the configured source (streamed ones: open and check it); ValueError
    names any bad file or field."""
    if cfg.source in ("parquet", "arrow"):
        from dilonode.train.stream import load_stream

        return load_stream(cfg)
    if cfg.source == "builtin":
        return _load_builtin(cfg)
    if cfg.source == "text":
        return _load_text(cfg)
    if cfg.source == "bin":
        return _load_bin(cfg)
    raise ValueError(f"data.source = {cfg.source!r}: expected builtin, text, bin, parquet or "
                     "arrow")
