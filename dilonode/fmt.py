"""Plain-text formatting shared by the commands, the `dilonode status` tables and the local
swarm's summary: byte counts and aligned tables. Standard library only, imports nothing of
ours, so any module may use it without pulling in torch or hivemind."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["grid", "human_bytes", "key_values"]


def human_bytes(n: float) -> str:
    """Decimal units: `512 B`, `7.9 MB`, `3.2 GB` (TB is the largest)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def key_values(rows: Sequence[tuple[str, str]], indent: str = "") -> str:
    """One `key  value` line per row, the values aligned."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{indent}{k.ljust(width)}  {v}" for k, v in rows)


def grid(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table: the header, a rule, one line per row, columns left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]
    return "\n".join(out)
