"""Doc references resolve: every ``docs/...md`` (and ``docs/...md#anchor``) named in ``pardec/`` or
``tests/`` is a file of the repository with that heading, every relative link inside ``docs/`` points
at an existing file and heading, and no code cites the method specification that lives outside the
repository (its citations now point at ``docs/methods/``).

Anchors follow GitHub's heading slugs: lowercase, punctuation dropped except ``-`` and ``_``, each
space a ``-``, and a repeated heading gets ``-1``, ``-2``, ... appended.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

THIS = Path(__file__).resolve()
ROOT = THIS.parents[1]
SCANNED = ("pardec", "tests")
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".md", ".sh", ".txt", ".toml", ".json", ".cfg"}
REFERENCE = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
# The out-of-repo specification's name as a citation. This file names it (and made-up doc paths) to
# test the checks, so the scans of the repository skip it.
OUT_OF_REPO_SPEC = re.compile(r"\bSPEC\b")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (without the leading #s)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor the headings of ``markdown`` define (headings inside code fences excluded)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def scanned_files(root: Path) -> list[Path]:
    """The text files under ``pardec/`` and ``tests/``, this file excepted."""
    return sorted(p for top in SCANNED for p in (root / top).rglob("*")
                  if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
                  and p.resolve() != THIS)


def check_target(root: Path, target: Path, anchor: str | None, where: str) -> list[str]:
    """Problems with a reference from ``where`` to ``target`` (a path) and ``anchor``."""
    if not target.is_file():
        return [f"{where}: {target.relative_to(root) if target.is_relative_to(root) else target} does not exist"]
    if anchor and anchor not in anchors(target.read_text()):
        return [f"{where}: {target.relative_to(root)} has no heading with anchor #{anchor}"]
    return []


def code_reference_problems(root: Path, files: list[Path]) -> tuple[int, list[str]]:
    """(references found, problems) for every ``docs/...md[#anchor]`` named in ``files``."""
    found, problems = 0, []
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for match in REFERENCE.finditer(line):
                found += 1
                where = f"{path.relative_to(root)}:{lineno}"
                problems += check_target(root, root / match.group(1), match.group(2), where)
    return found, problems


def doc_link_problems(root: Path) -> tuple[int, list[str]]:
    """(links found, problems) for every relative markdown link inside ``docs/``."""
    found, problems = 0, []
    for path in sorted((root / "docs").rglob("*.md")):
        fenced = False
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if FENCE.match(line):
                fenced = not fenced
            if fenced:
                continue
            for match in MD_LINK.finditer(line):
                link = match.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:, ...
                    continue
                found += 1
                file_part, _, anchor = link.partition("#")
                target = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(root)}:{lineno}"
                if file_part and not file_part.endswith(".md"):
                    if not target.exists():
                        problems.append(f"{where}: {file_part} does not exist")
                    continue
                problems += check_target(root, target, anchor or None, where)
    return found, problems


def test_every_doc_reference_in_code_and_tests_resolves():
    found, problems = code_reference_problems(ROOT, scanned_files(ROOT))
    assert found > 0, "no docs/...md reference found: the scan is broken"
    assert not problems, "\n".join(problems)


def test_links_inside_docs_resolve():
    found, problems = doc_link_problems(ROOT)
    assert found > 0, "no relative link found under docs/: the scan is broken"
    assert not problems, "\n".join(problems)


def test_no_code_cites_the_out_of_repo_spec():
    hits = [f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}"
            for path in scanned_files(ROOT)
            for lineno, line in enumerate(path.read_text().splitlines(), 1) if OUT_OF_REPO_SPEC.search(line)]
    assert not hits, "cite docs/methods/<method>.md#<heading> instead:\n" + "\n".join(hits)


@pytest.mark.parametrize("heading,expected", [
    ("Loss", "loss"),
    ("R-ISD with gated LoRA", "r-isd-with-gated-lora"),
    ("Counting (TPF, NFE, TPS)", "counting-tpf-nfe-tps"),
    ("`draft_init` and jacobi_forcing.md", "draft_init-and-jacobi_forcingmd"),
    ("Plan: scope & order", "plan-scope--order"),
])
def test_slug_follows_github_rules(heading, expected):
    assert slug(heading) == expected


def test_checker_flags_missing_files_anchors_and_counts_repeated_headings(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Loss\n\n```\n## Not a heading\n```\n\n## Loss\n\n[ok](#loss-1) [bad](#nope) [file](b.md)\n")
    (tmp_path / "pardec").mkdir()
    code = tmp_path / "pardec" / "m.py"
    code.write_text('"""See docs/a.md#loss and docs/a.md#loss-1, docs/a.md#not-a-heading, docs/gone.md."""\n')
    assert anchors((tmp_path / "docs" / "a.md").read_text()) == {"a", "loss", "loss-1"}
    found, problems = code_reference_problems(tmp_path, [code])
    assert found == 4
    assert problems == ["pardec/m.py:1: docs/a.md has no heading with anchor #not-a-heading",
                        "pardec/m.py:1: docs/gone.md does not exist"]
    found, problems = doc_link_problems(tmp_path)
    assert found == 3
    assert problems == ["docs/a.md:11: docs/a.md has no heading with anchor #nope",
                        "docs/a.md:11: docs/b.md does not exist"]
