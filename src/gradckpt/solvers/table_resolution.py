"""How finely the optimal solver's time tables count memory: the bytes one memory level
stands for (``memory_unit_bytes``), how many levels the tables of a chain have at most
(``levels_for``) and how many they get above the room when sizes are rounded
(``headroom_levels``).

Memory is counted in units: 1 byte when the room left for the chain is at most
``levels_for(n)`` bytes (up to 2,000 levels; fewer for long chains, so each table stays near
48 MB of float32: 1,176 for 100 blocks), else the room over that many levels less a headroom
(``headroom_levels``: 2n + 1 levels, a quarter at most). Every size is rounded *up* to whole
units, so a plan the table says fits in the room does fit; the tables are filled for the room
plus the headroom, where every plan that fits in bytes lies (a peak adds up at most 2n + 1
rounded sizes), and read from the top level down, ``simulate`` checking each plan read
(``time_tables``, ``fastest_within``).

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> profile = Profile([example_block(f"h.{i}") for i in range(8)], 0, 0, 1.0)
    >>> memory_unit_bytes(profile, 1500)  # a small room: counted byte by byte
    1
    >>> levels_for(8), headroom_levels(8), memory_unit_bytes(profile, 10**6)  # 10**6 / 1983
    (2000, 17, 505)
"""

from __future__ import annotations

from ..profile_types import Profile

__all__ = ["memory_unit_bytes", "levels_for", "headroom_levels"]

# Memory levels of the time tables: at most _MAX_LEVELS, and about _TABLE_CELLS cells per table
# ((n + 1)^2 runs x levels) so long chains stay fast and small; never fewer than _MIN_LEVELS.
_MAX_LEVELS = 2000
_MIN_LEVELS = 100
_TABLE_CELLS = 12_000_000


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
