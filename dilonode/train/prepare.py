"""Offline tokenization: a folder of .txt/.jsonl files -> nanoGPT-layout token shards.

`prepare_data(src, out_dir)` writes ``train.bin`` and ``val.bin`` (uint16 when the vocabulary
fits, else uint32) and ``meta.json`` (vocab_size, dtype, token counts, tokenizer), which
`load_data` reads back with ``data.source = "bin"``. Files are read and tokenized by the same
functions `dilonode.train.data` uses for ``source = "text"``, so both paths see identical tokens;
the eval split is likewise the last ``eval_fraction`` of the tokens. Tokens stream to disk file
by file, so memory stays bounded by the largest piece, and every output is written to a temp
file and renamed into place so an interrupted run never leaves a half-written shard.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dilonode.train.data import (
    TextTokenizer,
    iter_file_tokens,
    list_text_files,
    load_tokenizer,
    split_point,
    token_dtype,
)

__all__ = ["prepare_data"]

_COPY_BYTES = 1 << 24


def _write_tokens(files: list[Path], tok: TextTokenizer, jsonl_field: str, dtype: np.dtype,
                  dest: Path, progress: bool) -> int:
    """Tokenize every file in order, appending ids to dest; returns the token count."""
    count = 0
    with dest.open("wb") as out:
        for path in tqdm(files, desc="tokenizing", unit="file", disable=not progress):
            for chunk in iter_file_tokens(path, tok, jsonl_field):
                out.write(chunk.astype(dtype, copy=False).tobytes())
                count += len(chunk)
    return count


def _split_tail(all_path: Path, val_path: Path, cut_bytes: int) -> None:
    """Move bytes from cut_bytes onward into val_path and truncate all_path to the train part."""
    with all_path.open("rb") as src, val_path.open("wb") as dst:
        src.seek(cut_bytes)
        shutil.copyfileobj(src, dst, _COPY_BYTES)
    with all_path.open("r+b") as f:
        f.truncate(cut_bytes)


def prepare_data(src: Path, out_dir: Path, tokenizer: str = "bytes", eval_fraction: float = 0.1,
                 jsonl_field: str = "text", progress: bool = True) -> dict[str, Any]:
    """Tokenize `src` (a .txt/.jsonl file or folder) into out_dir/{train,val}.bin + meta.json.

    Returns the meta dict written to meta.json."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction = {eval_fraction}: must be between 0 and 1")
    files = list_text_files(Path(src))
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ("train.bin", "val.bin", "meta.json")
    tmps = {name: out_dir / f".{name}.tmp" for name in names}
    try:
        n_tokens = _write_tokens(files, tok, jsonl_field, dtype, tmps["train.bin"], progress)
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
