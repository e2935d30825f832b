"""A deterministic corpus of Python source for GPU-scale runs, built from files already on the
machine (nothing is downloaded): byte-level tokens (vocab 256, as the built-in corpus) in
nanoGPT-layout shards that `data.source = "bin"` reads.

    python -m benchmarks.gpu.corpus build runs/corpus/pysrc              # stdlib + torch sources
    python -m benchmarks.gpu.corpus pack runs/corpus/pysrc runs/carry/pysrc-pack   # ~1/6 the size
    python -m benchmarks.gpu.corpus unpack runs/carry/pysrc-pack runs/corpus/pysrc # checked
    python -m benchmarks.gpu.corpus verify runs/corpus/pysrc

How `build` makes it (`--source` may repeat; default `stdlib` then `pkg:torch`):

* a source is `stdlib` (this interpreter's `sysconfig` stdlib folder), `pkg:NAME` (the folder
  of installed package NAME, found without importing it) or a folder path;
* every regular file ending in `.py` under it, walking without following links and skipping
  folders named `__pycache__`, `site-packages` and `dist-packages`; a file that is not valid
  UTF-8 is left out (listed in meta.json);
* each file is a document named `<label>/<path relative to its source>` (label `stdlib`,
  the package name, or the folder's name), documents in sorted name order, each one's raw
  bytes followed by the document separator "\\n\\n" (as `dilonode prepare-data` appends);
* a document goes to the held-out split when the first 8 bytes of sha256(name), big-endian,
  are divisible by `--val-every` (10: about a tenth of the files, whole files held out);
* tokens are the bytes, stored as little-endian uint16 (the smallest dtype the loader reads).

meta.json holds the token counts, the sha256 of train.bin and val.bin (the corpus' identity),
the sources with their file counts and versions, and the Python version: the stdlib differs
between patch releases, so the hashes do too. `pack` writes the same bytes one per token,
xz-compressed (small enough to travel with a working tree), and `unpack` rebuilds the shards
and refuses them unless their hashes match meta.json.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import lzma
import os
import platform
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VERSION = 1
SEPARATOR = b"\n\n"  # dilonode.train.data.DOC_SEPARATOR
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
SHARDS = ("train.bin", "val.bin")
DEFAULT_SOURCES = ("stdlib", "pkg:torch")
_CHUNK = 1 << 24  # bytes per read while packing / unpacking


@dataclass(frozen=True)
class Source:
    label: str
    root: Path
    version: str  # Python's for the stdlib, the distribution's for a package, "" for a folder


def resolve_source(spec: str) -> Source:
    """`stdlib`, `pkg:NAME` or a folder path -> where its files are and what to call them."""
    if spec == "stdlib":
        return Source("stdlib", Path(sysconfig.get_paths()["stdlib"]), platform.python_version())
    if spec.startswith("pkg:"):
        name = spec[4:]
        found = importlib.util.find_spec(name)
        if found is None or not found.submodule_search_locations:
            raise SystemExit(f"corpus: --source {spec}: no installed package {name!r}")
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = ""
        return Source(name, Path(list(found.submodule_search_locations)[0]), version)
    root = Path(spec)
    if not root.is_dir():
        raise SystemExit(f"corpus: --source {spec}: not a folder")
    return Source(root.resolve().name, root, "")


def iter_files(source: Source, suffix: str = ".py") -> Iterator[tuple[str, Path]]:
    """(document name, path) of every regular `suffix` file under the source (any order)."""
    for top, dirs, files in os.walk(source.root, followlinks=False):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            path = Path(top) / name
            if name.endswith(suffix) and path.is_file() and not path.is_symlink():
                rel = path.relative_to(source.root).as_posix()
                yield f"{source.label}/{rel}", path


def is_val(name: str, val_every: int) -> bool:
    """Whether document `name` is held out: sha256(name)[:8] (big-endian) % val_every == 0."""
    head = hashlib.sha256(name.encode("utf-8")).digest()[:8]
    return int.from_bytes(head, "big") % val_every == 0


class _Shard:
    """One output shard: uint16 tokens appended document by document, hashed as written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh = path.open("wb")
        self.sha = hashlib.sha256()
        self.tokens = 0

    def append(self, data: bytes) -> None:
        wide = np.frombuffer(data, dtype=np.uint8).astype("<u2").tobytes()  # [n] uint16 LE
        self.fh.write(wide)
        self.sha.update(wide)
        self.tokens += len(data)

    def close(self) -> None:
        self.fh.close()


