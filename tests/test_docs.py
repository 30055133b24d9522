"""The README and docs/: short front door, and every relative link (file and #anchor) resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "custom_generate" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [a or b for a, b in LINK.findall(text)]


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


def test_readme_is_at_most_12_kb():
    assert (ROOT / "README.md").stat().st_size <= 12_288


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_link_check_catches_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Real heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#real-heading) [bad](missing.md) [bad anchor](other.md#nope) "
                    "![img](pic.png) [web](https://example.com) [self](#top)\n# Top\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#nope (no heading #nope in other.md)",
                                  "pic.png (no such file)"]

