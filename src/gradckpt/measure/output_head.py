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
   output as a loop holding the chunked step's output has it (on fake tensors with the middle
   chunks standing in, ``chunk_stand_ins``);
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

from ..engine import AUTO, default_head_chunks, first_tensor, head_chunks_forced, vocabulary_size
from . import clock
from .chunk_stand_ins import ChunksNotSpliceable, ChunkStandIns
from .model_state import buffers_and_rng_preserved
from .step_memory import StepMemory

__all__ = ["HeadMeasurement", "HeadPhaseTimer", "PlainHead", "chunk_counts", "head_to_chunk",
           "measure_chunked_head"]

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
    metered: Callable[[], tuple[StepMemory, float]],
    last: nn.Module,
    device: torch.device,
    repeats: int,
    expect: Callable[[int], None] = lambda more_steps: None,
    plain: PlainHead | None = None,
    previous_step: Callable[[], torch.Tensor] | None = None,
) -> list[HeadMeasurement] | str:
    """Measure the step ``step`` runs with ``head`` in chunks (see the module), for each of
    ``chunk_counts``, or say why it cannot be offered. ``step()`` runs one training step and
    returns its loss; ``output_bytes()`` is the size of the output the loop holds from the last
    step; ``metered()`` runs a step under the meter and returns its ``StepMemory`` and
    seconds; ``last`` is the chain's last block. After the steps of the check, ``expect(n)``
    is told how many steps follow (for a progress bar).

    ``plain``: what the plain step, metered, showed of the head (on a modeled clock). On fake
    tensors there is no loss to check, every run is timed alike, and AUTO's chunk count
    follows from the head's input: the head's times are read in the metered steps, against
    the plain one's, and the steps run are the metered ones and the chunked step before the
    first (the last runs as AUTO, and must have taken the count worked out). That step's
    output alone counts: it runs as ``previous_step`` (``step`` where None)."""
    name, module = head
    if plain is not None:
        most = plain.auto_chunks(module)
        if most < 2:
            return "the sample has too few tokens to cut the head's loss into chunks"
        counts = chunk_counts(most)
        with head_chunks_forced(module, counts[0]):
            (previous_step or step)()  # the chunked step the first metered one follows
    else:
        # Copies: the loss itself is the output's, which the next step must find unreferenced.
        with buffers_and_rng_preserved(model):
            plain_loss = step().clone()
        with head_chunks_forced(module, AUTO) as used:
            chunked_loss = step().clone()  # from the same RNG state and buffers
        if used["chunks"] < 2:
            return "the sample has too few tokens to cut the head's loss into chunks"
        if not clock.modeled() and not _agree(plain_loss, chunked_loss, module):
            return (f"the loss computed in chunks ({chunked_loss.item():.6g}) is not the "
                    f"model's own ({plain_loss.item():.6g}): the model changes its logits in a "
                    "way gradckpt.linear_cross_entropy does not repeat")
        counts = chunk_counts(used["chunks"])
    fewest, most = counts[0], counts[-1]
    expect(len(counts) + (0 if plain is not None else repeats * (1 + len({fewest, most}))))
    memories = {}
    times: dict[int, list[float]] = {fewest: [], most: []}
    with HeadPhaseTimer(last, device) as timer:
        for chunks in counts:
            forced = AUTO if plain is not None and chunks == most else chunks
            with head_chunks_forced(module, forced) as used:
                previous_output_bytes = output_bytes()  # the chunked step's, held by the loop
                if plain is not None:
                    memory, head_seconds = _metered_standing_in(module, metered, timer, expect)
                else:
                    timer.reset()
                    memory, _ = metered()
            if used["chunks"] != chunks:  # AUTO took another count: measure as without ``plain``
                return measure_chunked_head(model, head, step, output_bytes, metered, last,
                                            device, repeats, expect)
            memories[chunks] = (memory, previous_output_bytes)
            if plain is not None and chunks in times:
                times[chunks].append(head_seconds - plain.seconds)
        if plain is None:
            _time_apart(module, step, timer, repeats, times)
    low, high = (max(0.0, statistics.median(times[chunks])) for chunks in (fewest, most))

    def extra(chunks: int) -> float:  # in proportion to the chunk count, in between
        if most == fewest:
            return high
        return low + (high - low) * (chunks - fewest) / (most - fewest)

    return [HeadMeasurement(name, chunks, *memories[chunks], extra(chunks))
            for chunks in counts]


