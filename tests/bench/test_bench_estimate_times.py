"""``bench/estimate_times.py`` runs: a smoke test of its ``--quick`` mode, as a user starts it.

Run as a subprocess (tests import no bench script), so that its restart under glibc's
kept-freed-memory settings is exercised too. It must finish and print every table and the
verdict line; what the times say is the benchmark's business, never asserted here (times on a
shared CPU move from run to run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_quick_mode_prints_every_table_and_the_verdict() -> None:
    # Without the malloc variables, so that the script sets them and restarts itself; one torch
    # thread: a smoke test of tiny models (see tests/conftest.py, one_thread).
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("MALLOC_")}
    environment["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, str(BENCH / "estimate_times.py"), "--quick"],
        capture_output=True, text=True, timeout=180, env=environment,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "malloc: freed memory kept" in out, out
    for heading in ("steps:", "blocks:", "plans (solved from the measured profile)"):
        assert heading in out, out
    assert "profile/estimate" in out and "fwd/step meas." in out and "extra: estimate" in out
    assert "none (noise floor)" in out and "every-layer" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("verdict: extra-time share of the plain step from the estimate"), last


def test_unknown_model_names_are_refused() -> None:
    # Before anything is measured, and before the restart with freed memory kept.
    done = subprocess.run(
        [sys.executable, str(BENCH / "estimate_times.py"), "--only", "llama,gpt5"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MALLOC_MMAP_MAX_": "0"},
    )
    assert done.returncode != 0
    assert "unknown family gpt5" in done.stderr, done.stderr
