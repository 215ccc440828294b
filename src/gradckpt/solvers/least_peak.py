"""The plan of least predicted peak, exactly in bytes: what ``BudgetError.minimum_bytes`` of the
optimal strategy reports, and the candidate ``solve_optimal`` adds where rounding its time
tables to memory units may hide it.

The runs are those of the time tables (``optimal``; ``chain_costs`` indexes them), minimizing
the peak instead of the time, so without memory levels; among runs of equal peak, the one of
least extra time (so the least budget gets a fast plan of that peak, not the first one found).
Each entry is a triple (least peak in bytes, its extra seconds, what the run's first item is:
``KEEP``, ``POLICY`` or segment s..j as j), recorded while filling; ``_LeastPeak.plan``
rebuilds the plan by reading them:

- ``after[s][c]``: the run from block s to column c's end, block s's input not retained yet;
- ``at_input[s][e]``: the run s..e opening the recomputation of segment s..e, its input
  retained (no child reaching e);
- ``held[s][c]``, where ``Profile.input_held(s)``: the run from s after block s - 1 is kept,
  block s's input retained already.

A segment's first item peaks at the most of its first forward on what is alive, its
recomputation's run and the rest's run; a kept block at the most of its forward, its backward
and what it retains under the rest's run.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> profile = Profile([example_block(f"h.{i}") for i in range(4)], 1210, 1000, 12.0)
    >>> [(segment.start, segment.end) for segment in lowest_peak_plan(profile)]
    [(0, 2)]
"""

from __future__ import annotations

from ..cost import simulate
from ..plan import Segment
from ..profile_types import Profile
from .chain_costs import FRESH, KEEP, OPENING, POLICY, ChainCosts, menu_choice, menu_index

__all__ = ["lowest_peak_plan", "minimum_peak_bytes"]

# A table entry: (least peak in bytes, extra seconds, what the run's first item is); entries
# compare by their first two, the least peak first, then the least time.
_Entry = tuple[int, float, int]


def minimum_peak_bytes(profile: Profile) -> int:
    """The lowest predicted peak (``fixed_bytes`` included) of any plan in the search space.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> profile = Profile([example_block(f"h.{i}") for i in range(4)], 1210, 1000, 12.0)
        >>> minimum_peak_bytes(profile)  # blocks 0..2 as one segment, block 3 kept
        1070
    """
    return profile.fixed_bytes + simulate(profile, lowest_peak_plan(profile))[0]


def lowest_peak_plan(profile: Profile) -> list[Segment]:
    """The plan of lowest peak: the DP's, or none at all. The DP counts side inputs no block
    saves as any plan with a segment holds them; the plan without one frees them after the
    forward, and can be the lowest (a chain whose peak lies outside it).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> lowest_peak_plan(Profile([example_block(saved_bytes=10)], 0, 0, 1.0))  # no gain
        []
    """
    plan = _LeastPeak(profile).plan()
    if plan and simulate(profile, [])[0] <= simulate(profile, plan)[0]:
        return []
    return plan


class _LeastPeak:
    """The tables of the module, filled from the last block back."""

    def __init__(self, profile: Profile) -> None:
        self.chain = chain = ChainCosts(profile)
        n = chain.n
        # The empty runs peak at 0, but the top-level one: the head runs on what the chain
        # retains.
        self.after: list[list[_Entry]] = [[(0, 0.0, KEEP)] * (n + 1) for _ in range(n + 1)]
        self.after[n][n] = (chain.head_bytes, 0.0, KEEP)
        self.at_input: list[list[_Entry]] = [[(0, 0.0, KEEP)] * n for _ in range(n)]
        self.held: dict[int, list[_Entry]] = {}
        for s in range(n - 1, -1, -1):
            self._fill(s)

    def _keep_first(self, s: int, input_retained: bool, columns: range) -> list[_Entry]:
        """Block s kept as the run's first item, the rest after it, for ``columns``."""
        chain = self.chain
        rest = self.held[s + 1] if chain.held[s + 1] else self.after[s + 1]
        best = []
        for c in columns:
            added, backward = chain.kept(s, input_retained, top=c == chain.n)
            peak = max(chain.kept_forward_peak(s, input_retained, c), backward,
                       added + rest[c][0])
            best.append((peak, rest[c][1], KEEP))
        return best

    def _fill(self, s: int) -> None:
        """The runs starting at block s: block s kept, then each segment s..j in turn (of equal
        peaks the faster; of equal peaks and times, the earlier option)."""
        chain, n, alive = self.chain, self.chain.n, self.chain.alive
        costs = chain.segments(s)
        input_bytes = chain.blocks[s].input_bytes
        best_after = self._keep_first(s, False, range(s, n + 1))  # index c - s
        best_inside = self._keep_first(s, True, range(s, n))
        best_held = self._keep_first(s, True, range(s, n + 1)) if chain.held[s] else None
        measured = chain.measured_recompute_peak(s)
        if measured is not None:  # segment s..s's recomputation, as simulate counts it
            best_inside[0] = (measured, 0.0, KEEP)
        for j in range(s, chain.limit[s] + 1):
            k = j - s
            inner_peak, inner_seconds, _ = best_inside[k]  # final: children s..j' < j are in
            self.at_input[s][j] = best_inside[k]
            for c in range(j, n + 1):
                if c == j < n:  # a child ending where its segment ends (none: see optimal)
                    continue
                rest_peak, rest_seconds, _ = self.after[j + 1][c]
                plain = max(alive[c] + costs.transient[k], inner_peak, rest_peak)
                option = (plain, costs.forward_seconds[k] + inner_seconds + rest_seconds, j)
                if chain.policies and k == 0 and c == n:
                    for index, choice in enumerate(chain.menu(s)):
                        policy = (choice.kept_bytes
                                  + max(alive[c] + choice.transient, choice.peak, rest_peak),
                                  choice.extra_seconds + rest_seconds, menu_choice(index))
                        if policy[:2] < option[:2]:
                            option = policy
                peak, seconds, what = option
                side = chain.segment_side_bytes(s, j) if c == n else 0
                outside = (input_bytes + side + peak, seconds, what)
                if outside[:2] < best_after[c - s][:2]:
                    best_after[c - s] = outside
                if best_held is not None and (side + peak, seconds) < best_held[c - s][:2]:
                    best_held[c - s] = (side + peak, seconds, what)
                if j < c < n and option[:2] < best_inside[c - s][:2]:
                    best_inside[c - s] = option
        for c in range(s, n + 1):
            self.after[s][c] = best_after[c - s]
        if best_held is not None:
            self.held[s] = [(0, 0.0, KEEP)] * s + best_held

    def plan(self) -> list[Segment]:
        """The whole chain's plan, read from the tables."""
        if self.chain.n == 0:
            return []
        return self._rebuild(0, self.chain.n, self.chain.start_after_keeping(0))

    def _rebuild(self, s: int, column: int, start: str) -> list[Segment]:
        """The plan of the run from block s in ``column``, its first input as ``start`` says."""
        chain = self.chain
        if s > chain.end(column):
            return []
        table = self.after if start == FRESH else self.at_input if start == OPENING else self.held
        what = table[s][column][2]
        if what == KEEP:
            return self._rebuild(s + 1, column, chain.start_after_keeping(s + 1))
        if what <= POLICY:
            item = Segment(s, s, policy=chain.menu(s)[menu_index(what)].policy)
        else:
            item = Segment(s, what, self._rebuild(s, what, OPENING))
        return [item, *self._rebuild(item.end + 1, column, FRESH)]
