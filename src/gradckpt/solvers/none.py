"""Strategy "none": no checkpointing; every block keeps what it saves.

The baseline every other strategy is measured against: zero extra time, the full peak.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> profile = Profile([example_block("h.0")], 1060, 1000, 4.0)
    >>> solve_none(profile, None)
    []
"""

from __future__ import annotations

from ..plan import Segment
from ..profile_types import Profile

__all__ = ["solve_none"]


def solve_none(profile: Profile, budget_bytes: int | None) -> list[Segment]:
    """No segments, whatever the budget (``solve`` checks whether the plan fits).

    Example:
        >>> from gradckpt.profile_types import Profile
        >>> solve_none(Profile([], peak_bytes=10, fixed_bytes=10, step_seconds=1.0), 5)
        []
    """
    return []
