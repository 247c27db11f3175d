"""The documentation holds together: links resolve, every page the code names exists, each page
has a title, the README stays a front page, and no text is held twice."""
import re
from collections import defaultdict

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {".venv", ".venv-vllm", ".git", "runs", "__pycache__", ".pytest_cache"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MD_PATH = re.compile(r"[\w./-]*\w\.md\b")


def prose(path):
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def links(path):
    """(target, fragment) of every Markdown link and image outside code, http(s) excluded."""
    text = "\n".join(re.sub(r"`[^`]*`", "", line) for line in prose(path))
    for target in LINK.findall(text):
        if not target.startswith(("http://", "https://", "mailto:")):
            file, _, fragment = target.partition("#")
            yield file, fragment


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    return {slug(line.lstrip("#")) for line in prose(path) if re.match(r"#{1,6} ", line)}


def python_files():
    for path in sorted(ROOT.rglob("*.py")):
        if not SKIP_DIRS & set(path.relative_to(ROOT).parts):
            yield path


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page):
    missing = sorted({file for file, _ in links(page) if file and not (page.parent / file).exists()})
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_link_anchors_name_a_heading(page):
    bad = []
    for file, fragment in links(page):
        target = page.parent / file if file else page
        if fragment and target.suffix == ".md" and target.exists() and fragment not in anchors(target):
            bad.append(f"{file}#{fragment}")
    assert not bad, f"{page.relative_to(ROOT)} links to headings that do not exist: {bad}"


def test_md_files_named_in_the_code_exist():
    """A page a docstring or comment points to exists, at the repository root or in docs/.
    Paths under runs/ or absolute ones are outputs a script writes, not pages."""
    missing = []
    for path in python_files():
        for name in MD_PATH.findall(path.read_text(encoding="utf-8")):
            if name.startswith(("/", "runs/")):
                continue
            if not ((ROOT / name).is_file() or (ROOT / "docs" / name).is_file()):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, sorted(set(missing))


def test_the_repository_speaks_only_of_the_project():
    """No issue numbers or words about how the project was made, in any text file; and no pointer to
    notes outside the repository. (The patterns are spelled so that this file does not match them.)"""
    pattern = re.compile(r"issue [0-9]|lent[ ]to|this[ ]task", re.IGNORECASE)
    outside = re.compile(r"ALGORITHMS[.]md|shared[/]")
    skip = {".git", ".venv", ".venv-vllm", "venv", "runs", "__pycache__", ".pytest_cache"}
    files = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
             and p.suffix in (".py", ".md", ".yaml", ".yml", ".txt", ".toml", ".cfg", "")]
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in files
             for i, line in enumerate(path.read_text(encoding="utf-8", errors="ignore").splitlines(), 1)
             if pattern.search(line) or outside.search(line)]
    assert not found, found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_starts_with_a_title(page):
    assert page.read_text(encoding="utf-8").startswith("# "), page.relative_to(ROOT)


def test_readme_is_a_front_page_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    linked = {(ROOT / file).resolve() for file, _ in links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_no_text_is_held_twice():
    """A prose line (not code, not a table row) of 60 characters or more lives on one page only."""
    pages_of = defaultdict(set)
    for page in PAGES:
        for line in prose(page):
            if len(line.strip()) >= 60 and not line.startswith(("|", "    ")):
                pages_of[line.strip()].add(page.name)
    twice = {line: sorted(pages) for line, pages in pages_of.items() if len(pages) > 1}
    assert not twice, twice
