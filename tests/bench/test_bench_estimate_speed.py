"""``bench/estimate_speed.py`` runs: a smoke test of its ``--quick`` mode (the four settings on a
5-layer Llama config, in the script's own process).

It checks that the run completes and prints the four rows and the two verdict lines; the times are
the benchmark's business, not this test's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "estimate_speed.py"


def test_quick_mode_prints_the_four_settings_and_the_verdicts() -> None:
    pytest.importorskip("peft")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--max-foreign-load", "inf"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("setting "))
    names = [line[:8].strip() for line in lines[header + 2 : header + 6]]
    assert names == ["full 1k", "full 8k", "LoRA 1k", "LoRA 8k"], lines[header:]
    assert all("gradckpt plan " in line and "--estimate" in line
               for line in lines[header + 2 : header + 6])
    assert "--lora 16" in lines[header + 4] and "--seq 64" in lines[header + 5]
    verdicts = [line for line in lines if line.startswith("verdict: ")]
    assert [line.split(":")[1] for line in verdicts] == [
        " every estimate under 10 s start to end", " every estimate under 10 s without the imports"
    ], lines
