"""Strategy "optimal": the least extra time that fits the budget, by dynamic programming.

The search space is every plan ``gradckpt.plan.simulate`` can evaluate: any blocks kept, any
runs of blocks checkpointed as segments, segments nested inside segments to any depth (each
child a proper sub-range of its parent: a child spanning its whole parent only repeats the same
recomputation), and each segment with or without ``policy="save-matmuls"``. The answer is the
plan of least predicted extra time whose predicted peak (``fixed_bytes`` + ``simulate``'s chain
peak) fits; the cost is exactly ``simulate``'s, which the tests check against brute force.

How (the "rotor" DP of Beaumont et al., "Optimal checkpointing for heterogeneous chains", with
exact byte counts instead of discretized memory): ``simulate`` walks a run of items (kept blocks
and segments) forward then backward, and each item's own peak sits on top of what the items
before it retain. So the peak of a run is ``max(first item's peak, first item's retained bytes
+ peak of the rest)``, and its time is the sum. For every sub-chain ``i..e`` in every context it
can appear in (top level, or inside a segment ending at ``e`` whose incoming gradient stays
alive, right at the segment's retained input or after it, under a policy or not), the DP keeps
the Pareto frontier of (peak bytes, matmul bytes a parent policy keeps, extra seconds) over all
its plans: the first item is either block ``i`` kept, or a segment ``i..k`` (with a policy or
not) whose recomputation is itself a sub-chain solved the same way, followed by the best plans
for ``k+1..e``. Frontiers are exact, so the answer is exactly optimal; the chosen plan is checked
once more with ``simulate`` before it is returned.

Cost: it grows steeply with the chain's length and with the budget's slack (the frontiers
grow). Measured on 2 CPU cores: 20 alike blocks in under 0.5 s and 30 in 1.5-8 s when no block
has matmul outputs (no policy to weigh); with matmul outputs, 12 blocks in about 1 s and 20 in
5-20 s. Long chains (100 blocks) need a discretized-memory DP, which this is not yet.

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

import bisect

from ..errors import UsageError
from ..plan import Segment, simulate
from ..profile_types import Profile

__all__ = ["solve_optimal", "minimum_peak_bytes", "POLICIES"]

# The op-level presets the DP may put on a segment (None: recompute everything in it).
POLICIES = (None, "save-matmuls")

# The longest chain solved: beyond it the exact search takes minutes (see Cost above), and a
# clear error beats a hang. Raising it needs the discretized-memory DP.
MAX_BLOCKS = 10


def _check_length(profile: Profile) -> None:
    if len(profile.blocks) > MAX_BLOCKS:
        raise UsageError(
            f"strategy 'optimal' solves chains of at most {MAX_BLOCKS} blocks in this version "
            f"(its exact search grows steeply); this model has {len(profile.blocks)}. Use "
            "strategy='chen-greedy' (budget-driven) or 'sqrt' instead."
        )


# A frontier entry: (peak_bytes, policy_kept_bytes, extra_seconds, items); frontiers are sorted
# by peak. ``items`` is a linked list (item, rest) of the run's items, an item being a kept
# block's index or a segment (start, end, policy, children items). Peaks are relative to what
# was retained when the run started; ``policy_kept_bytes`` sums the matmul outputs of kept blocks
# under a parent policy.


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
        (130, 4.0)
    """
    if budget_bytes is None or profile.fixed_bytes + simulate(profile, [])[0] <= budget_bytes:
        return []
    _check_length(profile)
    room_bytes = budget_bytes - profile.fixed_bytes
    frontier = _Solver(profile, room_bytes=room_bytes).top_frontier()
    if not frontier:  # nothing fits: the plan of lowest peak, for solve's BudgetError
        frontier = _Solver(profile, lowest_peak_only=True).top_frontier()
    fitting = sorted(
        (entry for entry in frontier if entry[0] <= room_bytes), key=lambda e: (e[2], e[0])
    )
    for entry in fitting:
        segments = _to_segments(entry[3])
        if simulate(profile, segments)[0] <= room_bytes:  # the cost model has the last word
            return segments
    return _to_segments(min(frontier, key=lambda e: (e[0], e[2]))[3])


