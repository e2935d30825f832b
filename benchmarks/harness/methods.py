"""The methods the quality benchmarks compare, by name: a mode, a codec of the codec table
and, for the compression frontier, sparsification (rand-k: positions every member draws
alike, `codec.kind = randk`; top-k: each node's largest values with their positions,
`codec.kind = topk`) and error feedback.

Keys: `ddp`, `diloco-fp32`, and Streaming DiLoCo as
`s-<codec>[-rand<percent kept>|-top<percent kept>][-ef[buf][-b<decay>]][-m<outer momentum>]
[-o<outer lr>][-h<H>]-a<alpha>` ("fp32" for float32), e.g. `s-int2-rand1.56-ef-a0.5`,
`s-int2-top1.56-ef-a0.5`; `-efbuf` keeps the residual beside the weights
(`codec.error_store = "buffer"`), so SparseLoCo's recipe (its accumulator, error decay 0.95
and an outer step without momentum at lr 1) is `s-int2-top1.56-efbuf-b0.95-m0-o1-a0.5`, and
`-h25` syncs every 25 steps
instead of the benchmark's H. Parts left out are the benchmark's settings. `row` parses one
and refuses, in one line, a codec or codec option this build does not have;
`codec_overrides` and `diloco_overrides` are its `codec` and `diloco` sections of a config.
Shared by `benchmarks.sim.quality` and `benchmarks.testbed.{wan,join}`.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

__all__ = ["FRONTIER_DENSITIES", "QUALITY", "Row", "codec_overrides", "diloco_overrides",
           "frontier_rows", "label", "row"]

FP32 = "float32"


@dataclass(frozen=True)
class Row:
    """One method: a mode, a codec of the codec table and, for the frontier, rand-k or
    top-k sparsification (`density`, the share of values kept) and error feedback."""

    key: str
    label: str
    mode: str  # ddp, diloco or streaming
    codec: str
    alpha: float | None  # None for DDP and DiLoCo (which pins tau = alpha = 0)
    density: float | None = None  # None: every value is sent
    error_feedback: bool = False
    sparsity: str = "randk"  # codec.kind of a row with a density: randk or topk
    error_decay: float | None = None  # None: the config's default
    error_buffer: bool = False  # codec.error_store = "buffer" (else the weights hold it)
    outer_momentum: float | None = None
    outer_lr: float | None = None
    sync_every: int | None = None  # None: the benchmark's H


# Streaming rows (module docstring), "fp32" for float32.
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_STREAMING_KEY = re.compile(rf"s-(?P<codec>[a-z0-9]+)(?:-(?P<sparse>rand|top)(?P<pct>{_NUMBER}))?"
                            rf"(?:(?P<ef>-ef)(?P<buf>buf)?(?:-b(?P<decay>{_NUMBER}))?)?"
                            rf"(?:-m(?P<momentum>{_NUMBER}))?(?:-o(?P<outer_lr>{_NUMBER}))?"
                            rf"(?:-h(?P<h>[0-9]+))?-a(?P<alpha>{_NUMBER})")
_FORM = ("s-<codec>[-rand<percent>|-top<percent>][-ef[buf][-b<decay>]][-m<momentum>][-o<lr>][-h<H>]"
         "-a<alpha>")
_SPARSITY = {"rand": ("randk", "rand-k", "sparse"), "top": ("topk", "top-k", "topk_codec")}
_FIXED = {"ddp": Row("ddp", "DDP (fp32, every step)", "ddp", FP32, None),
          "diloco-fp32": Row("diloco-fp32", "DiLoCo (fp32)", "diloco", FP32, None)}


def row(key: str) -> Row:
    """The row a key names; ValueError with one line when the key or its codec is unknown or
    needs codec options this build does not have."""
    if key in _FIXED:
        return _FIXED[key]
    from dilonode.algo.codec_table import CODECS
    from dilonode.config import CodecConfig

    m = _STREAMING_KEY.fullmatch(key)
    if m is None:
        raise ValueError(f"unknown row {key!r}: expected ddp, diloco-fp32 or {_FORM}")
    codec = FP32 if m["codec"] == "fp32" else m["codec"]
    if codec not in CODECS:
        raise ValueError(f"row {key!r}: codec {codec!r} is not in the codec table "
                         f"({', '.join(CODECS)})")
    density = float(Decimal(m["pct"]) / 100) if m["pct"] else None  # "1.56" -> 0.0156
    if density is not None and not 0 < density <= 1:
        raise ValueError(f"row {key!r}: {m['sparse']}-k percentage must be in (0, 100]")
    kind, what, sparse_module = _SPARSITY[m["sparse"] or "rand"]
    fields = CodecConfig.model_fields
    if density is not None and kind not in str(fields["kind"].annotation):
        raise ValueError(f"row {key!r} needs codec.kind = {kind}, which this build lacks")
    for wanted, option, module in ((density is not None, "topk_density", sparse_module),
                                   (bool(m["ef"]), "error_feedback", "error_feedback")):
        # The option and the algorithm behind it: a config field alone would run the row
        # as if the option were off.
        if wanted and (option not in fields
                       or importlib.util.find_spec(f"dilonode.algo.{module}") is None):
            raise ValueError(f"row {key!r} needs codec.{option} and dilonode/algo/"
                             f"{module}.py, which this build lacks")
    alpha = float(m["alpha"])
    decay, momentum, outer_lr = (None if m[k] is None else float(m[k])
                                 for k in ("decay", "momentum", "outer_lr"))
    if decay is not None and not 0 < decay <= 1:
        raise ValueError(f"row {key!r}: error decay must be in (0, 1]")
    if momentum is not None and not momentum < 1:
        raise ValueError(f"row {key!r}: outer momentum must be below 1")
    sync_every = None if m["h"] is None else int(m["h"])
    if sync_every is not None and sync_every < 1:
        raise ValueError(f"row {key!r}: H must be at least 1")
    name = "fp32" if codec == FP32 else codec
    label = (f"Streaming {name}" + (f", {what} {m['pct']}%" if density else "")
             + (", EF" if m["ef"] else "") + (" buffer" if m["buf"] else "")
             + (f" beta {m['decay']}" if decay else "")
             + (f", outer momentum {m['momentum']}" if momentum is not None else "")
             + (f", outer lr {m['outer_lr']}" if outer_lr is not None else "")
             + (f", H {sync_every}" if sync_every is not None else "")
             + f", alpha {m['alpha']}")
    return Row(key, label, "streaming", codec, alpha, density, bool(m["ef"]), kind,
               decay, bool(m["buf"]), momentum, outer_lr, sync_every)


# The rows of the quality report: DDP, DiLoCo and Streaming at 32 and 4 bits.
QUALITY = ["ddp", "diloco-fp32", "s-fp32-a0.5", "s-int4-a0.5", "s-fp4-a0.5",
           "s-fp32-a0", "s-int4-a0", "s-fp4-a0"]
# Rand-k densities of the frontier (percent of values kept); 1.56% is SparseLoCo's top-k.
FRONTIER_DENSITIES = ("1.56", "3")


def frontier_rows() -> list[str]:
    """The frontier: DiLoCo fp32 and int4 (the quality report's rows), then every integer
    or sign block codec of the codec table below 8 bits and rand-k and top-k at
    `FRONTIER_DENSITIES` over the 2-bit codec, each with error feedback, then without, and
    DDP. Rows this build cannot run (codec or option missing) are left out."""
    from dilonode.algo.codec_table import CODECS

    low = [n for n, s in CODECS.items() if s.quantizer in ("int", "sign") and s.bits < 8]
    variants = [f"s-{n}" for n in sorted(low, key=lambda n: -CODECS[n].bits)]
    if "int2" in CODECS:
        variants += [f"s-int2-{how}{pct}" for how in ("rand", "top")
                     for pct in FRONTIER_DENSITIES]
    # In the order they are worth running: error feedback first, then the twins without.
    keys = ["diloco-fp32", "s-int4-a0.5", *(f"{v}-ef-a0.5" for v in variants),
            *(f"{v}-a0.5" for v in variants), "ddp"]
    out = []
    for key in dict.fromkeys(keys):
        try:
            row(key)
        except ValueError:
            continue
        out.append(key)
    return out


def label(key: str) -> str:
    return row(key).label


def codec_overrides(r: Row, block_size: int) -> dict[str, Any]:
    """The `codec` section of a run of `r`. Options the row does not use are left out, so
    the configs of runs recorded before those options existed still match."""
    codec: dict[str, Any] = {"name": r.codec, "block_size": block_size}
    if r.density is not None:
        codec |= {"kind": r.sparsity, "topk_density": r.density}
    if r.error_feedback:
        codec |= {"error_feedback": True}
    if r.error_decay is not None:
        codec |= {"error_decay": r.error_decay}
    if r.error_buffer:
        codec |= {"error_store": "buffer"}
    return codec


def diloco_overrides(r: Row) -> dict[str, Any]:
    """The outer-step settings a row names (none: the benchmark's or the config's)."""
    out: dict[str, Any] = {}
    if r.sync_every is not None:
        out["sync_every"] = r.sync_every
    if r.outer_momentum is not None:
        out["outer_momentum"] = r.outer_momentum
    if r.outer_lr is not None:
        out["outer_lr"] = r.outer_lr
    return out
