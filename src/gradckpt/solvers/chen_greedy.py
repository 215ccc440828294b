"""Strategy "chen-greedy": Chen et al. 2016's budget-driven greedy segmentation.

"Training Deep Nets with Sublinear Memory Cost", section 4.3: walk the chain adding up the bytes
each block saves; when the running total exceeds a threshold ``b``, close a segment at that block
and start again from zero (and at a chain break: encoder to decoder). A small ``b`` gives many
short segments (little memory in backward, many kept inputs); a large one gives few long
segments. Chen searches over ``b``; here every
threshold at which the greedy's answer changes is tried (the sums of saved bytes over runs of
consecutive blocks; a geometric grid of them for long chains), each plan is judged by
``simulate``, and the fastest one that fits the budget wins. Keeping everything (no segments) is
a candidate too, so a budget the model meets without checkpointing costs nothing.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}") for i in range(4)]
    >>> profile = Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=12.0)
    >>> [(s.start, s.end) for s in solve_chen_greedy(profile, 1120)]
    [(0, 1), (2, 3)]
"""

from __future__ import annotations

from ..cost import simulate
from ..plan import Segment
from ..profile_types import Profile

__all__ = ["solve_chen_greedy", "greedy_segments", "candidate_plans", "minimum_peak_bytes"]

# Above this many distinct thresholds, try a geometric grid of them instead of all.
_MAX_THRESHOLDS = 2000


def greedy_segments(profile: Profile, threshold_bytes: int) -> list[Segment]:
    """Chen's greedy pass for one threshold: close a segment once its saved bytes exceed it.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(5)]
        >>> [(s.start, s.end) for s in greedy_segments(Profile(blocks, 0, 0, 1.0), 60)]
        [(0, 1), (2, 3), (4, 4)]
    """
    segments = []
    start = 0
    running_bytes = 0
    breaks = set(profile.chain_breaks)
    for index, block in enumerate(profile.blocks):
        if index in breaks and start < index:  # no segment spans a chain break
            segments.append(Segment(start, index - 1))
            start, running_bytes = index, 0
        running_bytes += block.saved_bytes
        if running_bytes > threshold_bytes:
            segments.append(Segment(start, index))
            start, running_bytes = index + 1, 0
    if start < len(profile.blocks):
        segments.append(Segment(start, len(profile.blocks) - 1))
    return segments


def candidate_plans(profile: Profile) -> list[list[Segment]]:
    """Every distinct plan the greedy makes over the thresholds searched, plus no segments.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> [[(s.start, s.end) for s in plan] for plan in candidate_plans(Profile(blocks, 0, 0, 1))]
        [[], [(0, 0), (1, 1), (2, 2), (3, 3)], [(0, 1), (2, 3)], [(0, 2), (3, 3)], [(0, 3)]]
    """
    saved = [block.saved_bytes for block in profile.blocks]
    # The greedy's answer only changes where the threshold crosses the saved bytes of some run of
    # consecutive blocks, so those sums (and one below the smallest) are all it needs to try.
    run_sums = set()
    for start in range(len(saved)):
        total = 0
        for index in range(start, len(saved)):
            total += saved[index]
            run_sums.add(total)
    thresholds = sorted(run_sums | {min(run_sums, default=0) - 1})
    if len(thresholds) > _MAX_THRESHOLDS:
        step = len(thresholds) / _MAX_THRESHOLDS
        thresholds = [thresholds[int(i * step)] for i in range(_MAX_THRESHOLDS)] + thresholds[-1:]
    plans: list[list[Segment]] = [[]]
    seen = set()
    for threshold in thresholds:
        segments = greedy_segments(profile, threshold)
        key = tuple((s.start, s.end) for s in segments)
        if key not in seen:
            seen.add(key)
            plans.append(segments)
    return plans


def solve_chen_greedy(profile: Profile, budget_bytes: int | None) -> list[Segment]:
    """The fastest candidate plan whose predicted peak (``fixed_bytes`` + chain peak) fits.

    With no plan fitting, returns the one with the lowest peak (``solve`` then raises
    ``BudgetError``); ``budget_bytes=None`` means no limit (no segments).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> profile = Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=12.0)
        >>> solve_chen_greedy(profile, 2000)  # fits without checkpointing
        []
    """
    best_fitting = None  # (extra_seconds, segment count, plan)
    lowest_peak = None  # (peak, extra_seconds, plan)
    for segments in candidate_plans(profile):
        chain_peak_bytes, extra_seconds = simulate(profile, segments)
        peak_bytes = profile.fixed_bytes + chain_peak_bytes
        if budget_bytes is None or peak_bytes <= budget_bytes:
            key = (extra_seconds, len(segments))
            if best_fitting is None or key < best_fitting[:2]:
                best_fitting = (extra_seconds, len(segments), segments)
        if lowest_peak is None or (peak_bytes, extra_seconds) < lowest_peak[:2]:
            lowest_peak = (peak_bytes, extra_seconds, segments)
    if best_fitting is not None:
        return best_fitting[2]
    return lowest_peak[2] if lowest_peak is not None else []


def minimum_peak_bytes(profile: Profile) -> int:
    """The lowest predicted peak (``fixed_bytes`` included) any candidate plan reaches.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> minimum_peak_bytes(Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=1))
        1090
    """
    return profile.fixed_bytes + min(
        simulate(profile, segments)[0] for segments in candidate_plans(profile)
    )
