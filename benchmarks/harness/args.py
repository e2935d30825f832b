"""Comma-separated option values (`--rates 100,20`, `--codecs int4,float32`), parsed one way.

Each function takes the option's text and returns its items, blanks around them and empty
items dropped, so "100, 20," is [100.0, 20.0]. They work as an argparse `type=` or on the
string an option keeps.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["chosen", "floats", "ints", "names"]


def names(text: str) -> list[str]:
    """The comma-separated items of `text`, stripped, empty ones dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def floats(text: str) -> list[float]:
    """`names(text)` as floats (rates in Mbit/s, learning rates, speeds)."""
    return [float(item) for item in names(text)]


def ints(text: str) -> list[int]:
    """`names(text)` as ints (seeds, delays)."""
    return [int(item) for item in names(text)]


def chosen(text: str, known: Iterable[str], what: str) -> list[str]:
    """`names(text)`, each of which must be one of `known`; otherwise exit with one line,
    `what` (the program and its option, "wan.py: --runs") naming where it came from."""
    known = list(known)
    items = names(text)
    if bad := [item for item in items if item not in known]:
        raise SystemExit(f"{what} {','.join(bad)}: not one of {','.join(known)}")
    return items
