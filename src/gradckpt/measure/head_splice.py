"""A step whose output head alone differs from one metered, metered without its chain.

On fake tensors with blocks standing in (``stand_ins``), the plain step is metered with its
kept blocks marked. The steps with the output head's loss in chunks (``output_head``) differ
from it only from the chain's output to its gradient: before that the same operations run
(only the previous step's output, held until the model's forward returns, may be of another
size), and after it the chain's backward runs the same operations on what the head left. So
such a step runs with the first block alone (``StandIns.first_alone``: the kept blocks after
it stand in too), and ``head_replaced`` puts its head's stretch, from the chain's output to
the gradient of it, in place of the plain step's:

1. before the head: the plain step's marks and totals, shifted by the difference between the
   two steps' memory at their start (the previous outputs);
2. the head's stretch, operation by operation as the run has it, from where the plain step's
   head started (so shifted);
3. after it: the plain step's, shifted by the difference in what the two heads left (the
   step's output, the head's gradients), in bytes, seconds and operations.

The result is the marked step of the kept blocks that the chunked head would meter, which
``splice`` turns into the whole chain's as it does the plain one's. The head's stretch is the
same in both runs because the head reads a hidden state of the same shape and lets go of the
same things (the previous output, what the model's forward made before the chain). Checked:
both steps' marks have one head stretch, from the chain's output to its gradient, and the
stretch before the chain is the same; the tests hold every field of an estimate made so equal
to one whose chunked steps ran every kept block (``test_measure_stand_ins``).

Each chunked step so traces one block instead of ``KEPT`` (``stand_ins``), and of the head's
chunks the first few and the last: the run's stretch comes with the middle chunks that stood in
during it put back (``chunk_stand_ins.head_stretch``).
"""

from __future__ import annotations

from dataclasses import replace

from .chunk_stand_ins import head_stretch
from .stand_ins import NotSpliceable
from .step_memory import Mark, StepMemory

__all__ = ["head_replaced"]


def head_replaced(plain: StepMemory, run: StepMemory) -> tuple[StepMemory, float]:
    """``plain`` (a marked step) with its head's stretch taken from ``run`` (the same step with
    another head, run with fewer blocks and marked), and the seconds that adds to ``plain``'s.
    Raises ``NotSpliceable`` where the marks do not show one head stretch in each."""
    plain_head, plain_gradient = _head_stretch(plain)
    run_head, run_gradient = _head_stretch(run)
    first, run_first = plain.marks[0], run.marks[0]
    if (first.what, first.peak - plain.start, first.current - plain.start, first.operations) != (
            run_first.what, run_first.peak - run.start, run_first.current - run.start,
            run_first.operations):
        raise NotSpliceable("the steps differ before the chain")

    start_change = run.start - plain.start  # the previous outputs
    head_start = plain.marks[plain_head].current + start_change
    # The run's, with the chunks that stood in during it put back (``chunk_stand_ins``).
    stretch = head_stretch(run, run.marks[run_head], run.marks[run_gradient])
    before = plain.marks[plain_head]
    gradient = Mark("backward", None, "head", head_start + stretch.bytes,
                    head_start + stretch.rise, before.seconds + stretch.seconds,
                    before.operations + stretch.operations)
    replaced = plain.marks[plain_gradient]
    after_change = gradient.current - replaced.current
    seconds_change = gradient.seconds - replaced.seconds
    operations_change = gradient.operations - replaced.operations

    whole = StepMemory(plain.first, plain.last, plain.device, marked=plain.marked)
    whole.keep_before_chain(plain)
    whole.marks = [
        *(_shifted(mark, start_change) for mark in plain.marks[:plain_head + 1]),
        gradient,
        *(_shifted(mark, after_change, seconds_change, operations_change)
          for mark in plain.marks[plain_gradient + 1:]),
    ]
    whole.trace = [
        *(total + start_change for total in plain.trace[:before.operations]),
        *(head_start + total for total in stretch.trace),
        *(total + after_change for total in plain.trace[replaced.operations:]),
    ]
    for mark in whole.marks:
        whole.highest[mark.phase] = max(whole.highest[mark.phase], mark.peak)
    whole.start = plain.start + start_change
    if plain.chain_forward_start:
        whole.chain_forward_start = plain.chain_forward_start + start_change
    whole.chain_backward_start = plain.chain_backward_start + after_change
    if plain.chain_backward_end:
        whole.chain_backward_end = plain.chain_backward_end + after_change
    whole.end = plain.end + after_change
    whole.peak = max(whole.highest.values())
    return whole, seconds_change


def _head_stretch(memory: StepMemory) -> tuple[int, int]:
    """The indices of the marks where the chain's output comes and where its gradient does,
    which must follow one another."""
    at = {(mark.what, mark.block): index for index, mark in enumerate(memory.marks)}
    head, gradient = at.get(("head", None)), at.get(("backward", None))
    if head is None or gradient != head + 1 or len(memory.trace) != memory.marks[-1].operations:
        raise NotSpliceable("the head's stretch is not one from the chain's output to its "
                            "gradient")
    return head, gradient


def _shifted(mark: Mark, current: int, seconds: float | None = None,
             operations: int = 0) -> Mark:
    # Seconds left alone where unchanged: the clock's are exact (``clock.Seconds``) only in
    # sums of its own.
    return replace(mark, current=mark.current + current, peak=mark.peak + current,
                   seconds=mark.seconds if seconds is None else mark.seconds + seconds,
                   operations=mark.operations + operations)
