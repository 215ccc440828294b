"""Timing each block's forward pass inside real training steps.

``profile`` times the whole step and, separately, each block re-run on its own. On a shared
machine the pace drifts by 10-20% over seconds, so a block timed on its own at one moment and
the step timed at another disagree by that much, and so does every predicted extra time (a
ratio of the two). Timed inside the same steps, a block's forward and the step move together.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["BlockForwardTimer"]


class BlockForwardTimer:
    """The forward time of each block in each step between ``begin_step`` and ``end_step``.

    Only a block's first call in a step counts (``profile`` re-runs a block's first call on its
    own too); calls outside a step (backward's recomputation, if the model checkpoints itself)
    do not. On CUDA the times come from CUDA events, read once the step is done.

    Example:
        >>> import torch
        >>> blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> with BlockForwardTimer(blocks, torch.device("cpu")) as timer:
        ...     for _ in range(3):
        ...         timer.begin_step()
        ...         _ = blocks(torch.randn(2, 4))
        ...         timer.end_step()
        >>> [len(times) for times in timer.steps]
        [2, 2, 2]
        >>> all(seconds > 0 for seconds in timer.median_seconds())
        True
    """

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device) -> None:
        self.blocks = list(blocks)
        self.cuda = device.type == "cuda"
        self.steps: list[dict[int, float]] = []  # per step: block index -> seconds
        self._marks: dict[int, list[Any]] | None = None  # this step: index -> [start, end]
        self._hooks: list[Any] = []

    def __enter__(self) -> BlockForwardTimer:
        for index, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(
                functools.partial(self._start, index)))
            self._hooks.append(block.register_forward_hook(
                functools.partial(self._stop, index)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._marks = None

    def begin_step(self) -> None:
        self._marks = {}

    def end_step(self) -> None:
        marks, self._marks = self._marks, None
        if marks is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
            seconds = {i: start.elapsed_time(end) / 1000 for i, (start, end) in marks.items()
                       if end is not None}
        else:
            seconds = {i: end - start for i, (start, end) in marks.items() if end is not None}
        self.steps.append(seconds)

    def median_seconds(self) -> list[float | None]:
        """Per block, the median over the steps that ran it (None: no step did)."""
        medians: list[float | None] = []
        for index in range(len(self.blocks)):
            times = [step[index] for step in self.steps if index in step]
            medians.append(statistics.median(times) if times else None)
        return medians

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, index: int, module: nn.Module, args: tuple) -> None:
        if self._marks is not None and index not in self._marks:
            self._marks[index] = [self._mark(), None]

    def _stop(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self._marks is not None and self._marks.get(index, [None, 0])[1] is None:
            self._marks[index][1] = self._mark()