def minimum_peak_bytes(profile: Profile) -> int:
    """The lowest predicted peak (``fixed_bytes`` included) of any plan in the search space.

    Example:
        >>> from gradckpt.profile_types import BlockProfile, Profile
        >>> blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0) for i in range(4)]
        >>> minimum_peak_bytes(Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=1))
        1070
    """
    if not profile.blocks:
        return profile.fixed_bytes + simulate(profile, [])[0]
    _check_length(profile)
    frontier = _Solver(profile, lowest_peak_only=True).top_frontier()
    return profile.fixed_bytes + min(entry[0] for entry in frontier)


# --------------------------------------------------------------------------------------------
# The dynamic program
# --------------------------------------------------------------------------------------------


class _Solver:
    """Frontiers of every sub-chain in every context, memoized for one profile.

    ``room_bytes``: drop plans whose chain peak exceeds it. That is safe when no item ever
    releases more than it retained (a profile whose ``saved_bytes`` cover the input and matmul
    outputs they include), since then a part's peak never exceeds the whole's; otherwise it is
    ignored. ``lowest_peak_only``: ignore time, for the lowest reachable peak.
    """

    def __init__(
        self, profile: Profile, room_bytes: int | None = None, lowest_peak_only: bool = False
    ) -> None:
        self.blocks = profile.blocks
        retains_nonnegative = all(
            b.saved_bytes >= (b.input_bytes if b.input_saved else 0) + b.matmul_bytes
            and b.input_bytes >= 0 and b.matmul_bytes >= 0
            for b in self.blocks
        )
        self.room_bytes = room_bytes if retains_nonnegative else None
        self.lowest_peak_only = lowest_peak_only
        self.policies = (
            POLICIES
            if any(b.matmul_bytes or b.matmul_seconds for b in self.blocks)
            else (None,)  # without matmuls a policy changes nothing
        )
        self.runs: dict[tuple, list[tuple]] = {}

    def top_frontier(self) -> list[tuple]:
        last = len(self.blocks) - 1
        # Fill the memo from short, late sub-chains to long, early ones, so that each lookup
        # finds what it needs and the recursion stays shallow.
        for end in range(len(self.blocks)):
            alive = self.blocks[end].output_bytes
            for start in range(end, -1, -1):
                for under_policy in (False, True):
                    self.run(start, end, False, under_policy, alive)
                    self.run(start, end, True, under_policy, alive)
        for start in range(last, -1, -1):
            self.run(start, last, False, False, 0)
        return self.run(0, last, False, False, 0)

    def run(
        self, start: int, end: int, input_retained: bool, under_policy: bool, alive: int
    ) -> list[tuple]:
        """Frontier of blocks start..end as a run of items. ``input_retained``: the run opens a
        segment's recomputation (its input is retained already, and the run may not be one
        segment over all of it); ``under_policy``: that segment has a policy; ``alive``: the
        segment's incoming gradient (0 at the top level)."""
        key = (start, end, input_retained, under_policy, alive)
        if key in self.runs:
            return self.runs[key]
        room = self.room_bytes
        candidates = []
        for local_peak, added, kept_bytes, seconds, item, next_start in self._first_items(
            start, end, input_retained, under_policy, alive
        ):
            if room is not None and local_peak > room:
                continue
            if next_start > end:
                candidates.append((local_peak, kept_bytes, seconds, (item, None)))
                continue
            # The rest's frontier is sorted by peak. Outside a policy its kept bytes are all 0
            # and its seconds fall as its peak rises, so of the rest plans that stay under this
            # item's own peak only the last (fastest) one can matter.
            below = None
            for rest_entry in self.run(next_start, end, False, under_policy, alive):
                rest_peak, rest_kept, rest_seconds, rest_items = rest_entry
                peak = added + rest_peak
                if room is not None and peak > room:
                    break
                if peak <= local_peak and not under_policy:
                    below = rest_entry
                    continue
                candidates.append((
                    max(peak, local_peak), kept_bytes + rest_kept, seconds + rest_seconds,
                    (item, rest_items),
                ))
            if below is not None:
                candidates.append((local_peak, kept_bytes, seconds + below[2], (item, below[3])))
        frontier = _pareto(candidates, self.lowest_peak_only)
        self.runs[key] = frontier
        return frontier

    def _first_items(self, start, end, input_retained, under_policy, alive):
        """Each way the run's first item can go: (its own peak, bytes it retains, matmul bytes
        its parent's policy keeps, its extra seconds, the item, where the rest starts)."""
        block = self.blocks[start]
        # Block `start` kept.
        hidden = 0 if input_retained else block.input_bytes
        added = block.saved_bytes
        if input_retained and block.input_saved:
            added -= block.input_bytes
        kept_bytes, seconds = 0, 0.0
        if under_policy:
            added -= block.matmul_bytes
            kept_bytes, seconds = block.matmul_bytes, -block.matmul_seconds
        forward_peak = alive + hidden + block.forward_peak_bytes
        backward_peak = added + block.output_bytes + block.backward_peak_bytes
        yield max(forward_peak, backward_peak), added, kept_bytes, seconds, start, start + 1

        # Segment start..seg_end, with or without a policy.
        input_added = 0 if input_retained else block.input_bytes
        transient = block.forward_peak_bytes
        forward_seconds = 0.0
        for seg_end in range(start, end + 1):
            inner_block = self.blocks[seg_end]
            if seg_end > start:
                transient = max(
                    transient, inner_block.input_bytes + inner_block.forward_peak_bytes
                )
            forward_seconds += inner_block.forward_seconds
            if input_retained and seg_end == end:
                break  # a child over its whole parent only repeats the recomputation
            gradient = inner_block.output_bytes
            for policy in self.policies:
                inner = self.run(start, seg_end, True, policy is not None, gradient)
                for inner_peak, inner_kept, inner_seconds, inner_items in inner:
                    if self.room_bytes is not None and input_added + inner_peak > self.room_bytes:
                        break  # sorted by peak: the rest peak higher still
                    seg_added = input_added + inner_kept
                    peak = max(alive + seg_added + transient, seg_added + inner_peak)
                    yield (
                        peak, seg_added, 0, forward_seconds + inner_seconds,
                        (start, seg_end, policy, inner_items), seg_end + 1,
                    )


