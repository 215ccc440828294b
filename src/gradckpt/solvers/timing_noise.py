"""Plans are stable under timing noise: measured times that differ by less than the noise are
one time to the solvers.

A profile's times are measured on a machine whose pace moves. On a shared 2-core machine
under load, the demo's GPT profiled 11 times had its 8 identical layers' times up to 18%
under and 102% over their median within one profile, and the tests' tiny models (a layer's
forward about a millisecond) had identical layers 5-13 times apart, the slow ones caught by
the scheduler. A solver comparing those times exactly chooses between equal plans by that
noise: which of two identical layers to recompute, which of two policies of near-equal cost,
would change from one run to the next with the same model and sample.

So ``solve`` chooses on ``settle_times(profile)``, in which

- blocks doing the same forward work (the same input and output, the same operations making
  the same outputs: a transformer's identical layers; ``same_work_pooled``) are given the
  median of each of their times: what sets them apart is the machine, whatever its size;
- then blocks whose every time (forward, backward, matmuls, recomputation, policy, per
  operation, op-level shares) lies within ``TIME_NOISE_BAND`` of a block's are one kind of
  block: sorted by forward time, each block not yet grouped takes every later one within the
  band of its own times, and all of them get the group's mean times (memory stays each
  block's own);
- the chunked heads' extra seconds, and the options of a block's menu (``ChainCosts.menu``:
  ``"save-matmuls"``, op-level choices), are merged the same way (``merged_within_band``).

Plans that differ only by such times then cost the same. Where different options add up to
near-equal times, ``optimal``'s DP takes an option over the one offered before it only when it
is faster by more than the band (``memory_levels.Choices``, its ``tolerance``); of the plans
it checks exactly, the one of least peak among those within the band of the fastest wins
(memory is measured to the byte); and ``solve`` takes a later head choice only when faster by
more than the band. Ties go to the solvers' fixed order (``optimal``: a block kept before a
segment, a shorter segment before a longer one, the menu in its order, the plain head before
a chunked one, fewer chunks first). A difference beyond the band between blocks doing
different work, or between options, still changes the plan. The plan's predictions use the
profile's own times. docs/planning.md, "Plans are stable under timing noise", states the rule,
its price and the tests that hold it (tests/solvers/test_solvers_plan_stability.py,
tests/solvers/test_solvers_plan_stability_measured.py).

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> alike = [example_block(f"h.{i}", forward_seconds=s) for i, s in enumerate([1.0, 3.0, 1.2])]
    >>> [b.forward_seconds for b in settle_times(Profile(alike, 0, 0, 5.0)).blocks]
    [1.2, 1.2, 1.2]
    >>> other = example_block("h.3", forward_seconds=1.25, output_bytes=20)  # other work
    >>> [b.forward_seconds for b in settle_times(Profile([*alike, other], 0, 0, 5.0)).blocks]
    [1.2125, 1.2125, 1.2125, 1.2125]
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from ..profile_types import BlockProfile, Profile

__all__ = ["TIME_NOISE_BAND", "TIME_NOISE_NOTE", "same_work_pooled", "merged_within_band",
           "settle_times"]

# Two measured times closer than this (relative to the smaller) are the same time: the times of
# blocks doing different work, and of options (sums over blocks, policies). Identical blocks
# need no band (same_work_pooled). Steps vary by 5-15% on a shared 2-core machine; wider would
# merge real differences (a block 10% cheaper is worth recomputing first) and cost up to its
# width in time, and options as far apart as the noise sit at its edge whatever its width.
TIME_NOISE_BAND = 0.10
# The profile's note of the band its times were settled with, which ChainCosts' menus read.
TIME_NOISE_NOTE = "time_noise_band"

# A block's times that are one number each.
_BLOCK_SECONDS = ("forward_seconds", "backward_seconds", "matmul_seconds",
                  "policy_dispatch_seconds", "policy_extra_seconds",
                  "checkpointed_extra_seconds")


def merged_within_band(values: list[float], band: float = TIME_NOISE_BAND) -> list[float]:
    """``values`` with each group of values within ``band`` of the group's least (sorted, each
    group opening at the least value left) replaced by the group's mean, in the same order.

    Example:
        >>> merged_within_band([1.0, 3.0, 1.05, 3.2, 1.2])
        [1.025, 3.1, 1.025, 3.1, 1.2]
    """
    return _grouped_means(torch.tensor(values, dtype=torch.float64)[:, None], band)[:, 0].tolist()


def settle_times(profile: Profile, band: float = TIME_NOISE_BAND) -> Profile:
    """``profile`` as the solvers see it (see the module): blocks doing the same forward work
    given their median times (``same_work_pooled``), then blocks whose times are all within
    ``band`` of each other given their mean times, the chunked heads' extra seconds merged
    within ``band``, and ``notes[TIME_NOISE_NOTE]`` the band. Memory is left as it is.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", forward_seconds=1.0 + i / 100) for i in range(3)]
        >>> settled = settle_times(Profile(blocks, 0, 0, 5.0))
        >>> [round(b.forward_seconds, 6) for b in settled.blocks], settled.notes
        ([1.01, 1.01, 1.01], {'time_noise_band': 0.1})
    """
    if not band:
        return profile  # exact: nothing merged, and the menus as they are
    blocks = same_work_pooled(list(profile.blocks))
    kinds: dict[tuple, list[int]] = {}  # blocks with the same times measured, by what they are
    for index, block in enumerate(blocks):
        kinds.setdefault(_kind(block), []).append(index)
    for indices in kinds.values():
        times = torch.tensor([_times(blocks[i]) for i in indices], dtype=torch.float64)
        for i, settled in zip(indices, _grouped_means(times, band).tolist(), strict=True):
            blocks[i] = _with_times(blocks[i], settled)
    heads = profile.chunked_heads
    merged = merged_within_band([head.extra_seconds for head in heads], band)
    heads = [dataclasses.replace(head, extra_seconds=extra)
             for head, extra in zip(heads, merged, strict=True)]
    return dataclasses.replace(profile, blocks=blocks, chunked_heads=heads,
                               notes={**profile.notes, TIME_NOISE_NOTE: band})


def same_work_pooled(blocks: list[BlockProfile]) -> list[BlockProfile]:
    """``blocks`` with those doing the same forward work (``_forward_work``) given the median
    of each of their times.

    Such blocks recompute alike, so whatever sets their measured times apart is the machine's
    (see the module), and no threshold tells it from a real difference: one layer of a tiny
    GPT measured 2 ms and its three twins 10 ms. The median keeps a block's parts within its
    whole (matmuls within the forward, as each block has them).

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> blocks = [example_block(f"h.{i}", forward_seconds=s)
        ...           for i, s in enumerate([1.0, 1.3, 0.9, 2.0])]
        >>> [b.forward_seconds for b in same_work_pooled(blocks)]
        [1.15, 1.15, 1.15, 1.15]
    """
    pooled = list(blocks)
    same_work: dict[tuple, list[int]] = {}
    for index, block in enumerate(blocks):
        same_work.setdefault(_forward_work(block), []).append(index)
    for indices in same_work.values():
        # The operations any of them timed (one timed more runs, which may add a few).
        operations = sorted({op for i in indices for op in blocks[i].forward_seconds_by_op})
        times = torch.tensor([_times(blocks[i], operations, shares=False) for i in indices],
                             dtype=torch.float64)
        median = torch.quantile(times, 0.5, dim=0).tolist()
        # Each op-level choice's share, over the blocks that measured it (a block of another
        # kind to ``profile`` measures its own menu).
        shares: dict[str, list[float]] = {}
        for i in indices:
            for choice in blocks[i].op_choices:
                shares.setdefault(choice.policy, []).append(choice.forward_share)
        for i in indices:
            block = _with_times(blocks[i], median, operations, shares=False)
            pooled[i] = dataclasses.replace(block, op_choices=[
                dataclasses.replace(choice, forward_share=statistics.median(shares[choice.policy]))
                for choice in block.op_choices])
    return pooled


def _grouped_means(times: torch.Tensor, band: float) -> torch.Tensor:
    """Rows of ``times`` (one per item, a column per time) grouped: in order of the first
    column, each row not yet grouped takes every later one whose times all lie within ``band``
    of its own (relative to the smaller); each group's rows become the group's mean."""
    settled = times.clone()
    left = torch.ones(len(times), dtype=torch.bool)
    for anchor in sorted(range(len(times)), key=lambda i: times[i, 0].item()):
        if not left[anchor]:
            continue
        smaller = torch.minimum(times.abs(), times[anchor].abs())
        within = ((times - times[anchor]).abs() <= band * smaller).all(dim=1) & left
        settled[within] = times[within].mean(dim=0)
        left &= ~within
    return settled


def _kind(block: BlockProfile) -> tuple:
    """What must match for two blocks' times to be compared: which were measured, per
    operation and per op-level choice."""
    return (tuple(getattr(block, name) is None for name in _BLOCK_SECONDS),
            tuple(sorted(block.forward_seconds_by_op)), tuple(c.policy for c in block.op_choices))


def _forward_work(block: BlockProfile) -> tuple:
    """What the block's forward computes, as its numbers say: its input and output, the
    outputs of each of its operations (what a policy keeping it keeps); and which times it
    has. Blocks equal in it recompute alike, whatever they save (a first layer whose input
    needs no gradient, under LoRA, saves less) and whichever op-level choices were measured
    for them."""
    return (block.input_bytes, block.output_bytes, block.matmul_bytes,
            tuple(sorted(block.kept_bytes_by_op.items())),
            tuple(getattr(block, name) is None for name in _BLOCK_SECONDS))


def _times(block: BlockProfile, operations: list[str] | None = None,
           shares: bool = True) -> list[float]:
    """The block's times in one order for all blocks: the scalars, per operation by name (of
    ``operations``, 0 for one it did not time; default: its own, sorted), and (``shares``) the
    op-level choices' shares."""
    by_op = block.forward_seconds_by_op
    operations = sorted(by_op) if operations is None else operations
    return [*(getattr(block, name) or 0.0 for name in _BLOCK_SECONDS),
            *(by_op.get(op, 0.0) for op in operations),
            *(c.forward_share for c in block.op_choices if shares)]


def _with_times(block: BlockProfile, times: list[float], operations: list[str] | None = None,
                shares: bool = True) -> BlockProfile:
    """``block`` with ``times`` in ``_times``' order (the same ``operations`` and ``shares``):
    each of its operations keeps its own name."""
    operations = sorted(block.forward_seconds_by_op) if operations is None else operations
    scalars, rest = times[:len(_BLOCK_SECONDS)], times[len(_BLOCK_SECONDS):]
    by_name = dict(zip(operations, rest[:len(operations)], strict=True))
    choices = block.op_choices
    if shares:
        choices = [dataclasses.replace(choice, forward_share=share)
                   for choice, share in zip(choices, rest[len(operations):], strict=True)]
    return dataclasses.replace(
        block,
        **{name: value for name, value in zip(_BLOCK_SECONDS, scalars, strict=True)
           if getattr(block, name) is not None},
        forward_seconds_by_op={op: by_name[op] for op in block.forward_seconds_by_op},
        op_choices=choices,
    )
