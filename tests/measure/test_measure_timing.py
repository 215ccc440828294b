"""``gradckpt.measure.timing.BlockForwardTimer``: which calls it times, and that it leaves no
hooks."""

from __future__ import annotations

import time

import torch
from torch import nn

from gradckpt.measure.timing import BlockForwardTimer

CPU = torch.device("cpu")


class Sleeper(nn.Module):
    """Sleeps a known time in forward: a lower bound for what the timer must report."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def test_each_step_times_each_blocks_first_call_only() -> None:
    shared, other = Sleeper(0.0), Sleeper(0.02)
    x = torch.randn(3, 2)
    with BlockForwardTimer([shared, other], CPU) as timer:
        shared(x)  # outside a step: not counted
        for _ in range(3):
            timer.begin_step()
            other(shared(shared(x)))  # shared runs twice: its first call counts
            timer.end_step()
    assert len(timer.steps) == 3
    assert all(set(step) == {0, 1} for step in timer.steps)
    shared_seconds, other_seconds = timer.median_seconds()
    assert other_seconds >= 0.02  # slept that long inside the call
    assert shared_seconds < 0.02  # one call of a tiny Linear, not the sleeper's


def test_a_block_no_step_ran_has_no_time() -> None:
    ran, idle = nn.Linear(2, 2), nn.Linear(2, 2)
    with BlockForwardTimer([ran, idle], CPU) as timer:
        timer.begin_step()
        ran(torch.randn(1, 2))
        timer.end_step()
    first, second = timer.median_seconds()
    assert first is not None and first > 0
    assert second is None


def test_the_hooks_are_gone_afterwards() -> None:
    block = nn.Linear(2, 2)
    with BlockForwardTimer([block], CPU):
        assert block._forward_pre_hooks and block._forward_hooks
    assert not block._forward_pre_hooks and not block._forward_hooks