def build(out: Path, specs: list[str], val_every: int = 10, suffix: str = ".py") -> dict[str, Any]:
    """Build train.bin, val.bin, manifest.tsv and meta.json under `out`; returns the meta."""
    if val_every < 2:
        raise SystemExit("corpus: --val-every must be at least 2")
    sources = [resolve_source(s) for s in specs]
    if len({s.label for s in sources}) != len(sources):
        raise SystemExit("corpus: two sources share a label; their documents would mix")
    docs = sorted(doc for s in sources for doc in iter_files(s, suffix))
    out.mkdir(parents=True, exist_ok=True)
    shards = {"train": _Shard(out / ".train.bin.tmp"), "val": _Shard(out / ".val.bin.tmp")}
    counts = {s.label: 0 for s in sources}
    skipped: list[str] = []
    with (out / "manifest.tsv").open("w", encoding="utf-8") as manifest:
        manifest.write("split\tbytes\tsha256\tname\n")
        for name, path in docs:
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                skipped.append(name)
                continue
            split = "val" if is_val(name, val_every) else "train"
            shards[split].append(data + SEPARATOR)
            counts[name.split("/", 1)[0]] += 1
            manifest.write(f"{split}\t{len(data)}\t{hashlib.sha256(data).hexdigest()}\t"
                           f"{name}\n")
    for shard in shards.values():
        shard.close()
    if not shards["train"].tokens or not shards["val"].tokens:
        raise SystemExit(f"corpus: {len(docs)} files give an empty split; add files or "
                         "lower --val-every")
    meta = _meta(sources, counts, skipped, shards, val_every, suffix)
    for split, shard in shards.items():
        os.replace(shard.path, out / f"{split}.bin")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _meta(sources: list[Source], counts: dict[str, int], skipped: list[str],
          shards: dict[str, _Shard], val_every: int, suffix: str) -> dict[str, Any]:
    sha = {f"{k}.bin": s.sha.hexdigest() for k, s in shards.items()}
    return {
        "vocab_size": 256, "dtype": "uint16", "tokenizer": "bytes",
        "train_tokens": shards["train"].tokens, "val_tokens": shards["val"].tokens,
        "sha256": sha, "corpus_id": corpus_id(sha),
        "builder": {"script": "benchmarks/gpu/corpus.py", "version": VERSION, "suffix": suffix,
                    "skip_dirs": sorted(SKIP_DIRS), "separator": SEPARATOR.decode(),
                    "val_every": val_every, "python": platform.python_version()},
        "sources": [{"label": s.label, "root": str(s.root), "version": s.version,
                     "files": counts[s.label]} for s in sources],
        "skipped_not_utf8": skipped,
    }


def corpus_id(sha: dict[str, str]) -> str:
    """A short name for the shards: sha256 of their two hashes, 16 hex digits."""
    joined = f"{sha['train.bin']}:{sha['val.bin']}".encode()
    return hashlib.sha256(joined).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify(folder: Path) -> dict[str, Any]:
    """Check train.bin and val.bin against meta.json's sha256 and token counts."""
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    for shard in SHARDS:
        path = folder / shard
        got = file_sha256(path)
        if got != meta["sha256"][shard]:
            raise SystemExit(f"corpus: {path}: sha256 {got} != meta.json's "
                             f"{meta['sha256'][shard]}")
        want = meta[f"{shard.split('.')[0]}_tokens"]
        if path.stat().st_size != 2 * want:
            raise SystemExit(f"corpus: {path}: {path.stat().st_size // 2} tokens, meta.json "
                             f"says {want}")
    return meta


