"""``bench/frontier.py`` runs (issue 25): a smoke test of its ``--quick`` mode on both models
(a small Transformers Llama, the default, and TinyGPT), as a user starts it.

Run as a subprocess (tests import no bench script), without the malloc variables, so that its
restart with glibc keeping freed memory is exercised too. It checks that the run completes,
with the gradients checked, and prints the tables of parts (a) and (b) and the verdict line;
what they say (every time, every ratio) is the benchmark's business, not this test's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "frontier.py"
PART_A = ["every layer", "every 2nd layer", "every 4th layer", "selective (matmuls)"]
PART_B = ["90%", "80%", "70%", "60%", "50%", "40%", "least"]


def table_rows(lines: list[str], heading: str, count: int) -> list[str]:
    """The first cell of each of the ``count`` rows of the table printed after ``heading``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    assert lines[start + 1].startswith("point "), lines[start:]
    rows = lines[start + 3 : start + 3 + count]
    assert lines[start + 3 + count] == "", lines[start:]  # that many rows, no more
    return [row.split("  ")[0].strip() for row in rows]


@pytest.mark.parametrize("model", ["llama", "tinygpt"])
def test_quick_mode_prints_both_parts_and_the_verdict(model: str) -> None:
    # One torch thread: a smoke test of tiny models (see tests/conftest.py, one_thread).
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--model", model, "--max-foreign-load", "inf"],
        capture_output=True, text=True, timeout=600, env=environment,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any("malloc: freed memory kept" in line for line in lines[:6]), lines[:6]
    assert any(line.startswith("gradients: ") and "bit for bit" in line for line in lines)
    assert table_rows(lines, "part (a): ", len(PART_A)) == PART_A
    assert table_rows(lines, "part (b): ", len(PART_B)) == PART_B
    verdicts = [line for line in lines if line.startswith("verdict: ")]
    assert len(verdicts) == 1 and verdicts[0] == lines[-1], lines[-3:]
    assert verdicts[0].startswith("verdict: gradckpt's extra time <= 0.75x the anchor's"), verdicts
    assert " PASS " in verdicts[0] or " FAIL " in verdicts[0], verdicts
