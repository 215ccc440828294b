"""The README and docs/ stand on their own: every file they point to is in the repository, none
cites a file outside it, and the README's runnable examples run and print what it quotes."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Paths the pages name as text (`tests/measure/test_measure_meter.py`, docs/engine.md), besides
# their links.
NAMED_PATH = re.compile(r"(?<![\w/.-])((?:docs|tests|bench|src|\.ci)/[\w./-]*\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
README_RUNNABLE = re.compile(r"```python runnable\n(.*?)```", flags=re.DOTALL)

# The examples run tiny models: one torch thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def targets(page: Path) -> list[str]:
    text = page.read_text()
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+://", link)]
    return links + NAMED_PATH.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_file_a_page_points_to_exists(page: Path) -> None:
    missing = []
    for target in targets(page):
        # Links are relative to the page; named paths to the repository's root.
        if not ((page.parent / target).exists() or (ROOT / target).exists()):
            missing.append(target)
    assert not missing, f"{page.name} points to files that do not exist: {missing}"


def test_the_check_sees_links_and_named_paths() -> None:
    page = ROOT / "docs" / "planning.md"
    found = targets(page)
    assert any(target.startswith("tests/") for target in found), found
    assert any(target.endswith(".md") for target in targets(ROOT / "README.md"))


def test_nothing_cites_files_outside_the_repository() -> None:
    tracked = [*PAGES, *ROOT.glob("src/**/*.py"), *ROOT.glob("bench/**/*.py"),
               *ROOT.glob("tests/**/*.py")]
    this_file = Path(__file__).resolve()
    citing = [str(path.relative_to(ROOT)) for path in tracked
              if path.resolve() != this_file and "DESIGN" + ".md" in path.read_text()]
    assert not citing, citing


def test_the_readme_says_what_sample_is_and_what_to_do_when_infeasible() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "### Using it with Hugging Face models" in readme
    assert '"labels": ids' in readme and "labels` included" in readme
    assert "### When the budget is infeasible" in readme
    for lever in ("chunks", "smaller batch", "LoRA", "FSDP2", "error.profile"):
        assert lever in readme, lever


# What a page written for users does not carry: the story of how the code got here (that lives
# in commit messages), the benchmarks' own pass/fail lines (docs/results/ keeps their whole
# output), and figures nobody checked.
DEVELOPMENT_HISTORY = re.compile(
    r"\bissue \d+|\bxfail\b|\bflake\b|\bverdict\b|(?-i:: (?:PASS|FAIL)\b)|from memory",
    flags=re.IGNORECASE,
)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_pages_say_what_is_true_now_not_how_it_got_there(page: Path) -> None:
    found = [match.group(0) for match in DEVELOPMENT_HISTORY.finditer(page.read_text())]
    assert not found, f"{page.name} carries development history or internal verdicts: {found}"


def test_the_quick_start_installs_what_the_readmes_examples_import() -> None:
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch==" in quick_start  # torch first: pip would pick a build itself
    assert re.search(r'pip install -e "\.\[[^"]*\bhf\b', quick_start), quick_start
    for command in ("gradckpt demo", "bash .ci/run"):
        assert command in quick_start, command


def _digits_masked(text: str) -> str:
    return re.sub(r"\d", "#", text).strip()


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(README_RUNNABLE.findall(
    (ROOT / "README.md").read_text()))))
def test_readme_examples_run(index: int) -> None:
    pytest.importorskip("transformers")
    readme = (ROOT / "README.md").read_text()
    block = README_RUNNABLE.findall(readme)[index]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})
    if "BudgetError" in block:  # the output quoted under it is what it prints
        quoted = re.match(r"```\n\s*```\n(.*?)```", readme.split(block, 1)[1], re.DOTALL)[1]
        error_text = printed.getvalue().split("block ")[0]
        assert _digits_masked(error_text) == _digits_masked(quoted)
