"""Plans are stable under timing noise: measured times that differ by less than the noise are
one time to the solvers.

A profile's times are measured on a machine whose pace moves: a training step varies by 5-15%
from one step to the next on a shared 2-core machine, and a block's times are medians of a few
such rounds. Blocks that do the same work (a transformer's identical layers) then come out a
few percent apart, and a solver comparing their times exactly chooses between equal plans by
that noise: which of two equal layers to recompute, which of two policies of near-equal cost,
would change from one run to the next with the same model and sample.

So ``solve`` chooses on ``settle_times(profile)``, in which

- blocks whose every time (forward, backward, matmuls, recomputation, policy, per operation,
  op-level shares) lies within ``TIME_NOISE_BAND`` of a block's are one kind of block: sorted by
  forward time, each block not yet grouped takes every later one within the band of its own
  times, and all of them get the group's mean times (memory stays each block's own);
- the chunked heads' extra seconds, and the options of a block's menu (``ChainCosts.menu``:
  ``"save-matmuls"``, op-level choices), are merged the same way (``merged_within_band``).

Plans that differ only by such times then cost the same. Where different options add up to
near-equal times, ``optimal``'s DP takes an option over the one offered before it only when it
is faster by more than the band (``memory_levels.Choices``, its ``tolerance``), and ``solve``
takes a later head choice only so. Ties go to the solvers' fixed order (``optimal``: a block
kept before a segment, a shorter segment before a longer one, the menu in its order, the plain
head before a chunked one, fewer chunks first). A difference beyond the
band is a difference: it still changes the plan. The plan's predictions use the profile's own
times. docs/planning.md, "Plans are stable under timing noise", states the rule and the test
that holds it (tests/solvers/test_solvers_plan_stability.py).

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}", forward_seconds=s)
    ...           for i, s in enumerate([1.0, 1.04, 2.0])]
    >>> [b.forward_seconds for b in settle_times(Profile(blocks, 0, 0, 5.0)).blocks]
    [1.02, 1.02, 2.0]
"""

from __future__ import annotations

import dataclasses

import torch

from ..profile_types import BlockProfile, Profile

__all__ = ["TIME_NOISE_BAND", "TIME_NOISE_NOTE", "merged_within_band", "settle_times"]

# Two measured times closer than this (relative to the smaller) are the same time. Steps vary by
# 5-15% on a shared 2-core machine; a block's times are medians over rounds, and equal blocks
# come out a few percent apart (+-3% each: up to 6% between two), which 10% holds with room.
# Wider would merge real differences (a block 10% cheaper is worth recomputing first).
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
    """``profile`` as the solvers see it: blocks whose times are all within ``band`` of each
    other given their mean times, the chunked heads' extra seconds merged within ``band``, and
    ``notes[TIME_NOISE_NOTE]`` the band (see the module). Memory is left as it is.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", forward_seconds=1.0 + i / 100) for i in range(3)]
        >>> settled = settle_times(Profile(blocks, 0, 0, 5.0))
        >>> [round(b.forward_seconds, 6) for b in settled.blocks], settled.notes
        ([1.01, 1.01, 1.01], {'time_noise_band': 0.1})
    """
    if not band:
        return profile  # exact: nothing merged, and the menus as they are
    blocks = list(profile.blocks)
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
            tuple(block.forward_seconds_by_op), tuple(c.policy for c in block.op_choices))


def _times(block: BlockProfile) -> list[float]:
    return [*(getattr(block, name) or 0.0 for name in _BLOCK_SECONDS),
            *block.forward_seconds_by_op.values(), *(c.forward_share for c in block.op_choices)]


def _with_times(block: BlockProfile, times: list[float]) -> BlockProfile:
    scalars, rest = times[:len(_BLOCK_SECONDS)], times[len(_BLOCK_SECONDS):]
    by_op, shares = rest[:len(block.forward_seconds_by_op)], rest[len(block.forward_seconds_by_op):]
    return dataclasses.replace(
        block,
        **{name: value for name, value in zip(_BLOCK_SECONDS, scalars, strict=True)
           if getattr(block, name) is not None},
        forward_seconds_by_op=dict(zip(block.forward_seconds_by_op, by_op, strict=True)),
        op_choices=[dataclasses.replace(choice, forward_share=share)
                    for choice, share in zip(block.op_choices, shares, strict=True)],
    )
