"""Strategy "every-layer": each block is its own checkpointed segment.

This is what Hugging Face's ``model.gradient_checkpointing_enable()`` does: the forward pass keeps
only each block's input, and the backward pass recomputes every block once, so the extra time is
one full forward pass of the chain.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}") for i in range(3)]
    >>> solve_every_layer(Profile(blocks, 1160, 1000, 9.0), None)
    [Segment(start=0, end=0, children=[], policy=None), Segment(start=1, end=1, children=[], policy=None), Segment(start=2, end=2, children=[], policy=None)]
"""  # noqa: E501

from __future__ import annotations

from ..plan import Segment
from ..profile_types import Profile

__all__ = ["solve_every_layer"]


def solve_every_layer(profile: Profile, budget_bytes: int | None) -> list[Segment]:
    """One segment per block, whatever the budget (``solve`` checks whether the plan fits).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> [(s.start, s.end) for s in solve_every_layer(Profile(blocks, 0, 0, 1.0), None)]
        [(0, 0), (1, 1), (2, 2), (3, 3)]
    """
    return [Segment(index, index) for index in range(len(profile.blocks))]
