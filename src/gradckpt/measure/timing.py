"""Timing: each block's forward inside real training steps, and its other times as multiples of
its forward timed moments apart.

``profile`` times the whole step and, separately, each block re-run on its own. On a shared
machine the pace drifts by 10-20% over seconds, so a block timed on its own at one moment and
the step timed at another disagree by that much, and so does every predicted extra time (a
ratio of the two). Timed inside the same steps, a block's forward and the step move together
(``BlockForwardTimer``); the block's backward and what checkpointing adds are kept as ratios to
its forward timed in the same round (``interleaved_seconds``, ``TimeRatios``), pooled over
identical blocks (``pooled_times``), and put at the step's pace by its forward in the step.

These are the parts of one profile, on the clock ``gradckpt.predict`` can model. Comparing whole
training steps under several plans is another job: ``gradckpt.side_by_side``.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..profile_types import BlockProfile
from . import clock
from .recording import BlockCall

__all__ = [
    "BlockForwardTimer",
    "TimeRatios",
    "pooled_times",
    "block_kind",
    "interleaved_seconds",
    "median_seconds",
]


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
        return clock.now()

    def _start(self, index: int, module: nn.Module, args: tuple) -> None:
        if self._marks is not None and index not in self._marks:
            self._marks[index] = [self._mark(), None]

    def _stop(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self._marks is not None and self._marks.get(index, [None, 0])[1] is None:
            self._marks[index][1] = self._mark()


@dataclass
class TimeRatios:
    """Per round, a block's backward and what checkpointing it adds (plain, under the policy),
    each over its forward timed in the same round."""

    backward: list[float]
    checkpointed: list[float]
    policy: list[float]

    @classmethod
    def of(cls, forward: list[float], backward: list[float], checkpointed: list[float],
           policy: list[float]) -> TimeRatios:
        """From ``interleaved_seconds``: forward times, then each other run minus forward."""
        rounds = [i for i, seconds in enumerate(forward) if seconds > 0]
        # Never below zero: a checkpointed run faster than the plain block is timing noise.
        return cls(
            [max(backward[i], 0.0) / forward[i] for i in rounds],
            [max(checkpointed[i] - backward[i], 0.0) / forward[i] for i in rounds],
            [max(policy[i] - backward[i], 0.0) / forward[i] for i in rounds],
        )

    def median(self, name: str) -> float:
        values = getattr(self, name)
        if not values:
            return 0.0
        middle = statistics.median(values)
        if name == "checkpointed" and middle == 0.0:
            # A recomputation reruns the forward: a median at zero says the rounds' noise
            # outweighed it (a loaded machine: the demo's 100-block chain read "+0.00 forward
            # passes" for every strategy), and the forward's own time is the better reading.
            return 1.0
        return middle

    def pooled(self, others: list[TimeRatios]) -> TimeRatios:
        return TimeRatios(*([v for r in [self, *others] for v in getattr(r, name)]
                             for name in ("backward", "checkpointed", "policy")))


def pooled_times(
    blocks: list[BlockProfile], ratios: list[TimeRatios], kinds: list[Any]
) -> list[BlockProfile]:
    """Blocks that compute the same thing (``block_kind``) share one estimate of each ratio: the
    median over all their rounds, steadier than each block's few (8 identical layers measured
    3 rounds each: 24 samples, not 3). Each keeps its own forward, timed in the step."""
    by_kind: dict[Any, list[TimeRatios]] = {}
    for kind, ratio in zip(kinds, ratios, strict=True):
        by_kind.setdefault(kind, []).append(ratio)
    pooled = {kind: group[0].pooled(group[1:]) for kind, group in by_kind.items()}
    return [
        replace(
            block,
            backward_seconds=pooled[kind].median("backward") * block.forward_seconds,
            checkpointed_extra_seconds=pooled[kind].median("checkpointed") * block.forward_seconds,
            policy_extra_seconds=pooled[kind].median("policy") * block.forward_seconds,
        )
        for block, kind in zip(blocks, kinds, strict=True)
    ]


def block_kind(module: nn.Module, call: BlockCall) -> tuple:
    """What makes two blocks compute the same: class, parameter shapes, argument shapes and
    the non-tensor arguments."""
    return (
        type(module).__qualname__,
        tuple((tuple(p.shape), p.dtype) for p in module.parameters()),
        tuple((tuple(leaf.shape), leaf.dtype, leaf.requires_grad) if isinstance(leaf, torch.Tensor)
              else repr(leaf) for leaf in call.leaves),
        str(call.spec),
        module.training,
    )


def interleaved_seconds(
    fns: list[Callable[[], Any]], repeats: int, device: torch.device
) -> tuple[list[float], ...]:
    """The first function's times, then each other one's time minus the first's in the same
    round: ``repeats`` rounds running each function once, in turn."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, slot in zip(fns, times, strict=True):
            slot.append(median_seconds(fn, 1, device))
    first = times[0]
    return first, *([t - f for t, f in zip(other, first, strict=True)] for other in times[1:])


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """The median of ``repeats`` runs of ``fn``, in seconds; on CUDA the device is synchronised
    around each run, so that the time includes the kernels it launched."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock.now()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock.now() - start)
    return statistics.median(times)
