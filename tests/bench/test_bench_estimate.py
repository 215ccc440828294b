"""``bench/estimate_accuracy.py`` runs (issue 15): a smoke test of its ``--quick`` mode, as a
user starts it (a subprocess: tests import no bench script).

Two families at their small size: every row is there (the plain step, 70% and 45%), the plans
solved from the estimate leave the gradients as the plain model's, the table and the verdict
line print. How accurate the estimate is over every family and size is the benchmark's
verdict, not this test's; on Llama and the CNN the plain step's bytes must be exact, as
``tests/predict/test_predict_estimate.py`` also asserts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "estimate_accuracy.py"


def run_script(*arguments: str) -> subprocess.CompletedProcess[str]:
    # One torch thread: a smoke test of tiny models (see tests/conftest.py, one_thread).
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_quick_mode_gives_every_row_with_identical_gradients() -> None:
    done = run_script("--quick", "--only", "llama,cnn")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("model "))
    # Columns: model (11 wide), size (10), what (11), then budget, estimated, measured, error,
    # vs budget, block saved and gradients.
    rows = [(line[:11].strip(), line[23:34].strip(), line[35:].split())
            for line in lines[header + 2:header + 8]]
    assert [(model, what.split()[0]) for model, what, _ in rows] == [
        (name, what) for name in ("llama", "cnn") for what in ("plain", "70%", "45%")
    ], done.stdout
    for model, what, cells in rows:
        budget, estimated, measured, error, over, saved = cells[:6]
        gradients = " ".join(cells[6:])
        # Bit for bit; a plan with the loss in chunks sums it in another order.
        assert gradients == "identical" or (
            gradients.startswith("within ") and gradients.endswith(" chunks)")
        ), f"{model} {what}: gradients differ from the plain's: {gradients}"
        if what == "plain":
            assert (estimated, error, saved) == (measured, "+0.00%", "0.00%"), cells
        else:
            assert budget != "-" and over != "-", cells
    verdict = next(line for line in lines if line.startswith("verdict: "))
    assert verdict.startswith("verdict: peak error median"), verdict
    assert verdict.endswith("gradients identical: PASS"), verdict


def test_unknown_family_names_are_refused() -> None:
    done = run_script("--only", "llama,gpt5")
    assert done.returncode != 0
    assert "unknown family gpt5" in done.stderr, done.stderr
