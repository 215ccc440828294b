"""Strategy "optimal": the least extra time that fits the budget, by dynamic programming.

The search space is every plan ``gradckpt.cost.simulate`` evaluates and ``gradckpt.apply`` can
install: any blocks kept, any runs of blocks checkpointed as segments (none across a chain
break, ``Profile.chain_breaks``), segments nested inside segments to any depth (each child
ending before its parent's last block: a parent's recomputation runs through to its end
anyway, so a child ending there holds, measured, what its blocks kept would, and only adds
its recomputation), and top-level one-block segments with
``policy="save-matmuls"`` (``profile`` measures each block run that way, so those predictions
are measured ones; a longer segment under the policy could only be bounded, and ``apply``
refuses a policy on a nested segment). The answer is the plan of least predicted extra time
whose predicted peak (``fixed_bytes`` + ``simulate``'s chain peak) fits the budget.

How: the "rotor" dynamic program of Beaumont et al. ("Optimal checkpointing for heterogeneous
chains", 2019). ``simulate`` walks a run of items (kept blocks and segments) forward, then
backward; each item's own peak sits on top of what the items before it retain, so a run whose
first item retains ``a`` bytes fits in ``m`` bytes when its first item's own peak does and the
rest fits in ``m - a``. For every run ``s..e`` (at the top level, or inside a segment ending at
``e`` whose incoming gradient stays alive, right at the segment's retained input or after it)
and every memory level ``m``, the table holds the least extra time: block ``s`` kept, then the
rest in ``m - saved``; or a segment ``s..j`` (its forward time, plus its recomputation solved as
a run inside it, plus the rest) in ``m - input``; or block ``s`` alone under the policy.

Memory is counted in units (``memory_unit_bytes``): 1 byte when the room left for the chain is
at most ``levels_for(n)`` bytes (up to 2,000 levels; fewer for long chains, so each table stays
near 48 MB of float32: 1,176 for 100 blocks), else the room over that many levels. Every size
is rounded *up* to whole units, so a plan the table says fits does fit (and ``simulate`` checks
it once more).
With 1-byte units the answer is the exact optimum, which the tests check against brute force;
with larger ones it is at least as fast as the exact optimum for a room smaller by (2n + 1)
units (a peak adds up at most 2n + 1 rounded sizes). Because rounding can hide plans that
fit by a hair, exactly-checked candidates join the table's answer: Chen's greedy plans
(``chen-greedy``: every-layer, every k-th block on uniform chains, ...), every k-th block
checkpointed alone (the layouts users measure and then ask to fit) and, near the lowest
reachable peak, the plan of least peak from an exact DP in bytes. So ``optimal`` is never slower
than ``chen-greedy``, and a budget of exactly ``minimum_peak_bytes`` always works. Measured on
2 CPU cores: a 100-block chain solves in about half a second (``python bench/solvers.py``).

Example:
    >>> from gradckpt.profile_types import BlockProfile, Profile
    >>> blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0) for i in range(4)]
    >>> profile = Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=12.0)
    >>> [(s.start, s.end) for s in solve_optimal(profile, 1120)]  # one 2-block segment fits
    [(0, 1)]
    >>> minimum_peak_bytes(profile)
    1070
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cost import gradients_after, side_inputs_held, simulate
from ..plan import Segment
from ..profile_types import PLANNED_POLICY, BlockProfile, Profile
from .chen_greedy import solve_chen_greedy

__all__ = [
    "solve_optimal", "minimum_peak_bytes", "memory_unit_bytes", "levels_for", "every_kth_block",
]

# Memory levels of the time tables: at most _MAX_LEVELS, and about _TABLE_CELLS cells per table
# ((n + 1)^2 runs x levels) so long chains stay fast and small; never fewer than _MIN_LEVELS.
_MAX_LEVELS = 2000
_MIN_LEVELS = 100
_TABLE_CELLS = 12_000_000

_INF = math.inf
# At most this many numbers per tensor operation of the tables: ATen runs an operation on
# fewer than its grain size (32,768) on the calling thread. Larger ones fan out to every
# intra-op thread, and on a busy 2-core machine each such operation waits for a descheduled
# thread (7.6 ms; 50 blocks took 19 s). Changing torch's thread count instead would change
# it for the whole process.
_GRAIN = 32768
# How a run's first input stands: not retained yet; retained by the kept block before it (its
# saved output); retained as the input of the segment whose recomputation the run opens.
_FRESH, _HELD, _OPENING = "fresh", "held", "opening"
# float32: seconds need no more than 7 digits (simulate re-predicts the chosen plan in float64),
# and half the bytes buy twice the levels: finer rounding for the same memory and time.
_DTYPE = torch.float32


def memory_unit_bytes(profile: Profile, room_bytes: int) -> int:
    """The bytes one memory level of the DP stands for, given ``room_bytes`` for the chain.

    1 when the room has few enough bytes to count one by one (small tests); else the room over
    the number of levels, so that the tightest budgets, where every byte decides, get the
    finest units.

    Example:
        >>> from gradckpt.profile_types import BlockProfile, Profile
        >>> blocks = [BlockProfile(f"h.{i}", 10**6, 10**6, 5 * 10**6, True, 1.0, 2.0)
        ...           for i in range(100)]
        >>> memory_unit_bytes(Profile(blocks, 0, 0, 1.0), 50 * 10**6)  # 1,176 levels of ~43 KB
        42518
    """
    return max(1, -(-room_bytes // levels_for(len(profile.blocks))))


def levels_for(blocks: int) -> int:
    """How many memory levels the tables of a chain of ``blocks`` blocks have at most.

    Example:
        >>> levels_for(8), levels_for(100), levels_for(1000)
        (2000, 1176, 100)
    """
    return max(_MIN_LEVELS, min(_MAX_LEVELS, _TABLE_CELLS // (blocks + 1) ** 2))


def solve_optimal(profile: Profile, budget_bytes: int | None) -> list[Segment]:
    """The plan of least extra time whose predicted peak fits ``budget_bytes``.

    No segments when the model fits without checkpointing (or ``budget_bytes`` is ``None``);
    when nothing fits, the plan with the lowest peak (``solve`` then raises ``BudgetError``).

    Example:
        >>> from gradckpt.profile_types import BlockProfile, Profile
        >>> blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0) for i in range(6)]
        >>> profile = Profile(blocks, peak_bytes=1310, fixed_bytes=1000, step_seconds=18.0)
        >>> plan = solve_optimal(profile, 1150)
        >>> simulate(profile, plan)  # chain peak within the 150 bytes left, 4 s recomputed
        (150, 4.0)
    """
    if budget_bytes is None or profile.fixed_bytes + simulate(profile, [])[0] <= budget_bytes:
        return []
    room_bytes = budget_bytes - profile.fixed_bytes
    candidates = []
    tables = None
    if room_bytes >= 0:
        tables = _TimeTables(profile, memory_unit_bytes(profile, room_bytes), room_bytes)
        candidates.append(tables.best_plan())
        if tables.unit > 1:
            # Rounding can hide a plan that fits by a few units: Chen's greedy candidates
            # (every-layer, every k-th on a uniform chain, ...) and every k-th block alone (the
            # layouts users measure and then ask to fit) cost little to check exactly.
            candidates.append(solve_chen_greedy(profile, budget_bytes))
            candidates.extend(every_kth_block(profile))
    lowest = None
    if tables is None or candidates[0] is None or tables.may_miss_lowest_peak_plan():
        lowest = _lowest_peak_plan(profile)
        candidates.append(lowest)
    fitting = []
    for segments in candidates:
        if segments is not None:
            peak, seconds = simulate(profile, segments)
            if peak <= room_bytes:  # the cost model has the last word
                fitting.append((seconds, peak, segments))
    if not fitting:
        # nothing fits: the plan of lowest peak, for solve()'s BudgetError
        return lowest if lowest is not None else _lowest_peak_plan(profile)
    return min(fitting, key=lambda entry: entry[:2])[2]


def every_kth_block(profile: Profile) -> list[list[Segment]]:
    """Blocks 0, k, 2k, ... each checkpointed alone, for k = 1..n: Transformers'
    every-n-layers layouts.

    Example:
        >>> from gradckpt.profile_types import BlockProfile, Profile
        >>> blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0) for i in range(4)]
        >>> [[s.start for s in plan] for plan in every_kth_block(Profile(blocks, 0, 0, 1.0))]
        [[0, 1, 2, 3], [0, 2], [0, 3], [0]]
    """
    n = len(profile.blocks)
    return [[Segment(i, i) for i in range(0, n, k)] for k in range(1, n + 1)]


def minimum_peak_bytes(profile: Profile) -> int:
    """The lowest predicted peak (``fixed_bytes`` included) of any plan in the search space.

    Example:
        >>> from gradckpt.profile_types import BlockProfile, Profile
        >>> blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0) for i in range(4)]
        >>> minimum_peak_bytes(Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=1))
        1070
    """
    return profile.fixed_bytes + simulate(profile, _lowest_peak_plan(profile))[0]


def _lowest_peak_plan(profile: Profile) -> list[Segment]:
    """The plan of lowest peak: the DP's, or none at all. The DP counts side inputs no block
    saves as any plan with a segment holds them; the plan without one frees them after the
    forward, and can be the lowest (a chain whose peak lies outside it)."""
    plan = _LowestPeak(profile).plan()
    if plan and simulate(profile, [])[0] <= simulate(profile, plan)[0]:
        return []
    return plan


# --------------------------------------------------------------------------------------------
# What every table needs to know about the chain
# --------------------------------------------------------------------------------------------


@dataclass
class _SegmentCosts:
    """For segments s..j, j = s, s+1, ...: the numbers the DP needs, one list entry per j."""

    transient: list[int]  # most bytes above its kept input while its forward runs
    forward_seconds: list[float]  # its recomputation, no policy
    matmul_bytes: list[int]  # what the policy keeps from the first forward
    policy_seconds: list[float]  # its recomputation under the policy
    policy_peak: list[int]  # its recomputation's peak under the policy, above what it keeps
    policy_transient: list[int]  # its first forward's peak under the policy, above the same


class _Chain:
    """The chain's per-block numbers and per-segment costs, shared by both DPs.

    Runs are indexed by (first block, column): columns 0..n-1 are runs inside a segment ending
    at that block (its incoming gradient alive throughout), column n the top-level run to the
    last block (only the previous step's output alive, in its forward).
    """

    def __init__(self, profile: Profile) -> None:
        self.blocks: list[BlockProfile] = profile.blocks
        self.n = len(self.blocks)
        # Without matmuls and unmeasured, a block under the policy is its plain segment.
        self.policies = any(b.matmul_bytes or b.matmul_seconds
                            or b.policy_backward_peak_bytes is not None for b in self.blocks)
        # While a run inside a segment ending at c is (re)computed in backward, c's output
        # gradient and every parameter gradient made before are alive.
        self.gradients_after = gradients_after(profile)
        self.alive = [
            b.output_bytes + g for b, g in zip(self.blocks, self.gradients_after, strict=True)
        ]
        # Column n is the top level, whose forward runs with the previous step's output alive
        # (a loop's ``out = model(**batch)`` holds it until the model returns).
        self.alive.append(profile.previous_output_bytes)
        self.head_bytes = profile.head_bytes
        # Side inputs are held by the top-level item holding their block (simulate's walk),
        # those no block saves too, as in any plan with a segment: the plan without one is
        # predicted apart (solve_optimal, _lowest_peak_plan). side_before[j] is the sum over
        # blocks 0..j-1, so segment s..j holds side_before[j + 1] - side_before[s].
        self.side = side_inputs_held(profile, checkpointing=True)
        self.side_before = [0]
        for side in self.side:
            self.side_before.append(self.side_before[-1] + side)
        # The last block a segment starting at s may reach (chain breaks: encoder to decoder).
        self.limit = [profile.segment_end_limit(s) for s in range(self.n)]
        # held[s]: block s's input is retained already when block s - 1 is kept before it
        # (that block saves its output), or, for s = 0, always (a tensor of the sample);
        # index n, the head, never.
        self.held = [profile.input_held(s) for s in range(self.n)] + [False]
        self._segments: dict[int, _SegmentCosts] = {}

    def end(self, column: int) -> int:
        return min(column, self.n - 1)

    def kept(self, s: int, input_retained: bool, top: bool = False) -> tuple[int, int]:
        """Block s kept: the bytes it retains (its side inputs too at the top level), and its
        backward's peak above what was before."""
        block = self.blocks[s]
        added = block.saved_bytes - (block.input_bytes if input_retained and block.input_saved
                                     else 0)
        added += self.side[s] if top else 0
        return added, (added + block.output_bytes + block.backward_peak_bytes
                       + self.gradients_after[s])

    def kept_transient(self, s: int, input_retained: bool, top: bool) -> int:
        """What block s's forward holds, kept, above what is retained before it."""
        block = self.blocks[s]
        hidden = 0 if input_retained else block.input_bytes
        return hidden + block.forward_peak_bytes + (self.side[s] if top else 0)

    def kept_forward_peak(self, s: int, input_retained: bool, column: int) -> int:
        return self.alive[column] + self.kept_transient(s, input_retained, column == self.n)

    def segment_side_bytes(self, s: int, j: int) -> int:
        """The side inputs a top-level segment s..j holds."""
        return self.side_before[j + 1] - self.side_before[s]

    def segments(self, s: int) -> _SegmentCosts:
        """Costs of the segments starting at s (computed once, in O(n))."""
        if s in self._segments:
            return self._segments[s]
        costs = _SegmentCosts([], [], [], [], [], [])
        transient, seconds, matmul_bytes, policy_seconds = 0, 0.0, 0, 0.0
        policy_transient = 0  # a longer segment under the policy: bounded by the plain peaks
        retained = 0  # above the segment's kept input and matmul outputs, while recomputed
        forward_high = backward_high = -_INF
        for j in range(s, self.limit[s] + 1):
            block = self.blocks[j]
            hidden = 0 if j == s else block.input_bytes
            transient = max(transient, hidden + block.segment_forward_peak_bytes())
            policy_transient = max(policy_transient, hidden + block.forward_peak_bytes)
            seconds += block.recompute_seconds()
            matmul_bytes += block.matmul_bytes
            policy_seconds += block.policy_recompute_seconds()
            # Recomputed under the policy, every block is kept, minus its already kept matmuls
            # (and its input, when the block before kept it as its saved output).
            kept_input = j == s or self.held[j]
            forward_high = max(forward_high, retained + (0 if kept_input else block.input_bytes)
                               + block.forward_peak_bytes)
            added, _ = self.kept(j, input_retained=kept_input)
            retained += added - block.matmul_bytes
            backward_high = max(backward_high, retained + block.output_bytes
                                + block.backward_peak_bytes + self.gradients_after[j])
            costs.transient.append(transient)
            costs.forward_seconds.append(seconds)
            costs.matmul_bytes.append(matmul_bytes)
            costs.policy_seconds.append(policy_seconds)
            policy_peak = max(self.alive[j] + forward_high, backward_high)
            if j == s and block.policy_backward_peak_bytes is not None:  # measured (simulate)
                policy_peak = self.alive[j] + block.policy_backward_peak_bytes
                costs.policy_transient.append(block.policy_transient_bytes())
            else:
                costs.policy_transient.append(policy_transient)
            costs.policy_peak.append(int(policy_peak))
        self._segments[s] = costs
        return costs

    def measured_recompute_peak(self, s: int) -> int | None:
        """The one-block segment s..s's recomputation and backward, as ``profile`` measured
        it (``simulate`` uses that instead of walking the block kept): its peak above the
        segment's retained input, its gradient alive; None when not measured."""
        measured = self.blocks[s].checkpointed_backward_peak_bytes
        return None if measured is None else self.alive[s] + measured

    def lowest_forward_peak(self, s: int) -> int:
        """The least block s's forward holds above its input as any run's first item: kept,
        in a segment, or alone under the policy."""
        block = self.blocks[s]
        lowest = min(block.forward_peak_bytes, block.segment_forward_peak_bytes())
        return min(lowest, block.policy_transient_bytes()) if self.policies else lowest


# --------------------------------------------------------------------------------------------
# The time DP over memory levels
# --------------------------------------------------------------------------------------------


class _TimeTables:
    """Least extra seconds of every run at every memory level 0..room (in units).

    ``after[s, c, m]``: the run from block s to column c's end, its first block's input not yet
    retained (a top-level run, or the rest of a segment's recomputation); ``at_input[s, e, m]``:
    the run s..e opening the recomputation of a segment s..e, whose input is retained already
    (so the run is not one segment over all of s..e); ``held[s][c, m]``, for the blocks whose
    input the block before retains when kept (``Profile.input_held``): the run from s after
    that block, its input retained already.
    """

    def __init__(self, profile: Profile, unit_bytes: int, room_bytes: int) -> None:
        self.chain = _Chain(profile)
        self.unit = unit_bytes
        self.levels = room_bytes // unit_bytes + 1
        n, levels = self.chain.n, self.levels
        # Row r of _cuts: infinity at levels below (levels - r), zero from there on: added to
        # a table row, it cuts the levels a peak does not fit (one strided view, no copies).
        steps = torch.cat([torch.full((levels,), _INF, dtype=_DTYPE), torch.zeros(levels,
                                                                                  dtype=_DTYPE)])
        self._cuts = steps.as_strided((levels + 1, levels), (1, 1))
        self.alive = torch.tensor(self.chain.alive, dtype=torch.int64)
        self.after = torch.full((n + 1, n + 1, levels), _INF, dtype=_DTYPE)
        self.at_input = torch.full((n, n, levels), _INF, dtype=_DTYPE)
        for s in range(1, n + 1):
            self.after[s, s - 1] = 0.0  # the empty run after a segment's last block
        # The empty top-level run: the head runs on what the chain retains.
        self.after[n, n, self.units(self.chain.head_bytes):] = 0.0
        self._after_rows = self.after.unbind(0)  # views, indexed once rather than per use
        self.held: dict[int, torch.Tensor] = {}
        for s in range(n - 1, -1, -1):
            self._fill(s)

    def _rest_after_keeping(self, s: int) -> torch.Tensor:
        """By column, the run after block s is kept: its input retained already when block s
        saves its output."""
        return self.held[s + 1] if self.chain.held[s + 1] else self._after_rows[s + 1]

    def _keep_first(self, s: int, input_retained: bool, columns: slice) -> torch.Tensor:
        """Block s kept as the run's first item, the rest after it, for ``columns``."""
        chain, n = self.chain, self.chain.n
        rest = self._rest_after_keeping(s)
        added, backward = chain.kept(s, input_retained)
        forward = chain.kept_transient(s, input_retained, top=False)  # what adds to alive
        keep = self._fit(
            self._shift(rest[columns], added),
            self._units_tensor(torch.clamp(self.alive[columns] + forward, min=backward)),
        )
        if chain.side[s] and columns.stop == n + 1:  # the top level: it holds side inputs
            added, backward = chain.kept(s, input_retained, top=True)
            forward = chain.kept_transient(s, input_retained, top=True)
            keep[-1:] = self._fit(
                self._shift(rest[n:], added),
                self._units_tensor(torch.tensor([max(chain.alive[n] + forward, backward)])),
            )
        return keep

    def units(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.unit)  # rounded up: a plan that fits here fits in bytes

    def _units_tensor(self, nbytes: torch.Tensor) -> torch.Tensor:
        return -torch.div(-nbytes, self.unit, rounding_mode="floor")

    def _shift(self, table: torch.Tensor, nbytes: int) -> torch.Tensor:
        """table[..., m - units(nbytes)]: the run's time when nbytes more are retained."""
        amount = self.units(nbytes)
        shifted = torch.full_like(table, _INF)
        if amount < self.levels:
            shifted[..., amount:] = table[..., : self.levels - amount]
        return shifted

    def _fit(self, table: torch.Tensor, peak_units: torch.Tensor) -> torch.Tensor:
        """table with infinity at the levels below each row's peak (in units)."""
        return table.add_(self._cuts.index_select(0, self._cut_rows(peak_units)))

    def _cut_rows(self, peak_units: torch.Tensor) -> torch.Tensor:
        return self.levels - peak_units.clamp(0, self.levels)

    def _fill(self, s: int) -> None:
        """The runs starting at block s, a few columns at a time: each column only reads the
        same column of later runs, and at most ``_GRAIN`` numbers per tensor operation keep
        every operation on this thread (see ``_GRAIN``)."""
        n = self.chain.n
        if self.chain.held[s]:
            self.held[s] = torch.full((n + 1, self.levels), _INF, dtype=_DTYPE)
            if s > 0:
                self.held[s][s - 1] = 0.0  # the empty run after a segment's last block
        width = max(1, _GRAIN // self.levels)
        for first in range(s, n + 1, width):
            self._fill_columns(s, slice(first, min(n + 1, first + width)))

    def _fill_columns(self, s: int, columns: slice) -> None:
        chain, n, levels = self.chain, self.chain.n, self.levels
        c0, c1 = columns.start, columns.stop
        keep_after = self._keep_first(s, False, columns)
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
            at_input[s, : min(self.units(measured), levels)] = _INF
        # Segments s..j, on levels above the segment's retained input (shifted in at the end).
        segments_after = torch.full((c1 - c0, levels), _INF, dtype=_DTYPE)
        costs = chain.segments(s)
        for j in range(s, min(chain.limit[s], c1 - 1) + 1):
            k = j - s
            low = max(j, c0)  # the columns segment s..j can end a run at, in this chunk
            rest = self._after_rows[j + 1][low:c1]  # column j: the empty rest
            options = rest + (at_input[j] + costs.forward_seconds[k])
            self._cut_first_forward(options, s, j, low, costs.transient[k])
            if chain.policies and k == 0 and c1 == n + 1:
                # Top-level runs only (column n). Inside another segment the engine keeps a
                # policy's outputs from that segment's first forward on, which no prediction
                # counts.
                self._offer_policy(options[-1], s, j)
            # Inside a segment s..e, a child s..j must be shorter: only e > j.
            later = slice(max(j + 1, c0), min(c1, n))
            if later.start < later.stop:
                torch.minimum(at_input[later], options[later.start - low: later.stop - low],
                              out=at_input[later])
            side = chain.segment_side_bytes(s, j)
            if side and c1 == n + 1:  # the top-level column: the segment holds side inputs
                options[-1:] = self._shift(options[-1:], side)
            if low == j < n:  # column j: a child ending where its segment ends (none: module)
                options[0] = _INF
            torch.minimum(segments_after[low - c0:], options, out=segments_after[low - c0:])
        self.after[s, columns] = torch.minimum(
            keep_after, self._shift(segments_after, chain.blocks[s].input_bytes)
        )
        if chain.held[s]:  # after block s - 1 kept: its input, and a segment's, comes free
            self.held[s][columns] = torch.minimum(keep_retained, segments_after)

    def _cut_first_forward(
        self, options: torch.Tensor, s: int, j: int, low: int, transient: int
    ) -> None:
        """Infinity where segment s..j's first forward (alive + ``transient``) does not fit,
        in ``options``: columns ``low``.. of runs that open with that segment."""
        chain, n = self.chain, self.chain.n
        # The empty rest (column j; column n too when j is the last block): the segment's own
        # forward peak is their only limit (a measured recomputation need not peak above it).
        for column in [j, n] if j == n - 1 else [j]:
            if low <= column < low + len(options):
                options[column - low, : self.units(chain.alive[column] + transient)] = _INF
        # Non-empty rests need no cut where something already does: the recomputation's run
        # peaks at least there with its own gradient alive, a non-empty rest above its first
        # block's own.
        rest_floor = (chain.blocks[j + 1].input_bytes + chain.lowest_forward_peak(j + 1)
                      if j + 1 < n else _INF)
        first = max(j + 1, low)  # non-empty rests
        if transient > rest_floor and first < low + len(options):
            peaks = self._units_tensor(self.alive[first: low + len(options)] + transient)
            options[first - low:].add_(self._cuts.index_select(0, self._cut_rows(peaks)))

    def _offer_policy(self, top: torch.Tensor, s: int, j: int) -> None:
        """The top-level run's options (``top``, one row) with block s alone under the policy
        too, where faster: its recomputation's own peak, its first forward's, and the levels
        the outputs it keeps take."""
        chain, n, levels = self.chain, self.chain.n, self.levels
        costs = chain.segments(s)
        shift = self.units(costs.matmul_bytes[0])
        if shift >= levels:
            return
        under_policy = self._after_rows[j + 1][n] + costs.policy_seconds[0]
        peak = max(costs.policy_peak[0], chain.alive[n] + costs.policy_transient[0])
        under_policy[: self.units(peak)] = _INF
        torch.minimum(top[shift:], under_policy[: levels - shift], out=top[shift:])

    def may_miss_lowest_peak_plan(self) -> bool:
        """Whether rounding may hide a plan of the lowest peak that fits and is faster.

        The plan of least peak P peaks at no more than the table's lowest finite level (in
        units); rounded up, each of the at most 2n + 1 sizes adding up to any of its peaks
        gains under one unit. So from 2n + 1 levels above that level on, the table holds it.
        """
        if self.unit == 1:
            return False  # nothing rounded: the table is exact
        finite = torch.isfinite(self._top()).nonzero()
        if len(finite) == 0:
            return True
        return self.levels - 1 < finite[0].item() + 2 * self.chain.n + 1

    def best_plan(self) -> list[Segment] | None:
        """The fastest top-level plan at the highest level, or None when nothing fits."""
        if self.chain.n == 0 or math.isinf(self._top()[-1].item()):
            return None
        return self._run(0, self.chain.n, self.levels - 1, _HELD if self.chain.held[0] else _FRESH)

    def _top(self) -> torch.Tensor:
        """The whole chain's least extra time at each level."""
        n = self.chain.n
        return self.held[0][n] if self.chain.held[0] else self.after[0, n]

    def _run(self, s: int, column: int, level: int, start: str) -> list[Segment]:
        """Rebuild the plan a table entry stands for, choosing the best option again.
        ``start``: how the run's first input stands (``_FRESH``, ``_HELD``, ``_OPENING``)."""
        chain = self.chain
        end = chain.end(column)
        if s > end:
            return []
        if start == _OPENING and s == end and chain.measured_recompute_peak(s) is not None:
            return []  # a one-block segment's recomputation, measured: nothing to choose
        input_retained = start != _FRESH
        options: list[tuple[float, int, Segment | None, int]] = []  # time, order, item, level

        def lookup(table: torch.Tensor, first: int, col: int, at: int) -> float:
            return table[first, col, at].item() if 0 <= at < self.levels else _INF

        added, backward = chain.kept(s, input_retained, top=column == chain.n)
        if level >= self.units(max(chain.kept_forward_peak(s, input_retained, column), backward)):
            at = level - self.units(added)
            rest = self._rest_after_keeping(s)[column, at].item() if 0 <= at < self.levels else _INF
            options.append((rest, 0, None, at))
        costs = chain.segments(s)
        # Inside a segment (column < n) no child reaches the segment's end (see the module).
        last = min(end - 1 if column < chain.n else end, chain.limit[s])
        for j in range(s, last + 1):
            k = j - s
            inner = level - (0 if input_retained else self.units(chain.blocks[s].input_bytes))
            if column == chain.n:
                inner -= self.units(chain.segment_side_bytes(s, j))
            if inner >= self.units(chain.alive[column] + costs.transient[k]):
                seconds = (costs.forward_seconds[k] + lookup(self.at_input, s, j, inner)
                           + lookup(self.after, j + 1, column, inner))
                options.append((seconds, 1, Segment(s, j), inner))
            policy_level = inner - self.units(costs.matmul_bytes[k])
            if chain.policies and j == s and column == chain.n and policy_level >= self.units(
                max(chain.alive[column] + costs.policy_transient[k], costs.policy_peak[k])
            ):
                seconds = costs.policy_seconds[k] + lookup(self.after, j + 1, column, policy_level)
                options.append((seconds, 2, Segment(s, j, policy=PLANNED_POLICY), policy_level))
        seconds, _, item, rest_level = min(options, key=lambda option: option[:2])
        assert not math.isinf(seconds), "the table said this run fits"
        if item is None:
            return self._run(s + 1, column, rest_level, _HELD if chain.held[s + 1] else _FRESH)
        if item.policy is None:
            item.children = self._run(s, item.end, rest_level, _OPENING)
        return [item, *self._run(item.end + 1, column, rest_level, _FRESH)]


# --------------------------------------------------------------------------------------------
# The lowest peak, exactly in bytes
# --------------------------------------------------------------------------------------------


class _LowestPeak:
    """The same recurrences minimizing the peak instead of time, in exact bytes."""

    def __init__(self, profile: Profile) -> None:
        self.chain = chain = _Chain(profile)
        n = chain.n
        # after[s][c], at_input[s][e]: (peak, plan builder); the empty runs peak at 0.
        self.after: list[list[tuple[int, object]]] = [[(0, None)] * (n + 1) for _ in range(n + 1)]
        self.after[n][n] = (chain.head_bytes, None)  # the head runs on what the chain retains
        self.at_input: list[list[tuple[int, object]]] = [[(0, None)] * n for _ in range(n)]
        self.held: dict[int, list[tuple[int, object]]] = {}  # as _TimeTables.held
        for s in range(n - 1, -1, -1):
            self._fill(s)

    def _keep_first(self, s: int, input_retained: bool, columns: range) -> list:
        """Block s kept as the run's first item, the rest after it, for ``columns``."""
        chain = self.chain
        rest = self.held[s + 1] if chain.held[s + 1] else self.after[s + 1]
        best = []
        for c in columns:
            added, backward = chain.kept(s, input_retained, top=c == chain.n)
            peak = max(chain.kept_forward_peak(s, input_retained, c), backward,
                       added + rest[c][0])
            best.append((peak, ("keep",)))
        return best

    def _fill(self, s: int) -> None:
        chain, n, alive = self.chain, self.chain.n, self.chain.alive
        after, at_input = self.after, self.at_input
        costs = chain.segments(s)
        input_bytes = chain.blocks[s].input_bytes
        best_after = self._keep_first(s, False, range(s, n + 1))
        best_inside = self._keep_first(s, True, range(s, n))
        best_held = self._keep_first(s, True, range(s, n + 1)) if chain.held[s] else None
        measured = chain.measured_recompute_peak(s)
        if measured is not None:  # segment s..s's recomputation, as simulate counts it
            best_inside[0] = (measured, ("keep",))
        for j in range(s, chain.limit[s] + 1):
            k = j - s
            inner_peak = best_inside[k][0]  # final: children s..j' with j' < j are in
            at_input[s][j] = best_inside[k]
            for c in range(j, n + 1):
                if c == j < n:  # a child ending where its segment ends (none: see the module)
                    continue
                rest_peak = after[j + 1][c][0]
                plain = max(alive[c] + costs.transient[k], inner_peak, rest_peak)
                option = (plain, ("segment", j))
                if chain.policies and k == 0 and c == n:
                    policy = costs.matmul_bytes[k] + max(
                        alive[c] + costs.policy_transient[k], costs.policy_peak[k], rest_peak
                    )
                    if policy < plain:
                        option = (policy, ("policy", j))
                side = chain.segment_side_bytes(s, j) if c == n else 0
                if input_bytes + side + option[0] < best_after[c - s][0]:
                    best_after[c - s] = (input_bytes + side + option[0], option[1])
                if best_held is not None and side + option[0] < best_held[c - s][0]:
                    best_held[c - s] = (side + option[0], option[1])
                if j < c < n and option[0] < best_inside[c - s][0]:
                    best_inside[c - s] = option
        for c in range(s, n + 1):
            after[s][c] = best_after[c - s]
        if best_held is not None:
            self.held[s] = [(0, None)] * s + best_held

    def plan(self) -> list[Segment]:
        if self.chain.n == 0:
            return []
        return self._run(0, self.chain.n, _HELD if self.chain.held[0] else _FRESH)

    def _run(self, s: int, column: int, start: str) -> list[Segment]:
        if s > self.chain.end(column):
            return []
        table = (self.after if start == _FRESH else self.at_input if start == _OPENING
                 else self.held)
        choice = table[s][column][1]
        if choice[0] == "keep":
            return self._run(s + 1, column, _HELD if self.chain.held[s + 1] else _FRESH)
        j = choice[1]
        if choice[0] == "policy":
            item = Segment(s, j, policy=PLANNED_POLICY)
        else:
            item = Segment(s, j, self._run(s, j, _OPENING))
        return [item, *self._run(j + 1, column, _FRESH)]
