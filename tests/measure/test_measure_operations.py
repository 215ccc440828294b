"""``gradckpt.measure.operations.operations_of``: how many times it runs a block's forward to
time its operations (``MENU_TIMING_RUNS`` at most, no run started once ``MENU_TIMING_SECONDS``
are spent, ``MENU_TIMING_MIN_RUNS`` at least). Runs are counted, never timed: a block that
sleeps has taken at least its sleep, whatever the machine's load."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from gradckpt.measure import operations
from gradckpt.measure.recording import BlockCall

pytestmark = pytest.mark.usefixtures("one_thread")


class Sleeper(nn.Module):
    """A layer that sleeps ``seconds`` in its forward, and counts its forwards."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(4, 4)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        time.sleep(self.seconds)
        return torch.relu(self.linear(x))


def _forwards_made(block: Sleeper, runs: int) -> tuple[int, operations.Operations]:
    call = BlockCall((torch.randn(3, 4, requires_grad=True),), {})
    measured = operations.operations_of(block, call, {}, runs=runs)
    return block.forwards, measured


def test_a_slow_block_stops_at_the_least_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each forward sleeps past the cap: after the least runs, no more are started.
    monkeypatch.setattr(operations, "MENU_TIMING_SECONDS", 0.03)
    forwards, measured = _forwards_made(Sleeper(0.03), operations.MENU_TIMING_RUNS)
    assert forwards == operations.MENU_TIMING_MIN_RUNS
    assert operations.MENU_TIMING_MIN_RUNS < operations.MENU_TIMING_RUNS
    assert set(measured.time_share) >= {"aten.addmm", "aten.relu"}
    assert sum(measured.time_share.values()) == pytest.approx(1.0)


def test_runs_bounded_by_the_time_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 ms a forward and 50 ms to spend: the sixth run starts 50 ms or more after the first,
    # so no more than 6 are made, however slow the machine.
    monkeypatch.setattr(operations, "MENU_TIMING_SECONDS", 0.05)
    forwards, _ = _forwards_made(Sleeper(0.01), operations.MENU_TIMING_RUNS)
    assert operations.MENU_TIMING_MIN_RUNS <= forwards <= 6


def test_a_fast_block_makes_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(operations, "MENU_TIMING_SECONDS", float("inf"))
    forwards, _ = _forwards_made(Sleeper(0.0), operations.MENU_TIMING_RUNS)
    assert forwards == operations.MENU_TIMING_RUNS


@pytest.mark.parametrize("runs", [1, 2])
def test_fewer_runs_asked_than_the_least_are_all_made(
    monkeypatch: pytest.MonkeyPatch, runs: int
) -> None:
    monkeypatch.setattr(operations, "MENU_TIMING_SECONDS", 0.0)
    forwards, _ = _forwards_made(Sleeper(0.0), runs)
    assert forwards == runs
