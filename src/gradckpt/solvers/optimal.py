"""Strategy "optimal": the least extra time that fits the budget, by dynamic programming.

The search space is every plan ``gradckpt.cost.simulate`` evaluates and ``gradckpt.apply`` can
install: any blocks kept, any runs of blocks checkpointed as segments (none across a chain
break, ``Profile.chain_breaks``), segments nested inside segments to any depth (each child
ending before its parent's last block: a parent's recomputation runs through to its end
anyway, so a child ending there holds, measured, what its blocks kept would, and only adds
its recomputation), and top-level one-block segments under each policy of the block's menu:
``policy="save-matmuls"`` and the op-level choices ``"save-ops:..."`` of
``gradckpt.op_choices`` (``profile`` measures each block run that way, so those peaks are
measured ones; a longer segment under a policy could only be bounded, and ``apply`` refuses a
policy on a nested segment). The answer is the plan of least predicted extra time
whose predicted peak (``fixed_bytes`` + ``simulate``'s chain peak) fits the budget.

How: the "rotor" dynamic program of Beaumont et al. ("Optimal checkpointing for heterogeneous
chains", 2019), its tables of the least extra time of each run at each memory level filled
once and the plan read back from the choices they record (``time_tables``). Memory is counted
in units (``table_resolution``): 1 byte on small rooms, else sizes rounded *up*, so a plan the
tables say fits does fit, the tables filled for a little more room than there is and read
from the top level down, ``simulate`` checking each plan read.
With 1-byte units the answer is the exact optimum, which the tests check against brute force;
with larger ones it is at least as fast as the exact optimum for a room smaller by (2n + 1)
units. Because rounding can still hide plans that fit by a hair, exactly-checked candidates
join the table's answer: Chen's greedy plans
(``chen-greedy``: every-layer, every k-th block on uniform chains, ...), every k-th block
checkpointed alone (the layouts users measure and then ask to fit) and, near the lowest
reachable peak, the plan of least peak from an exact DP in bytes (``least_peak``; of equal
peaks, the fastest). So
``optimal`` is never slower than ``chen-greedy``, and a budget of exactly ``minimum_peak_bytes``
always works.

The output head's choices (``solve`` plans the step with the plain head and with each chunked
one, ``Profile.with_chunked_head``) change only what the top-level runs see: the head's bytes
and what is alive in the chain's forward. ``solve_optimal_heads`` fills one set of tables for
steps that differ only there (``same_chain``: the chunked heads, whose head gradients agree),
with a top-level column per step (n, n + 1, ...), each holding what that step's own tables
would, read back as that step's plan: the same plans as ``solve_optimal`` of each, for about
the work of one.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}") for i in range(4)]
    >>> profile = Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=12.0)
    >>> [(s.start, s.end) for s in solve_optimal(profile, 1120)]  # one 2-block segment fits
    [(0, 1)]
    >>> minimum_peak_bytes(profile)
    1070
"""

from __future__ import annotations

import dataclasses

from ..cost import block_bytes, simulate
from ..op_choices import HOST_CAP, without_offload
from ..plan import Segment
from ..profile_types import Profile
from .chain_costs import ChainCosts
from .chen_greedy import solve_chen_greedy
from .least_peak import lowest_peak_plan, minimum_peak_bytes
from .memory_levels import SUM_ROUNDING
from .table_resolution import headroom_levels, levels_for, memory_unit_bytes
from .time_tables import _TimeTables

__all__ = [
    "solve_optimal", "solve_optimal_heads", "same_chain", "minimum_peak_bytes",
    "memory_unit_bytes", "levels_for", "headroom_levels", "every_kth_block",
]


def solve_optimal(profile: Profile, budget_bytes: int | None) -> list[Segment]:
    """The plan of least extra time whose predicted peak fits ``budget_bytes``.

    No segments when the model fits without checkpointing (or ``budget_bytes`` is ``None``);
    when nothing fits, the plan with the lowest peak (``solve`` then raises ``BudgetError``).
    A plan offloading more than the host may take (``op_choices.HOST_CAP``) is solved again
    without offloading.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(6)]
        >>> profile = Profile(blocks, peak_bytes=1310, fixed_bytes=1000, step_seconds=18.0)
        >>> plan = solve_optimal(profile, 1150)
        >>> simulate(profile, plan)  # chain peak within the 150 bytes left, 4 s recomputed
        (150, 4.0)
    """
    return solve_optimal_heads([profile], budget_bytes)[0]


