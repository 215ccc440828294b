"""Strategy "sqrt": Chen et al. 2016's segments of about sqrt(n) blocks.

"Training Deep Nets with Sublinear Memory Cost" (section 4.1): split a chain of n blocks into
consecutive segments of ``ceil(sqrt(n))`` blocks and checkpoint each one as a region. The forward
pass keeps one input per segment (about sqrt(n) of them) and the backward pass recomputes one
segment at a time (at most sqrt(n) blocks' saved tensors), so activation memory grows with
sqrt(n) instead of n, for one extra forward pass. The budget is ignored. A segment that spans
a chain break (``Profile.chain_breaks``: encoder to decoder) is cut there.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}") for i in range(10)]
    >>> [(s.start, s.end) for s in solve_sqrt(Profile(blocks, 0, 0, 1.0), None)]
    [(0, 3), (4, 7), (8, 9)]
"""

from __future__ import annotations

import math

from ..plan import Segment, split_at_chain_breaks
from ..profile_types import Profile

__all__ = ["solve_sqrt"]


def solve_sqrt(profile: Profile, budget_bytes: int | None) -> list[Segment]:
    """Consecutive segments of ``ceil(sqrt(n))`` blocks (the last one may be shorter).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(100)]
        >>> len(solve_sqrt(Profile(blocks, 0, 0, 1.0), None))  # 10 checkpoints for 100 blocks
        10
    """
    block_count = len(profile.blocks)
    if block_count == 0:
        return []
    segment_length = math.isqrt(block_count - 1) + 1  # ceil(sqrt(n)) without float rounding
    segments = [
        Segment(start, min(start + segment_length, block_count) - 1)
        for start in range(0, block_count, segment_length)
    ]
    # Where the chain breaks (encoder to decoder), a segment must be cut in two.
    return split_at_chain_breaks(segments, profile)