def _pareto(candidates: list[tuple], ignore_seconds: bool = False) -> list[tuple]:
    """The entries no other entry beats on peak, policy-kept bytes and seconds at once.

    Sorted by peak, an entry survives when no earlier survivor has both fewer (or equal)
    policy-kept bytes and fewer (or equal) seconds; the survivors' (kept bytes, seconds) form a
    staircase, so that test is one binary search.
    """
    candidates.sort(key=lambda entry: (entry[0], entry[1], entry[2]))
    frontier: list[tuple] = []
    stair_kept: list[int] = []  # ascending
    stair_seconds: list[float] = []  # strictly descending
    for entry in candidates:
        kept, seconds = entry[1], 0.0 if ignore_seconds else entry[2]
        position = bisect.bisect_right(stair_kept, kept)
        if position and stair_seconds[position - 1] <= seconds:
            continue  # an entry with no more peak, kept bytes or seconds exists
        frontier.append(entry)
        # entries from `position` on have more kept bytes; drop those this one now beats
        end = position
        while end < len(stair_kept) and stair_seconds[end] >= seconds:
            end += 1
        stair_kept[position:end] = [kept]
        stair_seconds[position:end] = [seconds]
    return frontier


def _to_segments(items) -> list[Segment]:
    segments = []
    while items is not None:
        item, items = items
        if isinstance(item, tuple):
            start, end, policy, children = item
            segments.append(Segment(start, end, _to_segments(children), policy))
    return segments