def _metered_standing_in(
    head: nn.Module, metered: Callable[[], tuple[StepMemory, float]], timer: HeadPhaseTimer,
    expect: Callable[[int], None],
) -> tuple[StepMemory, float]:
    """``metered()``, the middle chunks of ``head``'s loss standing in (``chunk_stand_ins``),
    and the seconds of its head's part as with every chunk; metered again with every chunk
    where they were not put back or did not add up."""
    with ChunkStandIns(head) as stand_ins:
        timer.reset()
        try:
            memory, _ = metered()
            put_back = not stand_ins.taken
        except ChunksNotSpliceable:
            put_back = False
    if put_back:
        return memory, stand_ins.with_put_back(timer.seconds)
    expect(1)
    timer.reset()
    memory, _ = metered()
    return memory, timer.seconds


def _time_apart(
    head: nn.Module, step: Callable[[], Any], timer: HeadPhaseTimer, rounds: int,
    times: dict[int, list[float]],
) -> None:
    """The head's extra seconds with each chunk count in ``times``, timed in ``rounds`` rounds
    of plain, then each count, as a difference from plain in the same round."""
    for _ in range(rounds):
        timer.reset()
        step()
        plain = timer.seconds
        for chunks, seconds in times.items():
            with head_chunks_forced(head, chunks):
                timer.reset()
                step()
                seconds.append(timer.seconds - plain)


def _agree(plain: torch.Tensor, chunked: torch.Tensor, head: nn.Module) -> bool:
    parameter = next(head.parameters(), None)
    dtype = parameter.dtype if parameter is not None else torch.float32
    tolerance = _LOSS_TOLERANCE.get(dtype, _HALF_TOLERANCE)
    difference = abs(float(plain) - float(chunked))
    return difference <= tolerance * max(1.0, abs(float(plain)))


class HeadPhaseTimer:
    """Times the part of a step from the chain's output (the last block's forward returns)
    to its gradient (the head's and the loss's forward and backward): ``seconds``, of the step
    since ``reset()`` (a block run again in backward, by a model checkpointing itself, starts
    nothing).

    Example:
        >>> import torch
        >>> chain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> with HeadPhaseTimer(chain[0], torch.device("cpu")) as timer:
        ...     chain(torch.ones(2, 4)).sum().backward()
        >>> timer.seconds > 0
        True
    """

    def __init__(self, last: nn.Module, device: torch.device) -> None:
        self.last, self.device = last, device
        self._start: float | None = None
        self._seconds: float | None = None
        self._hook: Any = None

    def __enter__(self) -> HeadPhaseTimer:
        self._hook = self.last.register_forward_hook(self._chain_ends)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()

    @property
    def seconds(self) -> float:
        return self._seconds or 0.0

    def reset(self) -> None:
        self._start = self._seconds = None

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


class PlainHead(HeadPhaseTimer):
    """The plain step's head, watched while it runs (on a modeled clock): its phase's
    ``seconds``, and the hidden states it reads (``auto_chunks``).

    Example:
        >>> import torch
        >>> chain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 100))
        >>> with PlainHead(chain[0], chain[1], torch.device("cpu")) as plain:
        ...     chain(torch.ones(2, 6, 4)).sum().backward()
        >>> plain.auto_chunks(chain[1])  # 12 tokens, 100 fp32 logits each: 32 chunks at most
        12
    """

    def __init__(self, last: nn.Module, head: nn.Module | None, device: torch.device) -> None:
        super().__init__(last, device)
        self._head = head
        self._input: tuple[int, int, int] | None = None  # tokens, width, bytes per element
        self._head_hook: Any = None

    def __enter__(self) -> PlainHead:
        if self._head is not None:
            self._head_hook = self._head.register_forward_pre_hook(self._head_reads)
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: object) -> None:
        if self._head_hook is not None:
            self._head_hook.remove()
        super().__exit__(*exc)

    def auto_chunks(self, head: nn.Module) -> int:
        """The chunk count ``AUTO`` takes for the hidden states the head read (1: it read
        none that ``linear_cross_entropy`` could cut)."""
        if self._input is None:
            return 1
        tokens, width, element_bytes = self._input
        return default_head_chunks(tokens, vocabulary_size(head), width, element_bytes)

    def _head_reads(self, module: nn.Module, args: tuple) -> None:
        hidden = first_tensor(args)
        if self._input is None and hidden is not None and hidden.dim() and hidden.shape[-1]:
            self._input = (hidden.numel() // hidden.shape[-1], hidden.shape[-1],
                           hidden.element_size())