def solve_optimal_heads(steps: list[Profile], budget_bytes: int | None) -> list[list[Segment]]:
    """``solve_optimal`` of each of ``steps``, the same plans, for less work: steps that
    differ only after the chain (``same_chain``: one step with each of its output heads,
    ``Profile.with_chunked_head``) share one set of tables, a top-level column each.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(6)]
        >>> profile = Profile(blocks, peak_bytes=1310, fixed_bytes=1000, step_seconds=18.0)
        >>> heads = [profile, dataclasses.replace(profile, head_bytes=100)]
        >>> solve_optimal_heads(heads, 1150) == [solve_optimal(step, 1150) for step in heads]
        True
    """
    plans: dict[int, list[Segment]] = {}
    groups: list[list[int]] = []  # indices of steps that share their tables
    for index, step in enumerate(steps):
        if budget_bytes is None or step.fixed_bytes + simulate(step, [])[0] <= budget_bytes:
            plans[index] = []
            continue
        group = next((group for group in groups if same_chain(steps[group[0]], step)), None)
        if group is None:
            groups.append([index])
        else:
            group.append(index)
    for group in groups:
        each = _fastest_fitting([steps[index] for index in group], budget_bytes)
        for index, segments in zip(group, each, strict=True):
            step = steps[index]
            cap = step.notes.get(HOST_CAP)
            if cap is not None and sum(b.offloaded for b in block_bytes(step, segments)) > cap:
                # The tables count no host memory: above the cap, the plan without offloading.
                segments = _fastest_fitting([without_offload(step)], budget_bytes)[0]
            plans[index] = segments
    return [plans[index] for index in range(len(steps))]


# The fields of a step that the time tables read only in their top-level runs (the head, and
# what is alive in the chain's forward besides it) or not at all (what is outside the chain).
_AFTER_THE_CHAIN = ("head_bytes", "previous_output_bytes", "before_chain_bytes",
                    "other_peak_bytes", "optimizer_step_bytes", "peak_bytes")


def same_chain(first: Profile, second: Profile) -> bool:
    """Whether the time tables of two steps agree on every run inside a segment: the steps
    differ at most in ``_AFTER_THE_CHAIN`` (the output head: ``Profile.with_chunked_head``
    with the same ``head_gradient_bytes``), so that one set of tables holds both.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> profile = Profile([example_block()], 1500, 1000, 4.0, head_bytes=400)
        >>> same_chain(profile, dataclasses.replace(profile, head_bytes=40))
        True
        >>> same_chain(profile, dataclasses.replace(profile, head_gradient_bytes=40))
        False
    """
    return dataclasses.replace(
        first, **{name: getattr(second, name) for name in _AFTER_THE_CHAIN}) == second


def _fastest_fitting(steps: list[Profile], budget_bytes: int) -> list[list[Segment]]:
    """For each of ``steps`` (``same_chain`` all), the fastest plan that fits, or when none
    does the plan of lowest peak; from one set of tables."""
    first = steps[0]
    room_bytes = budget_bytes - first.fixed_bytes
    tables = None
    if room_bytes >= 0:
        unit = memory_unit_bytes(first, room_bytes)
        # Filled for a little more room than there is (headroom_levels), the tables hold every
        # plan that fits exactly though its sizes rounded up do not; fastest_within reads the
        # fastest of them that the cost model says fits.
        slack = headroom_levels(len(first.blocks)) * unit if unit > 1 else 0
        tables = _TimeTables(first, unit, room_bytes + slack, heads=steps)
    return [_fastest_of_step(step, budget_bytes, tables, head)
            for head, step in enumerate(steps)]


def _fastest_of_step(
    profile: Profile, budget_bytes: int, tables: _TimeTables | None, head: int,
) -> list[Segment]:
    """The fastest plan that fits of one step, the ``head``-th column of ``tables`` (None
    when no room is left for the chain): the tables' and the exactly-checked candidates."""
    room_bytes = budget_bytes - profile.fixed_bytes
    candidates = []
    if tables is not None:
        candidates.append(tables.fastest_within(room_bytes, profile, head))
        if tables.levels.unit > 1:
            # Rounding can hide a plan that fits by a few units: Chen's greedy candidates
            # (every-layer, every k-th on a uniform chain, ...) and every k-th block alone (the
            # layouts users measure and then ask to fit) cost little to check exactly.
            candidates.append(solve_chen_greedy(profile, budget_bytes))
            candidates.extend(every_kth_block(profile))
    lowest = None
    if (tables is None or candidates[0] is None
            or tables.may_miss_lowest_peak_plan(room_bytes, head)):
        lowest = lowest_peak_plan(profile)
        candidates.append(lowest)
    fitting = []
    for segments in candidates:
        if segments is not None:
            peak, seconds = simulate(profile, segments)
            if peak <= room_bytes:  # the cost model has the last word
                fitting.append((seconds, peak, segments))
    if not fitting:
        # nothing fits: the plan of lowest peak, for solve()'s BudgetError
        return lowest if lowest is not None else lowest_peak_plan(profile)
    # Of the plans as fast as the fastest within the timing noise (or the rounding of sums:
    # equal plans' seconds added in another order), the least peak, then the first offered:
    # memory is measured to the byte, so noise in the times does not pick between them.
    tolerance = max(SUM_ROUNDING, ChainCosts.noise_band(profile))
    least = min(seconds for seconds, _, _ in fitting)
    return min((entry for entry in fitting if entry[0] <= least * (1 + tolerance)),
               key=lambda entry: entry[1])[2]


def every_kth_block(profile: Profile) -> list[list[Segment]]:
    """Blocks 0, k, 2k, ... each checkpointed alone, for k = 1..n: Transformers'
    every-n-layers layouts.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> [[s.start for s in plan] for plan in every_kth_block(Profile(blocks, 0, 0, 1.0))]
        [[0, 1, 2, 3], [0, 2], [0, 3], [0]]
    """
    n = len(profile.blocks)
    return [[Segment(i, i) for i in range(0, n, k)] for k in range(1, n + 1)]
