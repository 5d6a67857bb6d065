"""The documentation a newcomer reads: a short README whose two commands are real Makefile
targets, and links (README, docs/, benchmarks/README.md) that all lead somewhere, anchors
included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 300
PAGES = [README, REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# [text](target) outside code; images too. Targets with a scheme are external.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _prose(path: Path) -> list[str]:
    """The lines of `path` outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match and not fenced:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            anchors.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return anchors


def _relative_links(path: Path) -> list[str]:
    return [
        target
        for line in _prose(path)
        for target in _LINK.findall(line)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES} and move detail "
        "into docs/"
    )


def test_the_readmes_two_commands_are_makefile_targets() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^make ([\w-]+)", section, flags=re.MULTILINE)
    assert commands == ["serve", "test"]
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE))
    assert set(commands) <= targets, f"Makefile lacks {set(commands) - targets}"
    phony = " ".join(re.findall(r"^\.PHONY:(.*)$", makefile, flags=re.MULTILINE)).split()
    assert set(commands) <= set(phony)


def _broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file does not exist, or whose anchor names no
    heading of the Markdown file it points to."""
    broken = []
    for target in _relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = _broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {
        (README.parent / t.partition("#")[0]).resolve()
        for t in _relative_links(README)
        if t.partition("#")[0]
    }
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md does not link docs/{', docs/'.join(missing)}"


def test_broken_links_and_anchors_are_caught(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Setting `x.y`: on, off\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n"
        "[fine](other.md#setting-xy-on-off) [self](#title) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#setting) `[code](nope.md)`\n"
        "```\n[fenced](nope.md)\n```\n"
    )
    assert _broken_links(page) == [
        "missing.md: no such file",
        "other.md#setting: no heading with anchor #setting in other.md",
    ]
