"""The chunked head's middle chunks stood in: a step with its loss in chunks traced with a few.

A head whose loss runs in chunks (``engine.linear_cross_entropy``) runs ``count`` checkpointed
chunks one after another, each on its own slice of the hidden states, all of one size but the
last, which may be shorter. On fake tensors (``estimate``) every chunk costs as much to trace
(Llama-3-8B at 8k tokens: 64 chunks, each forward and again in backward), and the chunks in the
middle do the same work on slices of the same shape. As the chain's identical blocks
(``stand_ins``), they are measured once and stood in for:

1. While a metered step runs (``ChunkStandIns`` around it), the chunks ``KEPT`` to ``count - 2``
   compute nothing: a chunk's loss is an empty scalar, and in backward its slice's gradient an
   empty tensor of the slice's shape. So each holds between its neighbours what a chunk holds
   (its loss until the next chunk's, its slice's gradient until the slices' gradients are
   joined), and what comes after runs as with every chunk computed. Each chunk's forward start
   and the start of its backward (its loss's gradient arriving) are read off the step's meter:
   the operations so far, the bytes allocated, the clock.
2. The first chunks differ (the first chunk's loss is the running sum; the second frees it), so
   the middle's stretches are chunk ``KEPT - 1``'s, its forward (from its start to the next
   chunk's) and its backward (from its loss's gradient to the previous chunk's), checked equal
   to chunk ``KEPT - 2``'s operation by operation (the bytes after each, the seconds).
3. ``head_stretch`` puts a copy of the middle's stretches in place of each stand-in's, which
   must leave the bytes the middle's leave: the step's stretch is then what tracing every chunk
   gives, the total after each operation, the peak, the operations and the seconds (exact sums,
   ``clock.Seconds``).

Where that does not hold (the chunks ran out of turn, the middles differ, a stand-in left other
bytes, nothing put the chunks back), ``ChunksNotSpliceable`` says why and ``output_head``
meters the step again with every chunk traced. The tests hold every field of an estimate so
made equal to one that traced every chunk (``test_measure_stand_ins``).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine import head_chunk_calls
from ..errors import GradckptError
from . import clock
from .meter import MemoryMeter, running_meter
from .step_memory import Mark, StepMemory

__all__ = ["KEPT", "ChunkStandIns", "ChunksNotSpliceable", "Stretch", "head_stretch"]

KEPT = 4
"""Chunks computed from the first: two that differ from the rest, two middles to compare; the
last is computed too."""


class ChunksNotSpliceable(GradckptError):
    """The step with chunks standing in does not add up to the one with every chunk: meter it
    again with every chunk traced."""


@dataclass(frozen=True)
class Stretch:
    """A stretch of a metered step, relative to where it starts: the bytes it leaves, the most
    above its start, its seconds and operations, and the total after each operation."""

    bytes: int
    rise: int
    seconds: float
    operations: int
    trace: list[int]


@dataclass(frozen=True)
class _Reading:
    operations: int
    current: int
    seconds: float


class _Chunks:
    """One chunked loss as a metered step ran it: a reading at each chunk's forward start, in
    order, and at each one's backward start, in the order they came."""

    def __init__(self, meter: MemoryMeter, count: int) -> None:
        self._meter = weakref.ref(meter)
        self.trace = meter.trace  # the step's (``StepMemory.trace``): whose readings these are
        self.count = count
        self.forward: list[_Reading] = []
        self.backward: list[tuple[int, _Reading]] = []

    def read(self) -> _Reading | None:
        meter = self._meter()
        if meter is None:
            return None
        return _Reading(meter.operations, meter.current(), clock.now())

    def backward_starts(self, index: int, gradient: torch.Tensor) -> None:
        reading = self.read()
        if reading is not None:
            self.backward.append((index, reading))


class ChunkStandIns:
    """Within the block, on this thread, a metered step (a ``MemoryMeter`` keeping its trace,
    on a modeled clock) with ``head``'s loss in more than ``KEPT + 1`` chunks computes the
    first ``KEPT`` and the last, and the others stand in (see the module). ``head_stretch``
    puts them back; ``taken`` are those it has not; ``with_put_back(seconds)`` is ``seconds``
    of the step's head plus what putting them back added."""

    def __init__(self, head: nn.Module) -> None:
        self._calls = head_chunk_calls(head, self._chunk)
        self._running: _Chunks | None = None
        self.taken: list[_Chunks] = []
        self.put_back: list[float] = []  # the seconds each record put back added

    def __enter__(self) -> ChunkStandIns:
        self._calls.__enter__()
        _active.stand_ins.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.stand_ins.remove(self)
        self._running = None
        self._calls.__exit__(*exc)

    def with_put_back(self, seconds: float) -> float:
        for added in self.put_back:  # Seconds with Seconds: exact
            seconds = seconds + added
        return seconds

    def _chunk(self, index: int, count: int, hidden_chunk: torch.Tensor,
               compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if index == 0:
            self._running = self._chunks(count, hidden_chunk)
        chunks = self._running
        if chunks is None:
            return compute()
        reading = chunks.read()
        assert reading is not None  # the meter runs the step
        chunks.forward.append(reading)
        part = _StandingIn.apply(hidden_chunk) if KEPT <= index < count - 1 else compute()
        part.register_hook(functools.partial(chunks.backward_starts, index))
        return part

    def _chunks(self, count: int, hidden_chunk: torch.Tensor) -> _Chunks | None:
        """Where chunks stand in, the record of this chunked loss; else None."""
        meter = running_meter()
        if (count < KEPT + 2 or meter is None or meter.trace is None or not clock.modeled()
                or not torch.is_grad_enabled() or not hidden_chunk.requires_grad):
            return None
        chunks = _Chunks(meter, count)
        self.taken.append(chunks)
        return chunks


class _Active(threading.local):
    def __init__(self) -> None:
        self.stand_ins: list[ChunkStandIns] = []


_active = _Active()


class _StandingIn(torch.autograd.Function):
    """A chunk that computes nothing: an empty loss, and in backward an empty gradient of its
    slice's shape (the one a chunk's gradient has), held as a chunk's is."""

    @staticmethod
    def forward(ctx: Any, hidden_chunk: torch.Tensor) -> torch.Tensor:
        ctx.slice = (hidden_chunk.shape, hidden_chunk.dtype, hidden_chunk.device)
        return torch.empty((), dtype=torch.float32, device=hidden_chunk.device)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        shape, dtype, device = ctx.slice
        return torch.empty(shape, dtype=dtype, device=device)


def head_stretch(run: StepMemory, starts: Mark, ends: Mark) -> Stretch:
    """The stretch of ``run`` (a marked step) from ``starts`` to ``ends``, two marks in a row,
    with the chunks that stood in during it put back (see the module).

    Raises ``ChunksNotSpliceable`` where they do not add up."""
    traced = Stretch(ends.current - starts.current, ends.peak - starts.current,
                     ends.seconds - starts.seconds, ends.operations - starts.operations,
                     [total - starts.current
                      for total in run.trace[starts.operations:ends.operations]])
    stand_ins = _active.stand_ins[-1] if _active.stand_ins else None
    if stand_ins is None:
        return traced
    mine = [chunks for chunks in stand_ins.taken if chunks.trace is run.trace]
    if not mine:
        return traced
    stand_ins.taken = [chunks for chunks in stand_ins.taken if chunks.trace is not run.trace]
    if len(mine) > 1:
        raise ChunksNotSpliceable("the step computed its loss in chunks more than once")
    stretch = _put_back(mine[0], run.trace, starts, ends)
    stand_ins.put_back.append(stretch.seconds - traced.seconds)
    return stretch


def _put_back(chunks: _Chunks, trace: list[int], starts: Mark, ends: Mark) -> Stretch:
    """The stretch from ``starts`` to ``ends`` with a middle chunk's stretches, forward and
    backward, in place of the stand-ins'."""
    count, forward = chunks.count, chunks.forward
    if (len(forward) != count or [index for index, _ in chunks.backward]
            != list(range(count - 1, -1, -1))):
        raise ChunksNotSpliceable("the chunks did not run forward and then backward in turn")
    backward = dict(chunks.backward)
    operations = [starts.operations, *(reading.operations for reading in forward),
                  *(reading.operations for _, reading in chunks.backward), ends.operations]
    if operations != sorted(operations):
        raise ChunksNotSpliceable("the chunks ran outside the stretch")
    stretch = trace[starts.operations:ends.operations]
    if ends.peak != max(starts.current, *stretch, ends.current):
        raise ChunksNotSpliceable("the stretch's peak is not its totals'")

    def between(first: _Reading, last: _Reading) -> tuple:
        seconds = last.seconds - first.seconds
        return (last.current - first.current, last.operations - first.operations,
                seconds, getattr(seconds, "ticks", seconds),  # compared exactly
                tuple(total - first.current
                      for total in trace[first.operations:last.operations]))

    # The middle's forward runs from its start to the next one's; its backward from its loss's
    # gradient to the previous chunk's (backward runs the chunks last first).
    middle_forward = between(forward[KEPT - 1], forward[KEPT])
    middle_backward = between(backward[KEPT - 1], backward[KEPT - 2])
    if (between(forward[KEPT - 2], forward[KEPT - 1]) != middle_forward
            or between(backward[KEPT - 2], backward[KEPT - 3]) != middle_backward):
        raise ChunksNotSpliceable("the middle chunks differ")
    standing_in = range(KEPT, count - 1)
    if any(forward[index + 1].current - forward[index].current != middle_forward[0]
           or backward[index - 1].current - backward[index].current != middle_backward[0]
           for index in standing_in):
        raise ChunksNotSpliceable("a chunk standing in holds other bytes than a chunk")

    # The totals: the stand-ins' forwards (from the first's start to the last chunk's) and
    # backwards (from the last stand-in's to chunk KEPT - 1's) replaced by the middle's,
    # each from where the stand-in started.
    forward_totals, backward_totals = middle_forward[4], middle_backward[4]
    totals = trace[starts.operations:forward[KEPT].operations]
    for index in standing_in:
        totals += [forward[index].current + total for total in forward_totals]
    totals += trace[forward[count - 1].operations:backward[count - 2].operations]
    for index in reversed(standing_in):
        totals += [backward[index].current + total for total in backward_totals]
    totals += trace[backward[KEPT - 1].operations:ends.operations]

    added = len(standing_in)
    seconds = (ends.seconds - starts.seconds
               - (forward[count - 1].seconds - forward[KEPT].seconds)
               - (backward[KEPT - 1].seconds - backward[count - 2].seconds)
               + middle_forward[2] * added + middle_backward[2] * added)
    return Stretch(ends.current - starts.current,
                   max(starts.current, *totals, ends.current) - starts.current, seconds,
                   len(totals), [total - starts.current for total in totals])
