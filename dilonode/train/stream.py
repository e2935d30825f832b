"""Streamed training data (``data.source = "parquet" | "arrow"``): which units each worker
reads, tokens packed into batches as they are read, and a position to resume from.

A corpus is cut into units (`dilonode.train.corpus`). The eval split is a fixed set of them:
``max(1, round(eval_fraction * U))`` units evenly spaced over the corpus' sorted order, the
same whatever the seed, so no train stream ever reads them. The other N units are the
training units. Every worker draws from the same order, a permutation of the training units
per epoch seeded by ``(data.seed, epoch)`` (`unit_order`), and reads it in one of two ways:

* strict (``data.shard_index = k`` of ``data.shard_count = M``): the worker reads the places
  k, k + M, k + 2M, ... of each epoch's order. Within an epoch the shards' units partition
  the training units: two shards never read the same unit, so they share no token and no
  window, as long as they are in the same epoch (a shard that got ahead by a whole epoch
  reads the next epoch's permutation).
* by identity (no shard set, so the membership need not be known): the worker reads the
  whole order, starting at place ``walk_start(identity)`` and wrapping around. Two workers
  share no unit until one of them has read as far as the place the other started at. The
  integer identities 0, 1, 2, ... (the simulator's) start at golden-ratio spaced places:
  any M of the first identities start at least about N / (3 M) units apart; other
  identities (peer ids) start at places drawn from their hash.

A worker's stream is a function of the corpus (its files and their cut), the tokenizer,
``data.seed`` and its identity or shard alone: the same batches in any process. Rows are
read a few at a time, each document's text plus `DOC_SEPARATOR` tokenized on its own (a
long one in `split_pieces`), and tokens packed into (batch, seq_len) windows, each window
starting at the last token of the one before. The stream holds at most one batch of
tokens plus one tokenizer call's worth (`peak_buffer` says how many it held).

`StreamBatches.state()` is where the stream stands, a small JSON-able dict: the epoch, the
place in the walk, the row in that unit and the token in that row's tokens of the next
window's first token. `restore(state)` continues from there; the tokens a batch left over
are not stored but read again. `mismatch(state)` says why a state belongs to another
stream (another corpus, seed, shard or identity).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import torch

from dilonode.config import DataConfig
from dilonode.train.corpus import Corpus, Unit, open_corpus
from dilonode.train.tokens import (
    DOC_SEPARATOR,
    PIECE_CHARS,
    TextTokenizer,
    load_tokenizer,
    split_pieces,
    stable_seed,
)

__all__ = ["Position", "StreamBatches", "StreamData", "Walk", "eval_units",
           "iter_corpus_tokens", "load_stream", "unit_order", "walk_start"]

_PHI = (math.sqrt(5.0) - 1.0) / 2.0  # golden-ratio steps spread the first M starts evenly
STATE_KIND = "stream"

# (row, token offset in the row's tokens, ids) for each piece of a group of documents
_Pieces = list[tuple[int, int, np.ndarray]]


def eval_units(n_units: int, eval_fraction: float) -> list[int]:
    """The held-out units: round(eval_fraction * n_units) of them (at least 1, at most
    n_units - 1), evenly spaced over the sorted order."""
    if n_units < 2:
        raise ValueError(f"the corpus has {n_units} unit(s): need at least 2 to hold out "
                         "an eval split (lower data.unit_rows)")
    n_eval = min(max(round(n_units * eval_fraction), 1), n_units - 1)
    return [(2 * i + 1) * n_units // (2 * n_eval) for i in range(n_eval)]


def unit_order(n_units: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the training units, the same for every worker."""
    rng = np.random.Generator(np.random.PCG64(stable_seed(seed, "unit-order", epoch)))
    return rng.permutation(n_units)


def walk_start(identity: int | str, n_units: int, seed: int) -> int:
    """Where a worker walking by identity starts in each epoch's order (module docstring)."""
    if isinstance(identity, int) and not isinstance(identity, bool) and identity >= 0:
        u = (stable_seed(seed, "walk") / 2.0**63 + identity * _PHI) % 1.0
    else:
        u = stable_seed(seed, "walk", identity) / 2.0**63
    return min(int(u * n_units), n_units - 1)


