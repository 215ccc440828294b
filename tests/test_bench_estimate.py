"""``bench/estimate_accuracy.py`` runs (issue 15): a smoke test of its ``--quick`` mode.

Two cases at their small size: every row is there (the plain step, 70% and 45%), the plans
solved from the estimate leave the gradients as the plain model's, the table and the verdict
line print. How accurate the estimate is over every family and size is the benchmark's
verdict, not this test's; on Llama and the CNN the plain step's bytes must be exact, as
``tests/test_estimate.py`` also asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import estimate_accuracy  # noqa: E402  (bench/estimate_accuracy.py)

pytestmark = pytest.mark.slow


def test_quick_mode_gives_every_row_with_identical_gradients() -> None:
    printed: list[str] = []
    cases = estimate_accuracy.chosen_cases("llama,cnn")
    rows = estimate_accuracy.run(cases, quick=True, report=printed.append)
    assert [(row.model, row.what.split()[0]) for row in rows] == [
        (name, what) for name in ("llama", "cnn") for what in ("plain", "70%", "45%")
    ]
    assert len(printed) == len(rows)
    for row in rows:
        assert row.identical, f"{row.model} {row.what}: gradients differ from the plain model's"
        if row.what == "plain":
            assert row.estimated_bytes == row.measured_bytes, row
            assert row.block_saved_error == 0.0, row
        else:
            assert row.budget_bytes is not None and row.over_budget is not None
    line = estimate_accuracy.verdict(rows)
    assert line.startswith("verdict: peak error median") and line.endswith(
        "gradients identical: PASS")


def test_unknown_case_names_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown case"):
        estimate_accuracy.chosen_cases("llama,gpt5")
