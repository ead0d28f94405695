"""Every code block of README.md and docs/*.md runs as written, on CPU, on the embedded data.

A page's blocks run in order in one working directory that holds ``shards/`` (the build of
``python -m pipeline.pack``, packed once per session) and ``scripts/``, as the repository root
would: ``bash`` blocks in a shell, ``python`` blocks in one namespace per page, so a block may use
what an earlier block of its page defined. A block that cannot run here carries, on the line
right before its fence, ``<!-- not run in CI: REASON -->``; every other block must run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUN = re.compile(r"^\s*<!-- not run in CI: (?P<reason>\S.*?) -->\s*$")
RUNNABLE = {"python", "bash"}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, its text, where it starts, and why it is not run (if so)."""

    page: str
    line: int
    language: str
    code: str
    not_run: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language or 'no language'})"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the indentation of list items removed."""
    lines = page.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, language = len(opening.group(1)), opening.group(2)
        end = index + 1
        while not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        marker = NOT_RUN.match(lines[index - 1]) if index else None
        code = "\n".join(line[indent:] for line in lines[index + 1:end]) + "\n"
        found.append(Block(page.relative_to(ROOT).as_posix(), index + 1, language, code, marker and marker["reason"]))
        index = end + 1
    return found


def test_every_block_is_python_or_bash_or_says_why_it_is_not_run():
    assert (ROOT / "docs").is_dir()
    for page in PAGES:
        for block in blocks(page):
            if block.not_run is None:
                assert block.language in RUNNABLE, f"{block}: mark it <!-- not run in CI: REASON --> or make it python/bash"
    marked = [b for page in PAGES for b in blocks(page) if b.not_run is not None]
    assert all(len(b.not_run.split()) >= 2 for b in marked), [str(b) for b in marked if len(b.not_run.split()) < 2]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, page.name


def test_every_link_between_pages_finds_its_page_and_heading():
    for page in PAGES:
        for target, anchor in re.findall(r"\]\((?!https?://)([^)#]*)#?([^)]*)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            assert linked.exists(), f"{page.name}: broken link {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{page.name}: no heading #{anchor} in {target or page.name}"


def test_every_test_the_guarantees_name_exists():
    page = ROOT / "docs" / "guarantees.md"
    named = 0
    for row in re.findall(r"^\|.*\|$", page.read_text(), flags=re.M):
        file = None
        for given_file, name in re.findall(r"`(test_\w+\.py)?::(\w+)`", row):
            file = given_file or file
            assert file, f"guarantees.md: ::{name} follows no test file in its row"
            source = (ROOT / "tests" / file).read_text()
            assert re.search(rf"^(async )?def {name}\(", source, flags=re.M), f"guarantees.md: no test {file}::{name}"
            named += 1
    assert named >= 50


def environment() -> dict[str, str]:
    """The shell of a ``bash`` block: ``python`` is the interpreter running the tests, as in an activated environment."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1"}


@pytest.fixture
def default_build(quickstart) -> Path:
    """``shards/`` after the Quickstart's ``python -m pipeline.pack``: the embedded GSM8K test set."""
    cwd, done = quickstart
    assert done.returncode == 0, done.stderr
    return cwd / "shards"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_blocks_of_a_page_run_as_written(page, default_build, tmp_path, monkeypatch):
    shutil.copytree(default_build, tmp_path / "shards")
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    namespace: dict = {"__name__": "__docs__"}
    to_run = [block for block in blocks(page) if block.not_run is None]
    for block in to_run:
        if block.language == "bash":
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], env=environment(), capture_output=True,
                                  text=True)
            assert done.returncode == 0, f"{block} failed:\n{block.code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        else:
            try:
                exec(compile(block.code, str(block), "exec"), namespace)
            except Exception as err:
                raise AssertionError(f"{block} failed:\n{block.code}") from err
