"""Plans on the models people fine-tune, as ``bench/predictions.py`` runs them (issue 13).

GPT-2, Llama, Qwen2, BERT (masked LM), T5 and ViT built from configs and called with their
labels, a CNN with BatchNorm, and frozen bases with adapters (hand-written LoRA, PEFT on Llama):
at 70% and 45% of the plain peak (or the smallest feasible budget), the step as users write it
(``out = model(**batch); out.loss.backward()``, the output held) measures within the budget
+ 3%, the prediction within 3% of the measured peak, the gradients equal the plain model's bit
for bit; the plain step's prediction is never below its measured peak. The cases are the
benchmark's own, so the table in ``docs/planning.md`` and this test check the same models.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import predictions  # noqa: E402  (bench/predictions.py: the cases and the user's step)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", predictions.CASES, ids=lambda case: case.name)
def test_plans_fit_and_are_predicted_on_each_family(case: predictions.Case) -> None:
    rows = predictions.run_case(case)
    assert [row["budget"].split()[0] for row in rows] == ["plain", "70%", "45%"]
    for row in rows:
        where = f"{case.name} at {row['budget']}"
        assert row["identical"], f"{where}: gradients differ from the plain model's"
        if row["budget_bytes"] is not None:
            assert row["measured"] <= row["budget_bytes"] * (1 + predictions.ALLOWANCE), (
                f"{where}: measured {row['measured']} over budget {row['budget_bytes']}")
        error = (row["predicted"] - row["measured"]) / row["measured"]
        message = (f"{where}: predicted {row['predicted']}, "
                   f"measured {row['measured']} ({error:+.2%})")
        if row["budget_bytes"] is None:
            # The step without checkpointing: never under-predicted (the CNN's is one hidden
            # state high, docs/planning.md "Known limits").
            assert error >= -0.001, message
        else:
            assert abs(error) <= predictions.ALLOWANCE, message
