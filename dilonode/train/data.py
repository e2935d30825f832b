"""Token data for training and evaluation: loading, tokenizing and cutting batches.

`load_data(cfg.data)` returns a `TokenData` holding a 1-D train split, a 1-D held-out eval split
and the vocabulary size. Sources:

* ``builtin``: the English help text shipped with every CPython (`pydoc_data.topics`), so a
  run needs no download;
* ``text``: a folder (searched recursively, sorted paths) of ``.txt`` and ``.jsonl`` files;
* ``bin``: a nanoGPT-layout folder (``train.bin``, ``val.bin``, optional ``meta.json``) as
  written by `dilonode.train.prepare.prepare_data`, or one ``.bin`` file.

Tokenization is byte-level (vocab 256) unless ``cfg.tokenizer`` names a local
``tokenizer.json`` (needs the `tokenizers` package). `list_text_files`, `load_tokenizer` and
`iter_file_tokens` are shared with `prepare.py` so both read files identically.

`TokenData.train_batches(worker, ...)` is an infinite stream of random windows whose RNG is
seeded by `stable_seed(seed, worker)`: reproducible in any process, distinct per worker.
`eval_batches` is a fixed list of evenly spaced windows from the eval split only.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dilonode.config import DataConfig

__all__ = [
    "DOC_SEPARATOR",
    "ByteTokenizer",
    "FileTokenizer",
    "TextTokenizer",
    "TokenData",
    "builtin_corpus",
    "iter_file_tokens",
    "list_text_files",
    "load_data",
    "load_tokenizer",
    "split_point",
    "stable_seed",
    "token_dtype",
]

# Appended to every document (txt file, jsonl record) so documents do not run together.
DOC_SEPARATOR = "\n\n"
TEXT_SUFFIXES = (".txt", ".jsonl")
_PIECE_CHARS = 1 << 20  # characters handed to the tokenizer at once; bounds memory per call
_FULL_SCAN_TOKENS = 1 << 28  # larger memmaps are range-checked per batch instead of up front
_BIN_DTYPES = ("uint16", "uint32")


def stable_seed(*parts: object) -> int:
    """63-bit seed from sha256 of the parts joined by ':'; unlike hash(), same in every process."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> bytes:
    """CPython's pydoc help topics (~465 KB of English prose), values in sorted-key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that stores every id below vocab_size (uint16 or uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TextTokenizer(Protocol):
    """What the loaders need from a tokenizer."""

    name: str
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        """Concatenated ids of all texts, 1-D."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to download or train."""

    name = "bytes"
    vocab_size = 256

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)


class FileTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local tokenizer.json."""

    def __init__(self, path: Path, tokenizer: Any) -> None:
        self.name = str(path)
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._dtype = token_dtype(self.vocab_size)

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        # Pieces are not whole documents, so BOS/EOS post-processing would be misplaced.
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=self._dtype) for e in encodings]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=self._dtype)


def load_tokenizer(spec: str) -> ByteTokenizer | FileTokenizer:
    """'bytes' or a path to a local tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"data.tokenizer = {spec!r}: no such file (expected 'bytes' or a "
                         "local tokenizer.json)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"data.tokenizer = {spec!r}: needs the 'tokenizers' package: "
                         "pip install 'dilonode[tokenizers]'") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"data.tokenizer = {spec!r}: not a valid tokenizer.json: {first}") \
            from None
    return FileTokenizer(path, tok)


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
            if size >= _PIECE_CHARS:
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
        if size >= _PIECE_CHARS:
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
                 source: str = "tokens", verified: bool = False) -> None:
        if train_tokens.ndim != 1 or eval_tokens.ndim != 1:
            raise ValueError(f"data ({source}): token arrays must be 1-D")
        self.train_tokens = train_tokens
        self.eval_tokens = eval_tokens
        self.vocab_size = int(vocab_size)
        self.source = source
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
                      seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless (x, y) int64 [B, T] random windows; y is x shifted by one token.

        The generator is seeded by `stable_seed(seed, worker)`, so the stream depends only on
        (seed, worker) and the data, not on the process or Python's hash randomisation."""
        self._need(self.train_tokens, seq_len, "train")
        rng = np.random.Generator(np.random.PCG64(stable_seed(seed, worker)))
        high = len(self.train_tokens) - seq_len  # exclusive: last window ends at n - 1
        while True:
            starts = rng.integers(0, high, size=batch_size, dtype=np.int64)  # [B]
            yield self._windows(self.train_tokens, starts, seq_len)

    def eval_batches(self, seq_len: int, batch_size: int,
                     n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`n_batches` fixed (x, y) batches of evenly spaced windows from the eval split."""
        self._need(self.eval_tokens, seq_len, "eval")
        total = batch_size * n_batches
        last = len(self.eval_tokens) - seq_len - 1
        starts = np.linspace(0, last, total).round().astype(np.int64)  # [n_batches * B]
        return [self._windows(self.eval_tokens, starts[i:i + batch_size], seq_len)
                for i in range(0, total, batch_size)]


def _split(tokens: np.ndarray, cfg: DataConfig, vocab_size: int, source: str) -> TokenData:
    if len(tokens) == 0:
        raise ValueError(f"data ({source}): no tokens")
    cut = split_point(len(tokens), cfg.eval_fraction)
    data = TokenData(tokens[:cut], tokens[cut:], vocab_size, source)
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
                     vocab, str(root))
    data._need(data.train_tokens, cfg.seq_len, "train")
    data._need(data.eval_tokens, cfg.seq_len, "eval (val.bin)")
    return data


def load_data(cfg: DataConfig) -> TokenData:
    """Load and tokenize the configured source; ValueError names any bad file or field."""
    if cfg.source == "builtin":
        return _load_builtin(cfg)
    if cfg.source == "text":
        return _load_text(cfg)
    if cfg.source == "bin":
        return _load_bin(cfg)
    raise ValueError(f"data.source = {cfg.source!r}: expected builtin, text or bin")
