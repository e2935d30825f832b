"""Offline tokenization: .txt/.jsonl files, Parquet files or a `datasets` save_to_disk folder
-> nanoGPT-layout token shards.

`prepare_data(src, out_dir)` writes ``train.bin`` and ``val.bin`` (uint16 when the vocabulary
fits, else uint32) and ``meta.json`` (vocab_size, dtype, token counts, tokenizer), which
`load_data` reads back with ``data.source = "bin"``. Files are read and tokenized by the same
functions `dilonode.train.data` uses for ``source = "text"``, and Parquet/Arrow rows by those
of the streamed sources (`dilonode.train.stream`), so both paths see identical tokens; the eval
split is the last ``eval_fraction`` of the tokens. `source = "auto"` tells the kind of input by
its files. Tokens stream to disk a few rows or one text piece at a time, so memory stays bounded
whatever the input's size, and every output is written to a temp file and renamed into place
so an interrupted run never leaves a half-written shard.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dilonode.config import DataConfig
from dilonode.train.corpus import open_corpus
from dilonode.train.data import iter_file_tokens, list_text_files, split_point
from dilonode.train.stream import iter_corpus_tokens
from dilonode.train.tokens import TextTokenizer, load_tokenizer, token_dtype

__all__ = ["detect_source", "prepare_data"]

_COPY_BYTES = 1 << 24
SOURCES = ("auto", "text", "parquet", "arrow")


def detect_source(src: Path) -> str:
    """'parquet', 'arrow' or 'text', by the files `src` is or holds."""
    src = Path(src)
    if src.is_file():
        return {".parquet": "parquet", ".arrow": "arrow"}.get(src.suffix.lower(), "text")
    if not src.is_dir():
        return "text"  # its loader names the missing path
    if any((src / name).is_file() for name in ("dataset_dict.json", "state.json")) \
            or any(src.glob("*.arrow")):
        return "arrow"
    if any(p.suffix.lower() == ".parquet" for p in src.rglob("*.parquet")):
        return "parquet"
    return "text"


def _token_chunks(src: Path, source: str, tok: TextTokenizer, jsonl_field: str,
                  text_column: str, split: str) -> Iterator[np.ndarray]:
    """The input's tokens in order, a bounded chunk at a time. The input is opened (listed,
    its columns checked) before the first chunk is asked for, so a bad one fails early."""
    if source == "text":
        files = list_text_files(src)
        return (chunk for path in files for chunk in iter_file_tokens(path, tok, jsonl_field))
    corpus = open_corpus(DataConfig(source=source, path=src, text_column=text_column,
                                    split=split))
    return iter_corpus_tokens(corpus, tok)


def _write_tokens(chunks: Iterable[np.ndarray], dtype: np.dtype, dest: Path,
                  progress: bool) -> int:
    """Append every chunk's ids to dest; returns the token count."""
    count = 0
    with dest.open("wb") as out, tqdm(desc="tokenizing", unit="tok", unit_scale=True,
                                      disable=not progress) as bar:
        for chunk in chunks:
            out.write(chunk.astype(dtype, copy=False).tobytes())
            count += len(chunk)
            bar.update(len(chunk))
    return count


def _split_tail(all_path: Path, val_path: Path, cut_bytes: int) -> None:
    """Move bytes from cut_bytes onward into val_path and truncate all_path to the train part."""
    with all_path.open("rb") as src, val_path.open("wb") as dst:
        src.seek(cut_bytes)
        shutil.copyfileobj(src, dst, _COPY_BYTES)
    with all_path.open("r+b") as f:
        f.truncate(cut_bytes)


def prepare_data(src: Path, out_dir: Path, tokenizer: str = "bytes", eval_fraction: float = 0.1,
                 jsonl_field: str = "text", progress: bool = True, source: str = "auto",
                 text_column: str = "text", split: str = "train") -> dict[str, Any]:
    """Tokenize `src` (a .txt/.jsonl file or folder, Parquet file or folder, save_to_disk
    folder or .arrow file: `source`) into out_dir/{train,val}.bin + meta.json.

    Returns the meta dict written to meta.json."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction = {eval_fraction}: must be between 0 and 1")
    if source not in SOURCES:
        raise ValueError(f"source = {source!r}: expected one of {', '.join(SOURCES)}")
    src = Path(src)
    kind = detect_source(src) if source == "auto" else source
    tok = load_tokenizer(tokenizer)
    chunks = _token_chunks(src, kind, tok, jsonl_field, text_column, split)
    dtype = token_dtype(tok.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ("train.bin", "val.bin", "meta.json")
    tmps = {name: out_dir / f".{name}.tmp" for name in names}
    try:
        n_tokens = _write_tokens(chunks, dtype, tmps["train.bin"], progress)
        if n_tokens < 2:
            raise ValueError(f"{src}: only {n_tokens} tokens after tokenizing, need at least 2")
        cut = split_point(n_tokens, eval_fraction)
        _split_tail(tmps["train.bin"], tmps["val.bin"], cut * dtype.itemsize)
        meta = {"vocab_size": tok.vocab_size, "dtype": dtype.name, "train_tokens": cut,
                "val_tokens": n_tokens - cut, "tokenizer": tok.name}
        tmps["meta.json"].write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        # Old meta.json out first, new one in last: its presence marks a complete set.
        (out_dir / "meta.json").unlink(missing_ok=True)
        for name in names:
            os.replace(tmps[name], out_dir / name)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
    return meta