def pack(src: Path, dest: Path) -> dict[str, int]:
    """Write the shards one byte per token, xz-compressed, with meta.json and the manifest."""
    verify(src)
    dest.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for shard in SHARDS:
        target = dest / shard.replace(".bin", ".u8.xz")
        with (src / shard).open("rb") as fh, lzma.open(target, "wb", preset=6) as xz:
            while chunk := fh.read(_CHUNK):
                wide = np.frombuffer(chunk, dtype="<u2")
                if wide.size and int(wide.max()) > 255:
                    raise SystemExit(f"corpus: {src / shard}: a token above 255")
                xz.write(wide.astype(np.uint8).tobytes())
        sizes[target.name] = target.stat().st_size
    for name in ("meta.json", "manifest.tsv"):
        shutil.copyfile(src / name, dest / name)
    return sizes


def unpack(src: Path, dest: Path) -> dict[str, Any]:
    """Rebuild train.bin and val.bin from a pack, then verify them against its meta.json."""
    dest.mkdir(parents=True, exist_ok=True)
    for shard in SHARDS:
        tmp = dest / f".{shard}.tmp"
        with lzma.open(src / shard.replace(".bin", ".u8.xz"), "rb") as xz, tmp.open("wb") as out:
            while chunk := xz.read(_CHUNK):
                out.write(np.frombuffer(chunk, dtype=np.uint8).astype("<u2").tobytes())
        os.replace(tmp, dest / shard)
    for name in ("meta.json", "manifest.tsv"):
        shutil.copyfile(src / name, dest / name)
    return verify(dest)


def describe(meta: dict[str, Any]) -> str:
    tokens = meta["train_tokens"] + meta["val_tokens"]
    srcs = ", ".join(f"{s['label']}{' ' + s['version'] if s['version'] else ''} "
                     f"({s['files']} files)" for s in meta["sources"])
    return (f"corpus {meta['corpus_id']}: {tokens:,} tokens (train {meta['train_tokens']:,}, "
            f"val {meta['val_tokens']:,}), byte-level, from {srcs}; "
            f"{len(meta['skipped_not_utf8'])} non-UTF-8 files left out; built with Python "
            f"{meta['builder']['python']}\n"
            f"sha256 train.bin {meta['sha256']['train.bin']}\n"
            f"sha256 val.bin   {meta['sha256']['val.bin']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the shards from source files on this machine")
    b.add_argument("out", type=Path)
    b.add_argument("--source", action="append", help="stdlib, pkg:NAME or a folder "
                   f"(repeatable; default: {' '.join(DEFAULT_SOURCES)})")
    b.add_argument("--val-every", type=int, default=10, help="about 1 in N files held out")
    b.add_argument("--suffix", default=".py", help="file name ending to take")
    p = sub.add_parser("pack", help="xz the shards' bytes to carry them")
    p.add_argument("src", type=Path)
    p.add_argument("dest", type=Path)
    u = sub.add_parser("unpack", help="rebuild the shards from a pack and check them")
    u.add_argument("src", type=Path)
    u.add_argument("dest", type=Path)
    v = sub.add_parser("verify", help="check the shards against meta.json")
    v.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        meta = build(args.out, args.source or list(DEFAULT_SOURCES), args.val_every, args.suffix)
    elif args.cmd == "pack":
        sizes = pack(args.src, args.dest)
        print(" ".join(f"{k} {v:,} bytes" for k, v in sizes.items()))
        meta = json.loads((args.dest / "meta.json").read_text(encoding="utf-8"))
    elif args.cmd == "unpack":
        meta = unpack(args.src, args.dest)
    else:
        meta = verify(args.folder)
    print(describe(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