class Walk:
    """The training units one worker reads in each epoch, in order: a shard's places of the
    shared order, or all of it from the identity's start."""

    def __init__(self, n_units: int, seed: int, identity: int | str,
                 shard: tuple[int, int] | None) -> None:
        self.n_units, self.seed, self.shard = n_units, seed, shard
        self.start = 0 if shard else walk_start(identity, n_units, seed)
        self.label = f"shard {shard[0]}/{shard[1]}" if shard else f"start {self.start}"
        self._epoch: tuple[int, np.ndarray] | None = None

    def units(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            order = unit_order(self.n_units, self.seed, epoch)
            if self.shard is not None:
                order = order[self.shard[0]::self.shard[1]]
            else:
                order = np.roll(order, -self.start)
            self._epoch = (epoch, order)
        return self._epoch[1]


@dataclass(frozen=True)
class Position:
    """The next token a stream yields: token `token` of row `row` of the unit at place
    `index` of epoch `epoch`'s walk."""

    epoch: int = 0
    index: int = 0
    row: int = 0
    token: int = 0


class _Source:
    """Tokens of some units in a given order, in groups of about `piece_chars` characters."""

    def __init__(self, corpus: Corpus, units: list[Unit], tokenizer: TextTokenizer,
                 order: Callable[[int], np.ndarray], epochs: int | None,
                 piece_chars: int, what: str) -> None:
        self.corpus, self.units, self.tok = corpus, units, tokenizer
        self.order, self.epochs, self.piece_chars, self.what = order, epochs, piece_chars, what

    def groups(self, start: Position) -> Iterator[list[tuple[Position, np.ndarray]]]:
        """From `start` on, every piece's position and ids; endless unless `epochs` is set."""
        epoch, index, row, token = astuple(start)
        while self.epochs is None or epoch < self.epochs:
            order = self.order(epoch)
            whole, produced = index == row == token == 0, False
            while index < len(order):
                for group in self._unit_groups(self.units[int(order[index])], row, token):
                    produced = True
                    yield [(Position(epoch, index, r, off), ids) for r, off, ids in group]
                index, row, token = index + 1, 0, 0
            if whole and not produced:
                raise ValueError(f"data ({self.corpus.root}): the {self.what} units hold no "
                                 "tokens")
            epoch, index = epoch + 1, 0

    def _unit_groups(self, unit: Unit, row: int, token: int) -> Iterator[_Pieces]:
        """The unit's pieces from token `token` of row `row` on, grouped per tokenizer call."""
        pending: list[tuple[int, str]] = []
        chars, r = 0, row
        offsets: dict[int, int] = {}  # row -> its tokens before its next piece
        for texts in self.corpus.texts(unit, skip=row):
            for text in texts:
                for piece in [] if text is None else split_pieces(text + DOC_SEPARATOR,
                                                                  self.piece_chars):
                    pending.append((r, piece))
                    chars += len(piece)
                    if chars >= self.piece_chars:
                        yield self._encode(pending, offsets, (row, token))
                        pending, chars = [], 0
                r += 1
        if pending:
            yield self._encode(pending, offsets, (row, token))

    def _encode(self, pending: list[tuple[int, str]], offsets: dict[int, int],
                skip: tuple[int, int]) -> _Pieces:
        """Tokenize `pending` (row, piece) in one call; drops the tokens of row skip[0]
        before skip[1] (a resume starts there: they were yielded before)."""
        out = []
        for (r, _), ids in zip(pending, self.tok.encode_each([p for _, p in pending]),
                               strict=True):
            off = offsets.get(r, 0)
            offsets[r] = off + len(ids)
            if r == skip[0] and off < skip[1]:
                cut = min(skip[1] - off, len(ids))
                ids, off = ids[cut:], off + cut
            if len(ids):
                out.append((r, off, ids))
        last = pending[-1][0]  # the only row whose pieces may go on in the next group
        for r in [r for r in offsets if r != last]:
            del offsets[r]
        return out


class StreamBatches:
    """Endless (x, y) int64 [B, T] batches of packed windows; see the module docstring."""

    def __init__(self, source: _Source, seq_len: int, batch_size: int, vocab_size: int,
                 describe: dict[str, Any]) -> None:
        if seq_len < 1:
            raise ValueError(f"data.seq_len = {seq_len}: must be >= 1")
        self._source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.vocab_size, self._describe = vocab_size, describe
        self._segments: deque[tuple[Position, np.ndarray]] = deque()
        self._held = 0
        self._pos = Position()
        self._groups: Iterator[list[tuple[Position, np.ndarray]]] | None = None
        self.peak_buffer = 0  # the most tokens the stream held at once

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.seq_len * self.batch_size
        if self._groups is None:
            self._groups = self._source.groups(self._pos)
        while self._held <= step:  # one token more than a batch: the last target
            for segment in next(self._groups):
                self._segments.append(segment)
                self._held += len(segment[1])
        self.peak_buffer = max(self.peak_buffer, self._held)
        chunk = self._take(step + 1)  # [B*T + 1]
        self._drop(step)
        if chunk.max() >= self.vocab_size:
            raise ValueError(f"data ({self._source.corpus.root}): token id {int(chunk.max())} "
                             f">= vocab_size {self.vocab_size}; check data.tokenizer")
        t = torch.from_numpy(chunk.astype(np.int64))
        shape = (self.batch_size, self.seq_len)
        return t[:-1].view(shape).contiguous(), t[1:].view(shape).contiguous()  # x, y: [B, T]

    def _take(self, n: int) -> np.ndarray:
        parts, got = [], 0
        for _, ids in self._segments:
            parts.append(ids[:n - got])
            got += len(parts[-1])
            if got == n:
                break
        return np.concatenate(parts)

    def _drop(self, n: int) -> None:
        while n:
            pos, ids = self._segments[0]
            if len(ids) > n:
                self._segments[0] = (Position(pos.epoch, pos.index, pos.row, pos.token + n),
                                     ids[n:])
                self._held -= n
                break
            self._segments.popleft()
            self._held -= len(ids)
            n -= len(ids)
        self._pos = self._segments[0][0]

    def state(self) -> dict[str, Any]:
        """Where the stream stands (JSON-able): the next batch starts at this token."""
        return {**self._describe, **dict(zip(("epoch", "index", "row", "token"),
                                             astuple(self._pos), strict=True))}

    def mismatch(self, state: Any) -> str | None:
        """Why `state` cannot be restored here (another stream, malformed), or None."""
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
            return "not the position of a Parquet/Arrow stream"
        for key, want in self._describe.items():
            if state.get(key) != want:
                return f"made for another {key} ({state.get(key)!r}, this stream {want!r})"
        values = [state.get(k) for k in ("epoch", "index", "row", "token")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return "epoch, index, row and token must be integers >= 0"
        return None

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `state()` of the same stream); ValueError if not one."""
        if why := self.mismatch(state):
            raise ValueError(f"data position: {why}")
        self._pos = Position(state["epoch"], state["index"], state["row"], state["token"])
        self._segments.clear()
        self._held = 0
        self._groups = None


class StreamData:
    """A Parquet/Arrow corpus as training and eval batches (the module docstring)."""

    def __init__(self, corpus: Corpus, tokenizer: TextTokenizer, cfg: DataConfig,
                 piece_chars: int = PIECE_CHARS) -> None:
        self.corpus, self.tokenizer, self.piece_chars = corpus, tokenizer, piece_chars
        self.vocab_size = int(tokenizer.vocab_size)
        self.source = str(cfg.path)
        held = set(eval_units(len(corpus.units), cfg.eval_fraction))
        self.eval_units = [u for i, u in enumerate(corpus.units) if i in held]
        self.train_units = [u for i, u in enumerate(corpus.units) if i not in held]
        self.shard = None if cfg.shard_count is None else (cfg.shard_index or 0,
                                                          cfg.shard_count)
        if self.shard and self.shard[1] > len(self.train_units):
            raise ValueError(f"data.shard_count = {self.shard[1]}: the corpus has only "
                             f"{len(self.train_units)} training units (lower data.unit_rows)")
        self._evals: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def train_batches(self, worker: int | str, seq_len: int, batch_size: int,
                      seed: int) -> StreamBatches:
        """This worker's endless stream: its walk of the shared order (module docstring)."""
        walk = Walk(len(self.train_units), seed, worker, self.shard)
        source = _Source(self.corpus, self.train_units, self.tokenizer, walk.units, None,
                         self.piece_chars, "training")
        describe = {"kind": STATE_KIND, "corpus": self.corpus.fingerprint,
                    "train_units": len(self.train_units), "seed": seed, "walk": walk.label}
        return StreamBatches(source, seq_len, batch_size, self.vocab_size, describe)

    def eval_batches(self, seq_len: int, batch_size: int,
                     n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `n_batches` batches of the eval units read in order (fixed)."""
        key = (seq_len, batch_size, n_batches)
        if key not in self._evals:
            source = _Source(self.corpus, self.eval_units, self.tokenizer,
                             lambda _e: np.arange(len(self.eval_units)), 1, self.piece_chars,
                             "eval")
            stream = StreamBatches(source, seq_len, batch_size, self.vocab_size, {})
            try:
                self._evals[key] = [next(stream) for _ in range(n_batches)]
            except StopIteration:
                need = n_batches * batch_size * seq_len + 1
                raise ValueError(f"data ({self.source}): the eval units (data.eval_fraction) "
                                 f"hold fewer than the {need} tokens of {n_batches} eval "
                                 f"batches (data.eval_batches, data.batch_size, "
                                 "data.seq_len)") from None
        return self._evals[key]


def iter_corpus_tokens(corpus: Corpus, tokenizer: TextTokenizer,
                       piece_chars: int = PIECE_CHARS) -> Iterator[np.ndarray]:
    """Every unit's tokens in the corpus' sorted order, a tokenizer call's worth at a time."""
    source = _Source(corpus, corpus.units, tokenizer, lambda _e: np.arange(len(corpus.units)),
                     1, piece_chars, "corpus")
    for group in source.groups(Position()):
        if group:
            yield np.concatenate([ids for _, ids in group])


def load_stream(cfg: DataConfig) -> StreamData:
    """The Parquet/Arrow source `cfg` names, its eval batches read once to check them."""
    data = StreamData(open_corpus(cfg), load_tokenizer(cfg.tokenizer), cfg)
    data.eval_batches(cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    return data
