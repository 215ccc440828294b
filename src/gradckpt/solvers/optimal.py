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
chains", 2019). ``simulate`` walks a run of items (kept blocks and segments) forward, then
backward; each item's own peak sits on top of what the items before it retain, so a run whose
first item retains ``a`` bytes fits in ``m`` bytes when its first item's own peak does and the
rest fits in ``m - a``. The tables, for n blocks, memory levels m = 0..M (in units, below),
runs indexed as ``chain_costs`` says (column c < n: inside a segment ending at c; c = n: the
top level), filled from the last block back:

- ``after[s, c, m]``: the least extra seconds of the run from block s to column c's end,
  block s's input not retained yet (a top-level run, or the rest of a recomputation);
- ``at_input[s, e, m]``: the run s..e opening the recomputation of a segment s..e, whose
  input is retained already (so the run is not one segment over all of s..e);
- ``held[s][c, m]``, where ``Profile.input_held(s)``: the run from s after block s - 1 is kept,
  block s's input retained already (that block saves its output);
- ``what_after``, ``what_at_input``, ``what_held``, indexed alike: the option chosen there, as
  rotor's ``what[m][a][b]``, read back to rebuild the plan (never chosen again).

Each entry is the least of: ``KEEP``, block s kept (its forward and backward fit in m), then the
rest from s + 1 in m - saved; segment s..j, given as j (its first forward fits), its forward
time + ``at_input[s, j, m']`` + ``after[j + 1, c, m']``, m' = m - input - its side inputs at
the top level; ``POLICY - i`` (c = n), block s alone under option i of its menu
(``ChainCosts.menu``), its time + ``after[s + 1, n, m' - kept outputs]`` where its peaks fit.
Ties keep that order: KEEP, j upwards, the menu in its order (a later option wins only when
faster by more than ``Choices.tolerance``: rounding, or the timing noise band of a profile
``solve`` settled, ``timing_noise``).

Memory is counted in units (``memory_unit_bytes``): 1 byte when the room left for the chain is
at most ``levels_for(n)`` bytes (up to 2,000 levels; fewer for long chains, so each table stays
near 48 MB of float32: 1,176 for 100 blocks), else the room over that many levels less a
headroom (``headroom_levels``: 2n + 1 levels, a quarter at most). Every size is rounded *up* to
whole units, so a plan the table says fits in the room does fit; the tables are filled for the
room plus the headroom, where every plan that fits in bytes lies (a peak adds up at most
2n + 1 rounded sizes), and read from the top level down, ``simulate`` checking each plan read
(``fastest_within``).
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
import math

import torch

from ..cost import block_bytes, simulate
from ..op_choices import HOST_CAP, without_offload
from ..plan import Segment
from ..profile_types import Profile
from .chain_costs import FRESH, KEEP, OPENING, POLICY, ChainCosts, menu_choice, menu_index
from .chen_greedy import solve_chen_greedy
from .least_peak import lowest_peak_plan, minimum_peak_bytes
from .memory_levels import CHOICE_DTYPE, SUM_ROUNDING, TIME_DTYPE, Choices, MemoryLevels

__all__ = [
    "solve_optimal", "solve_optimal_heads", "same_chain", "minimum_peak_bytes",
    "memory_unit_bytes", "levels_for", "headroom_levels", "every_kth_block",
]

# Memory levels of the time tables: at most _MAX_LEVELS, and about _TABLE_CELLS cells per table
# ((n + 1)^2 runs x levels) so long chains stay fast and small; never fewer than _MIN_LEVELS.
_MAX_LEVELS = 2000
_MIN_LEVELS = 100
_TABLE_CELLS = 12_000_000

_INF = math.inf
# Distinct plans fastest_within reads level by level above the room before it bisects: all
# of a chain of up to 15 blocks' 2n + 1 levels of headroom.
_WALKED_PLANS = 32
# At most this many numbers per tensor operation of the tables: ATen runs an operation on
# fewer than its grain size (32,768) on the calling thread. Larger ones fan out to every
# intra-op thread, and on a busy 2-core machine each such operation waits for a descheduled
# thread (7.6 ms; 50 blocks took 19 s). Changing torch's thread count instead would change
# it for the whole process.
_GRAIN = 32768


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


def memory_unit_bytes(profile: Profile, room_bytes: int) -> int:
    """The bytes one memory level of the DP stands for, given ``room_bytes`` for the chain.

    1 when the room has few enough bytes to count one by one (small tests); else the room over
    the number of levels less the headroom the tables get above it (``headroom_levels``), so
    that the tightest budgets, where every byte decides, get the finest units.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", input_bytes=10**6, output_bytes=10**6,
        ...                         saved_bytes=5 * 10**6) for i in range(100)]
        >>> memory_unit_bytes(Profile(blocks, 0, 0, 1.0), 50 * 10**6)  # 975 + 201 levels of ~51 KB
        51283
    """
    blocks = len(profile.blocks)
    if room_bytes <= levels_for(blocks):
        return 1
    return -(-room_bytes // (levels_for(blocks) - headroom_levels(blocks)))


def levels_for(blocks: int) -> int:
    """How many memory levels the tables of a chain of ``blocks`` blocks have at most.

    Example:
        >>> levels_for(8), levels_for(100), levels_for(1000)
        (2000, 1176, 100)
    """
    return max(_MIN_LEVELS, min(_MAX_LEVELS, _TABLE_CELLS // (blocks + 1) ** 2))


def headroom_levels(blocks: int) -> int:
    """Levels the tables get above the room when sizes are rounded: a peak adds up at most
    2n + 1 rounded sizes, so a plan that fits the room exactly lies within that many levels
    above it (a quarter of the levels at most, for long chains).

    Example:
        >>> headroom_levels(10), headroom_levels(100), headroom_levels(1000)
        (21, 201, 25)
    """
    return min(2 * blocks + 1, levels_for(blocks) // 4)


class _TimeTables:
    """The tables of the module, filled at construction; ``best_plan`` reads the plan back.

    ``heads``: steps that differ from ``profile`` only after the chain (``same_chain``: their
    output heads, ``Profile.with_chunked_head``), one top-level column each, n + h for the
    h-th (default: ``profile`` alone, column n). Only the top-level runs see the head, so the
    runs inside segments are filled once for all of them, and each top-level column holds
    what the tables of that step alone would.
    """

    def __init__(self, profile: Profile, unit_bytes: int, room_bytes: int,
                 heads: list[Profile] | None = None) -> None:
        heads = [profile] if heads is None else heads
        self.chain = ChainCosts(profile)
        self.levels = MemoryLevels(unit_bytes, room_bytes)
        # An option within the timing noise of the one offered before it ties (timing_noise.py)
        self.tolerance = max(SUM_ROUNDING, self.chain.time_noise_band)
        n, levels = self.chain.n, self.levels.count
        self.columns = n + len(heads)  # inside segments ending at 0..n-1, then the top levels
        # What is alive in each column: a top level's is its step's (ChainCosts.alive[n]).
        self.column_alive = self.chain.alive[:n] + [
            head.previous_output_bytes + head.before_chain_bytes for head in heads]
        self.alive = torch.tensor(self.column_alive, dtype=torch.int64)
        self.after = torch.full((n + 1, self.columns, levels), _INF, dtype=TIME_DTYPE)
        self.at_input = torch.full((n, n, levels), _INF, dtype=TIME_DTYPE)
        self.what_after = torch.full((n + 1, self.columns, levels), KEEP, dtype=CHOICE_DTYPE)
        self.what_at_input = torch.full((n, n, levels), KEEP, dtype=CHOICE_DTYPE)
        for s in range(1, n + 1):
            self.after[s, s - 1] = 0.0  # the empty run after a segment's last block
        # The empty top-level runs: each head runs on what the chain retains.
        for column, head in enumerate(heads, start=n):
            self.after[n, column, self.levels.units(head.head_bytes):] = 0.0
        self._after_rows = self.after.unbind(0)  # views, indexed once rather than per use
        self.held: dict[int, torch.Tensor] = {}
        self.what_held: dict[int, torch.Tensor] = {}
        for s in range(n - 1, -1, -1):
            self._fill(s)

    # ----------------------------------------------------------------------------------------
    # Fill
    # ----------------------------------------------------------------------------------------

    def _fill(self, s: int) -> None:
        """The runs starting at block s, a few columns at a time: each column only reads the
        same column of later runs, and at most ``_GRAIN`` numbers per tensor operation keep
        every operation on this thread (see ``_GRAIN``)."""
        columns, levels = self.columns, self.levels.count
        if self.chain.held[s]:
            self.held[s] = torch.full((columns, levels), _INF, dtype=TIME_DTYPE)
            self.what_held[s] = torch.full((columns, levels), KEEP, dtype=CHOICE_DTYPE)
            if s > 0:
                self.held[s][s - 1] = 0.0  # the empty run after a segment's last block
        width = max(1, _GRAIN // levels)
        for first in range(s, columns, width):
            self._fill_columns(s, slice(first, min(columns, first + width)))

    def _fill_columns(self, s: int, columns: slice) -> None:
        """The entries (and choices) of the runs from block s ending in ``columns``: block s
        kept, each segment s..j, block s under the policy, offered in the order ties keep."""
        chain, n, levels = self.chain, self.chain.n, self.levels
        c0, c1 = columns.start, columns.stop
        top = slice(max(n, c0), c1)  # the top-level runs' columns in the chunk (maybe none)
        keep_fresh = self._keep_first(s, False, columns)
        keep_retained = self._keep_first(s, True, columns)
        # Runs opening a segment's recomputation (columns below n: inside segments), final
        # once every segment s..j with j < e is in; written into the table as they complete,
        # since a later chunk reads them.
        at_input = self.at_input[s]
        inside = slice(c0, min(c1, n))
        at_input[inside] = keep_retained[: inside.stop - c0]
        measured = chain.measured_recompute_peak(s)
        if measured is not None and c0 == s:  # segment s..s's recomputation, measured
            at_input[s] = 0.0
            at_input[s, : min(levels.units(measured), levels.count)] = _INF
        opening = Choices(at_input[inside], at_input[inside].double(),
                          self.what_at_input[s, inside], self.tolerance)
        # Segments s..j, on levels above the segment's retained input (shifted in at the end).
        # Nothing offered yet: KEEP is never read there.
        segments = Choices.first(torch.full((c1 - c0, levels.count), _INF, dtype=TIME_DTYPE),
                                 KEEP, self.tolerance)
        costs = chain.segments(s)
        for j in range(s, min(chain.limit[s], c1 - 1) + 1):
            k = j - s
            low = max(j, c0)  # the columns segment s..j can end a run at, in this chunk
            rest = self._after_rows[j + 1][low:c1]  # column j: the empty rest
            options = rest + (at_input[j] + costs.forward_seconds[k])
            exact = rest.double() + (at_input[j].double() + costs.forward_seconds[k])
            self._cut_first_forward((options, exact), j, low, costs.transient[k])
            # Inside a segment s..e, a child s..j must be shorter: only e > j.
            later = slice(max(j + 1, c0), min(c1, n))
            if later.start < later.stop:
                rows = slice(later.start - low, later.stop - low)
                opening.offer(options[rows], exact[rows], j, slice(later.start - c0, None))
            side = chain.segment_side_bytes(s, j)
            if side and top.start < top.stop:  # the top-level columns: it holds side inputs
                options[top.start - low:] = levels.shift(options[top.start - low:], side)
                exact[top.start - low:] = levels.shift(exact[top.start - low:], side)
            if low == j < n:  # column j: a child ending where its segment ends (none: module)
                options[0] = exact[0] = _INF
            segments.offer(options, exact, j, slice(low - c0, None))
        if chain.policies and top.start < top.stop:
            # Top-level runs only. Inside another segment the engine keeps a policy's outputs
            # from that segment's first forward on, which no prediction counts.
            self._offer_policy(segments, s, top, c0)
        after = Choices.first(keep_fresh, KEEP, self.tolerance)
        shifted = segments.shifted(levels, chain.blocks[s].input_bytes)
        after.offer(shifted.seconds, shifted.exact, shifted.what)
        self.after[s, columns], self.what_after[s, columns] = after.seconds, after.what
        if chain.held[s]:  # after block s - 1 kept: its input, and a segment's, comes free
            held = Choices.first(keep_retained, KEEP, self.tolerance)
            held.offer(segments.seconds, segments.exact, segments.what)
            self.held[s][columns], self.what_held[s][columns] = held.seconds, held.what

    def _keep_first(self, s: int, input_retained: bool, columns: slice) -> torch.Tensor:
        """Block s kept as the run's first item, the rest after it, for ``columns``."""
        chain, n, levels = self.chain, self.chain.n, self.levels
        rest = self._rest_after_keeping(s)
        added, backward = chain.kept(s, input_retained)
        forward = chain.kept_transient(s, input_retained, top=False)  # what adds to alive
        keep = levels.fit(
            levels.shift(rest[columns], added),
            levels.units_tensor(torch.clamp(self.alive[columns] + forward, min=backward)),
        )
        top = slice(max(n, columns.start), columns.stop)
        if chain.side[s] and top.start < top.stop:  # the top levels: it holds side inputs
            added, backward = chain.kept(s, input_retained, top=True)
            forward = chain.kept_transient(s, input_retained, top=True)
            keep[top.start - columns.start:] = levels.fit(
                levels.shift(rest[top], added),
                levels.units_tensor(torch.clamp(self.alive[top] + forward, min=backward)),
            )
        return keep

    def _rest_after_keeping(self, s: int) -> torch.Tensor:
        """By column, the run after block s is kept: its input retained already when block s
        saves its output."""
        return self.held[s + 1] if self.chain.held[s + 1] else self._after_rows[s + 1]

    def _cut_first_forward(
        self, rows: tuple[torch.Tensor, ...], j: int, low: int, transient: int
    ) -> None:
        """Infinity where segment s..j's first forward (alive + ``transient``) does not fit,
        in each of ``rows``: columns ``low``.. of runs that open with that segment."""
        chain, n, levels = self.chain, self.chain.n, self.levels
        width = len(rows[0])
        # The empty rest (column j; the top levels too when j is the last block): the segment's
        # own forward peak is their only limit (a measured recomputation need not peak above).
        for column in [j, *range(n, self.columns)] if j == n - 1 else [j]:
            if low <= column < low + width:
                for row in rows:
                    row[column - low, : levels.units(self.column_alive[column] + transient)] = _INF
        # Non-empty rests need no cut where something already does: the recomputation's run
        # peaks at least there with its own gradient alive, a non-empty rest above its first
        # block's own.
        rest_floor = (chain.blocks[j + 1].input_bytes + chain.lowest_forward_peak(j + 1)
                      if j + 1 < n else _INF)
        first = max(j + 1, low)  # non-empty rests
        if transient > rest_floor and first < low + width:
            cuts = levels.cuts(levels.units_tensor(self.alive[first: low + width] + transient))
            for row in rows:
                row[first - low:].add_(cuts)

    def _offer_policy(self, segments: Choices, s: int, top: slice, first_column: int) -> None:
        """Block s alone under each policy of its menu, offered to the top-level runs in
        columns ``top`` (``segments``' rows from ``top.start - first_column``): its
        recomputation's own peak, its first forward's, and the levels the outputs it keeps
        and its side inputs take."""
        chain, levels = self.chain, self.levels
        rest = self._after_rows[s + 1][top]
        for index, option in enumerate(chain.menu(s)):
            under_policy = rest + option.extra_seconds
            exact = rest.double() + option.extra_seconds
            for row, column in enumerate(range(top.start, top.stop)):
                peak = max(option.peak, self.column_alive[column] + option.transient)
                under_policy[row, : levels.units(peak)] = exact[row, : levels.units(peak)] = _INF
            retained = (option.kept_bytes, chain.segment_side_bytes(s, s))
            for nbytes in retained:  # rounded one by one, as the rebuild reads them
                under_policy = levels.shift(under_policy, nbytes)
                exact = levels.shift(exact, nbytes)
            segments.offer(under_policy, exact, menu_choice(index),
                           slice(top.start - first_column, None))

    # ----------------------------------------------------------------------------------------
    # Rebuild
    # ----------------------------------------------------------------------------------------

    def may_miss_lowest_peak_plan(self, room_bytes: int, head: int = 0) -> bool:
        """Whether rounding may hide a plan of the lowest peak that fits ``room_bytes`` and
        is faster than what ``fastest_within`` read (for the ``head``-th of the heads).

        The plan of least peak P peaks at no more than the table's lowest finite level (in
        units); rounded up, each of the at most 2n + 1 sizes adding up to any of its peaks
        gains under one unit. So from 2n + 1 levels above that level on, the table holds it.
        """
        if self.levels.unit == 1:
            return False  # nothing rounded: the table is exact
        finite = torch.isfinite(self._top(head)).nonzero()
        if len(finite) == 0:
            return True
        held_from = finite[0].item() + 2 * self.chain.n + 1
        return min(self.levels.count - 1, room_bytes // self.levels.unit) < held_from

    def fastest_within(self, room_bytes: int, profile: Profile, head: int = 0
                       ) -> list[Segment] | None:
        """The fastest plan the tables hold whose peak (``simulate``'s, in bytes) fits
        ``room_bytes``, as far as a few reads find it; None when they hold none. ``profile``:
        the ``head``-th of the heads' steps, whose top-level column is read.

        The tables may be filled for more room than that (``headroom_levels``). From the room's
        own level down every plan fits, its sizes rounded up; above it, a level's plan may or
        may not fit in bytes, and a higher level holds a plan at least as fast. So the levels
        are read from the top down, the first plan that fits the answer; past
        ``_WALKED_PLANS`` distinct plans (long chains, whose headroom has more levels), the
        rest by bisection, as if fitting went with the level (it nearly does).
        """
        if self.chain.n == 0:
            return None
        fits = min(self.levels.count - 1, room_bytes // self.levels.unit)  # fits rounded
        top = self._top(head)
        tried: set[str] = set()
        level = self.levels.count - 1
        while level > fits and len(tried) < _WALKED_PLANS:
            if math.isinf(top[level].item()):
                return None  # nor does any lower level hold a plan
            plan = self._plan_at(level, head)
            if repr(plan) not in tried:
                tried.add(repr(plan))
                if simulate(profile, plan)[0] <= room_bytes:
                    return plan
            level -= 1
        # Bisection between the highest level whose plan fits, as far as known, and the lowest
        # read whose plan did not.
        fitting = None if math.isinf(top[fits].item()) else self._plan_at(fits, head)
        low, high = fits, level + 1
        while high - low > 1:
            middle = (low + high) // 2
            if math.isinf(top[middle].item()):
                low = middle  # holds no plan: look higher
                continue
            plan = self._plan_at(middle, head)
            if simulate(profile, plan)[0] <= room_bytes:
                low, fitting = middle, plan
            else:
                high = middle
        return fitting

    def _plan_at(self, level: int, head: int = 0) -> list[Segment]:
        """The whole chain's plan at ``level`` before the ``head``-th head, read from the
        choice tables."""
        return self._rebuild(0, self.chain.n + head, level, self.chain.start_after_keeping(0))

    def best_plan(self, head: int = 0) -> list[Segment] | None:
        """The fastest top-level plan at the highest level, or None when nothing fits."""
        if self.chain.n == 0 or math.isinf(self._top(head)[-1].item()):
            return None
        return self._plan_at(self.levels.count - 1, head)

    def _top(self, head: int = 0) -> torch.Tensor:
        """The whole chain's least extra time at each level, before the ``head``-th head."""
        column = self.chain.n + head
        return self.held[0][column] if self.chain.held[0] else self.after[0, column]

    def _rebuild(self, s: int, column: int, level: int, start: str) -> list[Segment]:
        """The plan of the run from block s in ``column`` at ``level``, read from the choice
        tables; ``start``: how the run's first input stands (``FRESH``, ``HELD``, ``OPENING``).
        """
        chain, levels = self.chain, self.levels
        if s > chain.end(column):
            return []
        seconds, what = (
            (self.after[s], self.what_after[s]) if start == FRESH
            else (self.at_input[s], self.what_at_input[s]) if start == OPENING
            else (self.held[s], self.what_held[s])  # HELD
        )
        assert not math.isinf(seconds[column, level].item()), "the table said this run fits"
        choice = int(what[column, level].item())
        top = column >= chain.n  # one of the top levels (one per head)
        if choice == KEEP:
            added, _ = chain.kept(s, start != FRESH, top=top)
            return self._rebuild(s + 1, column, level - levels.units(added),
                                 chain.start_after_keeping(s + 1))
        end = s if choice <= POLICY else choice
        inner = level - (0 if start != FRESH else levels.units(chain.blocks[s].input_bytes))
        inner -= levels.units(chain.segment_side_bytes(s, end)) if top else 0
        if choice <= POLICY:
            option = chain.menu(s)[menu_index(choice)]
            rest_level = inner - levels.units(option.kept_bytes)
            return [Segment(s, s, policy=option.policy),
                    *self._rebuild(s + 1, column, rest_level, FRESH)]
        children = self._rebuild(s, end, inner, OPENING)
        return [Segment(s, end, children), *self._rebuild(end + 1, column, inner, FRESH)]
