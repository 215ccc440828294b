"""``bench/chunked_head.py`` runs: a smoke test of its ``--quick`` mode (a small Llama, vocab
8000: plain, the chunked head alone, and the least plans without and with it).

It checks that the run completes and prints the four rows and the verdict line; what they say
(and every time) is the benchmark's business, not this test's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "chunked_head.py"
ROWS = ["1 plain", "2 chunked head alone", "3 least without chunked head",
        "4 least with chunked head"]


def test_quick_mode_prints_the_four_rows_and_the_verdict() -> None:
    # One torch thread: a smoke test of tiny models (see tests/conftest.py, one_thread).
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--max-foreign-load", "inf"],
        capture_output=True, text=True, timeout=600, env=environment,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # restarted itself with glibc keeping freed memory
    assert any("malloc: freed memory kept" in line for line in lines[:6]), lines[:6]
    header = next(i for i, line in enumerate(lines) if line.startswith("contender "))
    names = [line.split("  ")[0].strip() for line in lines[header + 2 : header + 6]]
    assert names == ROWS, lines[header:]
    assert lines[header + 6] == "", lines[header:]  # four rows, no more
    assert "head in" in lines[header + 3] and "plain head" in lines[header + 2], lines[header:]
    assert any(line.startswith("least feasible peak ") and " -> " in line for line in lines)
    verdicts = [line for line in lines if line.startswith("verdict: ")]
    assert len(verdicts) == 1, lines
    assert "at most a quarter" in verdicts[0] and "within predicted + 3%" in verdicts[0]
