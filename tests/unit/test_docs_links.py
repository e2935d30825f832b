"""Every relative link in the Markdown docs points to a file that exists, and every
`#anchor` into a Markdown page names one of its headings (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = sorted(
    {ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "deploy" / "README.md",
     ROOT / "protocol" / "README.md", *(ROOT / "docs").rglob("*.md"),
     *[p for p in [ROOT / "benchmarks" / "README.md"] if p.exists()]})

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def links(text: str) -> list[str]:
    found = []
    for line in [_CODE_SPAN.sub("", line) for line in prose_lines(text)]:
        found += _INLINE.findall(line)
        if m := _REFERENCE.match(line):
            found.append(m.group(1))
    return found


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    ids = set()
    for line in prose_lines(page.read_text()):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def relative_links(page: Path) -> list[tuple[str, Path, str]]:
    """(link as written, the file it points to, its fragment) for each relative link."""
    out = []
    for target in links(page.read_text()):
        if _SCHEME.match(target):
            continue
        path, _, fragment = target.partition("#")
        out.append((target, (page.parent / path).resolve() if path else page, fragment))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page):
    missing = [t for t, path, _ in relative_links(page) if not path.exists()]
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_name_headings(page):
    broken = [t for t, path, fragment in relative_links(page)
              if fragment and path.suffix == ".md" and path.exists()
              and fragment not in anchors(path)]
    assert not broken, f"{page.relative_to(ROOT)}: anchors with no heading: {broken}"


def test_the_checker_sees_links_and_skips_code():
    text = ("See [a](x.md#top), ![img](img/p.png) and [web](https://example.org).\n"
            "`[not](code.md)`\n```\n[fenced](no.md)\n```\n[ref]: ref.md\n")
    assert links(text) == ["x.md#top", "img/p.png", "https://example.org", "ref.md"]
    assert slug("`[model]`: `ModelConfig`") == "model-modelconfig"
    assert slug("The end of a run: one model, or a non-zero exit") == \
        "the-end-of-a-run-one-model-or-a-non-zero-exit"
