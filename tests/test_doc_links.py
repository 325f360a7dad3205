"""Every relative link in README.md and docs/*.md resolves (stdlib + pytest only).

A link ``[text](path)`` or ``[text](path#anchor)`` must name a file or directory
of this repo, relative to the markdown file that holds it (``/path``: relative
to the repo root). An anchor into a markdown file, or a pure ``#anchor`` into the
file itself, must match one of that file's headings by GitHub's slug rules:
lowercase, spaces to hyphens, punctuation dropped except hyphens and
underscores, ``-1``, ``-2``, ... for repeated headings. ``http(s)://`` and
``mailto:`` links are not checked; links inside code spans and fenced code
blocks are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]

EXTERNAL = re.compile(r"^(?:https?://|mailto:)", re.IGNORECASE)
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)[\s\S]*?(?<!`)\1(?!`)")
# [text](target) and ![alt](target), the text may hold one level of brackets
# and wrap lines; the target may be <...> and be followed by a "title".
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"
    r"\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)"
)
# [ref]: target
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)", re.MULTILINE)
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _code_free_lines(text: str) -> list[str]:
    """The lines of ``text`` with fenced code blocks blanked (line count kept)."""
    lines, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            lines.append("")
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                if not line.strip().strip(fence[0]):
                    fence = None
            lines.append("")
        else:
            lines.append(line)
    return lines


def _without_code(text: str) -> str:
    """Fenced blocks blanked, code spans replaced by ``code`` (newlines kept)."""
    text = "\n".join(_code_free_lines(text))
    return CODE_SPAN.sub(lambda m: "code" + "\n" * m.group().count("\n"), text)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before the -1, -2 of repeats)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file defines: its headings' slugs, <a name/id>."""
    text = path.read_text(encoding="utf-8")
    lines = _code_free_lines(text)
    found: set[str] = set(HTML_ANCHOR.findall("\n".join(lines)))
    seen: dict[str, int] = {}

    def add(heading: str) -> None:
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")

    for i, line in enumerate(lines):
        m = ATX_HEADING.match(line)
        if m:
            add(m.group(2) or "")
            continue
        prev = lines[i - 1] if i else ""
        if (
            SETEXT_UNDERLINE.match(line)
            and prev.strip()
            and not ATX_HEADING.match(prev)
            and not SETEXT_UNDERLINE.match(prev)
            and not re.match(r"^\s*([-*+>|]|\d+[.)])\s", prev)
            and "|" not in prev
        ):
            add(prev.strip())
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in a markdown file."""
    text = _without_code(path.read_text(encoding="utf-8"))
    out = []
    for regex in (INLINE_LINK, REFERENCE_DEF):
        for m in regex.finditer(text):
            target = m.group(1)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            out.append((text.count("\n", 0, m.start(1)) + 1, target))
    return sorted(out)


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of ``path``, one line each."""
    root, path = root.resolve(), path.resolve()
    problems = []
    for line, target in links(path):
        where = f"{path.relative_to(root)}:{line}: ({target})"
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        if not file_part:
            dest = path
        elif file_part.startswith("/"):
            dest = root / file_part.lstrip("/")
        else:
            dest = path.parent / file_part
        dest = dest.resolve()
        if not dest.is_relative_to(root):
            problems.append(f"{where} points outside the repo")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file {dest.relative_to(root)}")
            continue
        if anchor and dest.is_file() and dest.suffix.lower() == ".md":
            if unquote(anchor).lower() not in anchors(dest):
                problems.append(
                    f"{where}: no heading with anchor #{anchor} in "
                    f"{dest.relative_to(root)}"
                )
    return problems


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    assert doc.is_file(), doc
    problems = broken_links(doc)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_docs_are_linked_from_the_readme():
    targets = {t.partition("#")[0] for _, t in links(REPO / "README.md")}
    for name in ("operators", "maintainers", "forks", "development"):
        assert f"docs/{name}.md" in targets, name


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.py").write_text("")
    (tmp_path / "docs" / "a.md").write_text(
        "# Title\n\n## Router settings for PD\n\n## Install into sglang 0.5.23\n\n"
        "## What `status` says: exit codes\n\n## Notes\n\n## Notes\n\n"
        "Other heading\n-------------\n"
    )
    (tmp_path / "README.md").write_text(
        "# Readme\n\n"
        "ok: [a](docs/a.md), [anchor](docs/a.md#router-settings-for-pd),\n"
        "[dots](docs/a.md#install-into-sglang-0523), [code](docs/a.md"
        "#what-status-says-exit-codes), [repeat](docs/a.md#notes-1),\n"
        "[setext](docs/a.md#other-heading), [dir](sub), [py](sub/x.py#L1),\n"
        "[root](/docs/a.md), [self](#readme), [web](https://example.com/nope),\n"
        "[mail](mailto:someone@example.com), `[in code](nope.md)`,\n"
        '![img](sub/x.py "title"), [wrapped\ntext](docs/a.md).\n\n'
        "```\n[fenced](nope.md)\n```\n\n"
        "broken: [missing](docs/missing.md), [bad anchor](docs/a.md#no-such),\n"
        "[bad self](#nowhere), [out](../outside.md), [repeat](docs/a.md#notes-2)\n\n"
        "[ref]: docs/also-missing.md\n"
    )
    problems = broken_links(tmp_path / "README.md", root=tmp_path)
    assert len(problems) == 6, "\n".join(problems)
    for bad in (
        "(docs/missing.md)",
        "(docs/a.md#no-such)",
        "(#nowhere)",
        "(../outside.md)",
        "(docs/a.md#notes-2)",
        "(docs/also-missing.md)",
    ):
        assert any(bad in p for p in problems), (bad, problems)
    assert broken_links(tmp_path / "docs" / "a.md", root=tmp_path) == []


def test_github_slugs():
    assert github_slug("Router settings for PD") == "router-settings-for-pd"
    assert github_slug("Install into your own sglang 0.5.23") == (
        "install-into-your-own-sglang-0523"
    )
    assert github_slug("`PD decode state` lines, and metrics") == (
        "pd-decode-state-lines-and-metrics"
    )
    assert github_slug("P1 / P2: cycle stall") == "p1--p2-cycle-stall"
    assert github_slug("snake_case and hyphen-ated") == "snake_case-and-hyphen-ated"
