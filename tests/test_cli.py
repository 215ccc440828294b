"""The ``gradckpt`` command line, run as a user runs it: in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import gradckpt


def run_gradckpt(*arguments: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    # One thread keeps the quick demo fast and its timings undisturbed on small CI machines.
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(
        [sys.executable, "-m", "gradckpt", *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )


@pytest.fixture(scope="module")
def quick_demo() -> subprocess.CompletedProcess[str]:
    return run_gradckpt("demo", "--quick", "--device", "cpu")


def test_quick_demo_exits_zero(quick_demo):
    assert quick_demo.returncode == 0, quick_demo.stderr


def test_quick_demo_prints_the_table(quick_demo):
    out = quick_demo.stdout
    assert "every block checkpointed" in out
    assert "peak memory, forward+backward" in out
    assert "step time (median, ratio)" in out
    assert "MiB" in out


def test_quick_demo_training_is_bit_identical(quick_demo):
    # Engine invariant 1: checkpointing changes neither losses nor gradients, dropout included.
    lines = quick_demo.stdout.splitlines()
    for row in ("losses (", "gradients", "parameters after training"):
        matching = [line for line in lines if line.startswith(row)]
        assert matching, f"no {row!r} row in:\n{quick_demo.stdout}"
        assert "identical (bit for bit)" in matching[0]
    assert "DIFFERENT" not in quick_demo.stdout


def test_quick_demo_saves_memory(quick_demo):
    memory_row = next(
        line for line in quick_demo.stdout.splitlines() if line.startswith("peak memory")
    )
    plain_mib, checkpointed_mib = (
        float(cell) for cell in memory_row.replace("MiB", " MiB").split() if _is_number(cell)
    )
    assert checkpointed_mib < plain_mib


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_version():
    result = run_gradckpt("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"gradckpt {gradckpt.__version__}"


@pytest.mark.parametrize(
    "arguments",
    [
        ("demo", "--no-such-flag"),
        ("demo", "--layers", "0"),
        ("demo", "--steps", "two"),
        ("no-such-command",),
        (),
    ],
)
def test_usage_errors_exit_2(arguments):
    result = run_gradckpt(*arguments)
    assert result.returncode == 2
    assert "usage:" in result.stderr


def test_runtime_error_is_one_line_and_exits_1():
    result = run_gradckpt("demo", "--quick", "--device", "tpu")
    assert result.returncode == 1
    error_lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1
    assert error_lines[0].startswith("gradckpt: error:")
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = run_gradckpt("demo", "--quick", "--device", "tpu", "--debug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr
