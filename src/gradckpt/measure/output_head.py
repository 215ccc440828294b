"""The output head as its own item of the plan: the step measured again with its loss in chunks.

A model whose loss runs through ``gradckpt.linear_cross_entropy`` (a Hugging Face causal
language model given ``labels`` does, through ``integrations.hf_head``) says so while the step
is recorded (``heads_called``). ``measure_chunked_head`` then runs the step with that head in
chunks, for a few chunk counts (``chunk_counts``: the most, as many as ``default_head_chunks``
says for the sample's shapes, and a quarter and a sixteenth of that), and measures what a plan
choosing one needs to know:

1. that it computes the model's own loss: the plain and the chunked step run from the same RNG
   state and buffers, and their losses must agree within float rounding; otherwise the model
   does something to its logits the chunked loss does not repeat, and no chunked head is
   offered (on fake tensors, under ``estimate``, there are no values to compare);
2. its memory for each chunk count, phase by phase (``StepMemory``), with the previous step's
   output as a loop holding the chunked step's output has it;
3. its extra time: the head's part of the step (from the chain's output to its gradient),
   plain and with the fewest and the most chunks, timed in alternating steps (the median
   difference); in between, in proportion to the chunk count (each chunk adds the same).

``profile`` turns the memory into the chunked step's profile with the same code as the plain
one's and keeps what differs as ``Profile.chunked_head``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine import AUTO, first_tensor, head_chunks_forced
from . import clock
from .model_state import buffers_and_rng_preserved
from .step_memory import StepMemory

__all__ = ["HeadMeasurement", "chunk_counts", "head_to_chunk", "measure_chunked_head"]

# How far the chunked loss may be from the plain one, relative: the sum's order changes
# (float32: measured ~1e-7), and half-precision logits round per chunk as they do whole.
_LOSS_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
_HALF_TOLERANCE = 2e-3


@dataclass
class HeadMeasurement:
    """The chunked step, measured: the head's name and chunk count, its memory phase by phase,
    the previous step's output it starts with, and how much longer the head takes than plain
    (seconds)."""

    name: str
    chunks: int
    memory: StepMemory
    previous_output_bytes: int
    extra_seconds: float


def head_to_chunk(model: nn.Module, heads: list[nn.Module]) -> tuple[str, nn.Module] | str:
    """The head (qualified name, module) whose loss the recorded step could compute in chunks,
    or why there is none."""
    if not heads:
        return ("the loss does not run through gradckpt.linear_cross_entropy (a Hugging Face "
                "causal language model's does, given labels)")
    names = {id(module): name for name, module in model.named_modules()}
    if id(heads[0]) not in names:
        return "the loss's output head is not a module of the model"
    return names[id(heads[0])], heads[0]


def chunk_counts(most: int) -> list[int]:
    """The chunk counts measured, fewest first: ``most``, a quarter and a sixteenth of it, at
    least 2.

    Example:
        >>> chunk_counts(256), chunk_counts(8), chunk_counts(2)
        ([16, 64, 256], [2, 8], [2])
    """
    return sorted({max(2, most // 16), max(2, most // 4), most})


def measure_chunked_head(
    model: nn.Module,
    head: tuple[str, nn.Module],
    step: Callable[[], torch.Tensor],
    output_bytes: Callable[[], int],
    tracked: Callable[[], list[Any]],
    chain: tuple[nn.Module, nn.Module],
    device: torch.device,
    repeats: int,
    expect: Callable[[int], None] = lambda more_steps: None,
) -> list[HeadMeasurement] | str:
    """Measure the step ``step`` runs with ``head`` in chunks (see the module), for each of
    ``chunk_counts``, or say why it cannot be offered. ``step()`` runs one training step and
    returns its loss; ``output_bytes()`` is the size of the output the loop holds from the last
    step; ``tracked()`` what exists before a step (the model, the sample, that output), for
    the meter; ``chain`` the chain's first and last block. After the 2 steps of the check,
    ``expect(n)`` is told how many steps follow (for a progress bar)."""
    name, module = head
    # Copies: the loss itself is the output's, which the next step must find unreferenced.
    with buffers_and_rng_preserved(model):
        plain_loss = step().clone()
    with head_chunks_forced(module, AUTO) as used:
        chunked_loss = step().clone()  # from the same RNG state and buffers
    if used["chunks"] < 2:
        return "the sample has too few tokens to cut the head's loss into chunks"
    if not clock.modeled() and not _agree(plain_loss, chunked_loss, module):
        return (f"the loss computed in chunks ({chunked_loss.item():.6g}) is not the model's own "
                f"({plain_loss.item():.6g}): the model changes its logits in a way "
                "gradckpt.linear_cross_entropy does not repeat")
    counts = chunk_counts(used["chunks"])
    rounds = 1 if clock.modeled() else repeats  # a modeled clock times every round alike
    expect(len(counts) + rounds * (1 + len({counts[0], counts[-1]})))
    memories = {}
    for chunks in counts:
        with head_chunks_forced(module, chunks):
            previous_output_bytes = output_bytes()  # the chunked step's, held by the loop
            model.zero_grad(set_to_none=True)  # the memory at the start has no gradients
            memory = StepMemory(*chain, device)
            memory.measure(step, tracked())
            memories[chunks] = (memory, previous_output_bytes)
    extra = _extra_seconds(module, step, chain[1], device, rounds, counts[0], counts[-1])
    return [HeadMeasurement(name, chunks, *memories[chunks], extra(chunks))
            for chunks in counts]


def _extra_seconds(
    head: nn.Module, step: Callable[[], Any], last: nn.Module, device: torch.device,
    rounds: int, fewest: int, most: int,
) -> Callable[[int], float]:
    """The head's extra seconds with the fewest and the most chunks, timed in ``rounds``
    rounds of plain, fewest, most; in between, in proportion to the chunk count."""
    times: dict[int, list[float]] = {fewest: [], most: []}
    with _HeadPhaseTimer(last, device) as timer:
        for _ in range(rounds):
            plain = timer.time(step)
            for chunks in times:
                with head_chunks_forced(head, chunks):
                    times[chunks].append(timer.time(step) - plain)
    low, high = (max(0.0, statistics.median(times[chunks])) for chunks in (fewest, most))

    def extra(chunks: int) -> float:
        if most == fewest:
            return high
        return low + (high - low) * (chunks - fewest) / (most - fewest)

    return extra


def _agree(plain: torch.Tensor, chunked: torch.Tensor, head: nn.Module) -> bool:
    parameter = next(head.parameters(), None)
    dtype = parameter.dtype if parameter is not None else torch.float32
    tolerance = _LOSS_TOLERANCE.get(dtype, _HALF_TOLERANCE)
    difference = abs(float(plain) - float(chunked))
    return difference <= tolerance * max(1.0, abs(float(plain)))


class _HeadPhaseTimer:
    """Times the part of a step from the chain's output (the last block's forward returns)
    to its gradient (the head's and the loss's forward and backward)."""

    def __init__(self, last: nn.Module, device: torch.device) -> None:
        self.last, self.device = last, device
        self._start: float | None = None
        self._seconds: float | None = None
        self._hook: Any = None

    def __enter__(self) -> _HeadPhaseTimer:
        self._hook = self.last.register_forward_hook(self._chain_ends)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()

    def time(self, step: Callable[[], Any]) -> float:
        self._start = self._seconds = None
        step()
        return self._seconds or 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return clock.now()

    def _chain_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        hidden = first_tensor(output)
        if self._start is None and hidden is not None and hidden.requires_grad:
            self._start = self._now()
            hidden.register_hook(self._gradient_arrives)

    def _gradient_arrives(self, gradient: torch.Tensor) -> None:
        if self._start is not None and self._seconds is None:
            self._seconds = self._now() - self._start
