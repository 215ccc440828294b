"""docs/guarantees.md is what ``bench/guarantees.py`` writes now: the script runs in this process
(every test the page names looked up, every bad input of its catalogue run on a tiny model) and
the page on disk must equal its output. The catalogue's inputs are refused with a gradckpt error
and leave the model as it was."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "guarantees.py"

# The catalogue runs tiny models: one torch thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_guarantees", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return _load_script()


@pytest.fixture(scope="module")
def page(script: ModuleType, one_thread: None):
    return script.build_page()


def test_the_page_is_what_the_script_writes(script: ModuleType, page) -> None:
    diff = script.staleness(page)
    assert not diff, (f"docs/guarantees.md is stale; regenerate it with `{script.COMMAND}` "
                      f"and commit it:\n{diff[:6000]}")


def test_every_bad_input_is_refused_and_leaves_the_model_as_it_was(page) -> None:
    for result in page.results:
        if result.case.outcome == "error":
            assert result.error.endswith("Error"), (result.case.name, result.error)
        if result.case.outcome == "warning":
            assert result.error == "GradckptWarning", (result.case.name, result.error)
        assert result.message, result.case.name
        assert not result.changed, (f"{result.case.name}: {result.case.call} left the model "
                                    f"changed: {result.changed}")


def test_a_test_renamed_or_removed_stops_the_script(script: ModuleType) -> None:
    assert script.missing_tests(["tests/test_budget.py::test_sizes"]) == []
    assert script.missing_tests(["tests/test_budget.py::test_no_such_test",
                                 "tests/no_such_file.py::test_sizes"]) == [
        "tests/test_budget.py::test_no_such_test",
        "tests/no_such_file.py::test_sizes (no file tests/no_such_file.py)"]
