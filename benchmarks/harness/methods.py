"""The methods the quality benchmarks compare, by name: a mode, a codec of the codec table
and, for the compression frontier, rand-k sparsification (positions every member draws
alike, `codec.kind = randk`) and error feedback.

Keys: `ddp`, `diloco-fp32`, and Streaming DiLoCo as `s-<codec>[-rand<percent kept>][-ef]-a<alpha>`
("fp32" for float32), e.g. `s-int2-rand1.56-ef-a0.5`. `row` parses one and refuses, in one
line, a codec or codec option this build does not have; `codec_overrides` is its `codec`
section of a config. Shared by `benchmarks.sim.quality` and `benchmarks.testbed.wan`.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

__all__ = ["FRONTIER_DENSITIES", "QUALITY", "Row", "codec_overrides", "frontier_rows",
           "label", "row"]

FP32 = "float32"


@dataclass(frozen=True)
class Row:
    """One method: a mode, a codec of the codec table and, for the frontier, rand-k
    sparsification (`density`, the share of values kept) and error feedback."""

    key: str
    label: str
    mode: str  # ddp, diloco or streaming
    codec: str
    alpha: float | None  # None for DDP and DiLoCo (which pins tau = alpha = 0)
    density: float | None = None  # None: every value is sent
    error_feedback: bool = False


# Streaming rows: s-<codec>[-rand<percent kept>][-ef]-a<alpha>, "fp32" for float32.
_STREAMING_KEY = re.compile(r"s-(?P<codec>[a-z0-9]+)(?:-rand(?P<pct>[0-9.]+))?(?P<ef>-ef)?"
                            r"-a(?P<alpha>[0-9.]+)")
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
        raise ValueError(f"unknown row {key!r}: expected ddp, diloco-fp32 or "
                         "s-<codec>[-rand<percent>][-ef]-a<alpha>")
    codec = FP32 if m["codec"] == "fp32" else m["codec"]
    if codec not in CODECS:
        raise ValueError(f"row {key!r}: codec {codec!r} is not in the codec table "
                         f"({', '.join(CODECS)})")
    density = float(Decimal(m["pct"]) / 100) if m["pct"] else None  # "1.56" -> 0.0156
    if density is not None and not 0 < density <= 1:
        raise ValueError(f"row {key!r}: rand-k percentage must be in (0, 100]")
    fields = CodecConfig.model_fields
    for wanted, option, module in ((density is not None, "topk_density", "sparse"),
                                   (bool(m["ef"]), "error_feedback", "error_feedback")):
        # The option and the algorithm behind it: a config field alone would run the row
        # as if the option were off.
        if wanted and (option not in fields
                       or importlib.util.find_spec(f"dilonode.algo.{module}") is None):
            raise ValueError(f"row {key!r} needs codec.{option} and dilonode/algo/"
                             f"{module}.py, which this build lacks")
    alpha = float(m["alpha"])
    name = "fp32" if codec == FP32 else codec
    label = (f"Streaming {name}" + (f", rand-k {m['pct']}%" if density else "")
             + (", EF" if m["ef"] else "") + f", alpha {m['alpha']}")
    return Row(key, label, "streaming", codec, alpha, density, bool(m["ef"]))


# The rows of the quality report: DDP, DiLoCo and Streaming at 32 and 4 bits.
QUALITY = ["ddp", "diloco-fp32", "s-fp32-a0.5", "s-int4-a0.5", "s-fp4-a0.5",
           "s-fp32-a0", "s-int4-a0", "s-fp4-a0"]
# Rand-k densities of the frontier (percent of values kept); 1.56% is SparseLoCo's top-k.
FRONTIER_DENSITIES = ("1.56", "3")


def frontier_rows() -> list[str]:
    """The frontier: DiLoCo fp32 and int4 (the quality report's rows), then every integer
    or sign block codec of the codec table below 8 bits and rand-k at `FRONTIER_DENSITIES`
    over the 2-bit codec, each with error feedback, then without, and DDP. Rows this build
    cannot run (codec or option missing) are left out."""
    from dilonode.algo.codec_table import CODECS

    low = [n for n, s in CODECS.items() if s.quantizer in ("int", "sign") and s.bits < 8]
    variants = [f"s-{n}" for n in sorted(low, key=lambda n: -CODECS[n].bits)]
    if "int2" in CODECS:
        variants += [f"s-int2-rand{pct}" for pct in FRONTIER_DENSITIES]
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
        codec |= {"kind": "randk", "topk_density": r.density}
    if r.error_feedback:
        codec |= {"error_feedback": True}
    return codec
