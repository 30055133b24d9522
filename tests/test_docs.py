"""The README and docs/: a short front door (under 8 KB, one table of current figures, a link to every doc, only
commands that exist), every results page opening with its current figures, and every relative link (file and
#anchor) resolves."""

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


README = ROOT / "README.md"
RESULT_PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
RESULT_COLUMNS = "| method | speedup [95% CI] | n | engine | CPU line | commit |"


def make_targets_named(text: str) -> set[str]:
    """The targets of every `make ...` in a text (inline code or a code block's line), variables and comments
    dropped."""
    targets = set()
    for match in re.finditer(r"(?:^|`)make ([^`#\n]*)", text, flags=re.M):
        targets |= {word for word in match.group(1).split() if re.fullmatch(r"[a-z][\w-]*", word)}
    return targets


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    rules = re.findall(r"^([A-Za-z][\w .-]*?)\s*:(?![=])", text, flags=re.M)
    return {name for rule in rules for name in rule.split()}


def test_readme_is_under_8_kb():
    assert README.stat().st_size < 8_192


def test_every_command_the_readme_names_exists():
    text = README.read_text()
    named = make_targets_named(text)
    assert {"all", "test", "models", "benchmarks"} <= named
    assert named - makefile_targets() == set()
    scripts = set(re.findall(r"\bscripts/[\w/]+\.py", text))
    assert [s for s in sorted(scripts) if not (ROOT / s).exists()] == []
    for module in set(re.findall(r"python -m (treegraft[\w.]*)", text)):
        path = ROOT / "src" / Path(*module.split("."))
        assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), module


def test_the_make_target_parser():
    text = "`make all ALL_EXPERIMENT=cpu` and `make collect fit distill`\nmake test    # the suite\nto make sense"
    assert make_targets_named(text) == {"all", "collect", "fit", "distill", "test"}
    assert {"all", "test", "test-all", "benchmarks", "help"} <= makefile_targets()


def test_readme_is_a_door_to_every_doc_and_results_page():
    linked = {target.partition("#")[0] for target in links(README)}
    pages = ["docs/usage.md", "docs/pipeline.md", "docs/engine.md", "docs/gpu.md", "docs/development.md"]
    pages += [str(page.relative_to(ROOT)) for page in RESULT_PAGES]
    assert [page for page in pages if page not in linked] == []


def test_readme_has_one_table_of_current_figures():
    text = README.read_text()
    assert text.count(RESULT_COLUMNS) == 1
    rows = []
    for line in text.split(RESULT_COLUMNS, 1)[1].strip().splitlines()[1:]:  # after the |---| line
        if not line.startswith("|"):
            break
        rows.append(line)
    assert rows, "the current-figures table has no rows"
    for row in rows:
        assert re.search(r"\d\.\d\d \[\d\.\d\d, \d\.\d\d\]", row), row  # a speedup with its 95% CI
        assert re.search(r"\| [0-9a-f]{7,40} \|$", row), row  # ends with a commit


@pytest.mark.parametrize("page", RESULT_PAGES, ids=lambda p: p.name)
def test_every_results_page_opens_with_its_current_figures(page):
    headings = re.findall(r"^## (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    assert headings[:2] == ["Current figures", "History"]
    current = page.read_text().split("## Current figures", 1)[1].split("## History", 1)[0]
    assert re.search(r"^\|.*\bcommit\b.*\|$", current, flags=re.M), "no table with a commit column"


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

