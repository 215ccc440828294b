"""The optimal solver's time tables: the least extra time of every run of the chain at every
memory level, each entry's choice recorded while filling, and the plan read back from those
choices, never chosen again. ``optimal`` sizes them (``table_resolution``) and weighs what they
hold against a few exactly-checked candidates.

How: the "rotor" dynamic program of Beaumont et al. ("Optimal checkpointing for heterogeneous
chains", 2019). ``simulate`` walks a run of items (kept blocks and segments) forward, then
backward; each item's own peak sits on top of what the items before it retain, so a run whose
first item retains ``a`` bytes fits in ``m`` bytes when its first item's own peak does and the
rest fits in ``m - a``. The tables, for n blocks, memory levels m = 0..M (in units:
``table_resolution``), runs indexed as ``chain_costs`` says (column c < n: inside a segment
ending at c; c = n: the top level), filled from the last block back:

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

The tables are filled for the room plus a headroom of levels (``table_resolution``) and read
from the top level down, ``simulate`` checking each plan read (``fastest_within``). Steps that
differ only after the chain (``optimal.same_chain``: their output heads) share one set of
tables, a top-level column each (n, n + 1, ...), each holding what that step's own tables would.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> profile = Profile([example_block(f"h.{i}") for i in range(4)], 1210, 1000, 12.0)
    >>> tables = _TimeTables(profile, unit_bytes=1, room_bytes=120)
    >>> [(segment.start, segment.end) for segment in tables.best_plan()]  # 120 bytes for the chain
    [(0, 1)]
"""

from __future__ import annotations

import math

import torch

from ..cost import simulate
from ..plan import Segment
from ..profile_types import Profile
from .chain_costs import FRESH, KEEP, OPENING, POLICY, ChainCosts, menu_choice, menu_index
from .memory_levels import CHOICE_DTYPE, SUM_ROUNDING, TIME_DTYPE, Choices, MemoryLevels

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
