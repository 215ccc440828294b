"""``bench/compile.py`` runs: a smoke test of its ``--quick`` mode (a tiny Llama, compiled plain
and one compiled gradckpt plan, each compiled in processes of their own).

It checks that the run completes and prints the table and the verdict line; what they say
(and every time) is the benchmark's business, not this test's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compile.py"


def test_quick_mode_prints_the_table_and_the_verdict() -> None:
    # One torch thread: a smoke test of tiny models (see tests/conftest.py, one_thread).
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--max-foreign-load", "inf"],
        capture_output=True, text=True, timeout=900, env=environment,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("configuration "))
    names = [line.split("  ")[0] for line in lines[header + 2 : header + 4]]
    assert names[0] == "knob 1.0" and names[1].startswith("gradckpt optimal @"), lines[header:]
    assert lines[header + 4] == "", lines[header:]  # two rows, no more
    assert not any("FAILED" in line for line in lines), done.stdout
    assert lines[-2].startswith("verdict: a gradckpt plan at the knob's peak or lower"), lines[-2]
    assert "byte budget honoured by 1 of 1 plans" in lines[-2] or "by 0 of 1" in lines[-2]
