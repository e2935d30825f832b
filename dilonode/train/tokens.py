"""Tokenizers and the few rules every data source shares.

`load_tokenizer(spec)` gives byte-level tokens (vocab 256) for ``"bytes"`` or a Hugging Face
`tokenizers` tokenizer from a local ``tokenizer.json``; its `vocab_size` is the one the model
is built for. Every source appends `DOC_SEPARATOR` to each document and tokenizes documents
(or `split_pieces` of a long one) one by one, so the same text gives the same tokens
whichever source reads it. `stable_seed` seeds every random choice of the data streams, the
same in every process.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "DOC_SEPARATOR",
    "PIECE_CHARS",
    "ByteTokenizer",
    "FileTokenizer",
    "TextTokenizer",
    "load_tokenizer",
    "split_pieces",
    "stable_seed",
    "token_dtype",
]

# Appended to every document (txt file, jsonl record, table row) so documents do not run
# together.
DOC_SEPARATOR = "\n\n"
PIECE_CHARS = 1 << 20  # characters handed to the tokenizer at once; bounds memory per call


def stable_seed(*parts: object) -> int:
    """63-bit seed from sha256 of the parts joined by ':'; unlike hash(), same in every process."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that stores every id below vocab_size (uint16 or uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def split_pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of at most `limit` characters, each cut after the last line end (else
    space) of its second half where there is one: a cut inside a word changes its tokens."""
    pieces = []
    i = 0
    while len(text) - i > limit:
        lo, hi = i + limit // 2, i + limit
        cut = text.rfind("\n", lo, hi)
        if cut < 0:
            cut = text.rfind(" ", lo, hi)
        cut = hi if cut < 0 else cut + 1
        pieces.append(text[i:cut])
        i = cut
    pieces.append(text[i:])
    return pieces


class TextTokenizer(Protocol):
    """What the loaders need from a tokenizer."""

    name: str
    vocab_size: int

    def encode_each(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text, 1-D arrays in order."""
        ...

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        """Concatenated ids of all texts, 1-D."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to download or train."""

    name = "bytes"
    vocab_size = 256

    def encode_each(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)


class FileTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local tokenizer.json."""

    def __init__(self, path: Path, tokenizer: Any) -> None:
        self.name = str(path)
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._dtype = token_dtype(self.vocab_size)

    def encode_each(self, texts: list[str]) -> list[np.ndarray]:
        # Pieces are not whole documents, so BOS/EOS post-processing would be misplaced.
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self._dtype) for e in encodings]

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        ids = self.encode_each(texts)
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
