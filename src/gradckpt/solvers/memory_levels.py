"""Rows over memory levels, as the optimal solver's time tables hold them: bytes rounded up to
whole units, a row shifted by what a run's first item retains, the levels a peak does not fit
cut to infinity, and, per level, the best option offered so far and which one it is.

A row ``row[m]`` is the least extra seconds of some run in ``m`` units of memory (infinity
where it does not fit). Sizes round *up* to units, so a plan a row says fits does fit.

Example:
    >>> levels = MemoryLevels(unit_bytes=10, room_bytes=50)  # levels 0..5, 10 bytes each
    >>> row = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    >>> levels.shift(row, 15).tolist()  # 15 bytes more retained take 2 units
    [inf, inf, 0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CHOICE_DTYPE", "TIME_DTYPE", "Choices", "MemoryLevels"]

# float32: seconds need no more than 7 digits (simulate re-predicts the chosen plan in float64),
# and half the bytes buy twice the levels: finer rounding for the same memory and time.
TIME_DTYPE = torch.float32
# A choice is a block index or a negative code (chain_costs.KEEP, POLICY): the tables hold far
# fewer than 32,767 blocks (their cells grow with its square).
CHOICE_DTYPE = torch.int16
# Relative difference below which two options' exact times are the same time: what float32
# entries (2**-24 each) summed over a few hundred blocks can round apart, and far below any
# difference in time a plan makes.
SUM_ROUNDING = 1e-5


class MemoryLevels:
    """Levels 0..``count - 1`` of ``unit`` bytes each, for a room of ``room_bytes``.

    Example:
        >>> levels = MemoryLevels(unit_bytes=4, room_bytes=10)
        >>> levels.count, levels.units(9)  # 9 bytes take 3 units of 4
        (3, 3)
    """

    def __init__(self, unit_bytes: int, room_bytes: int) -> None:
        self.unit = unit_bytes
        self.count = room_bytes // unit_bytes + 1
        # Row r of _cuts: infinity at levels below (count - r), zero from there on: added to a
        # row, it cuts the levels a peak does not fit (one strided view, no copies).
        steps = torch.cat([torch.full((self.count,), torch.inf, dtype=TIME_DTYPE),
                           torch.zeros(self.count, dtype=TIME_DTYPE)])
        self._cuts = steps.as_strided((self.count + 1, self.count), (1, 1))

    def units(self, nbytes: int) -> int:
        """``nbytes`` in units, rounded up: a plan that fits here fits in bytes.

        Example:
            >>> MemoryLevels(unit_bytes=4, room_bytes=40).units(8), MemoryLevels(4, 40).units(9)
            (2, 3)
        """
        return -(-int(nbytes) // self.unit)

    def units_tensor(self, nbytes: torch.Tensor) -> torch.Tensor:
        """``units`` of each of ``nbytes``.

        Example:
            >>> MemoryLevels(unit_bytes=4, room_bytes=40).units_tensor(torch.tensor([8, 9]))
            tensor([2, 3])
        """
        return -torch.div(-nbytes, self.unit, rounding_mode="floor")

    def shift(self, table: torch.Tensor, nbytes: int) -> torch.Tensor:
        """``table[..., m - units(nbytes)]``, infinity below: a run's time when ``nbytes`` more
        are retained under it. Any dtype: a choice shifts with its time.

        Example:
            >>> MemoryLevels(unit_bytes=1, room_bytes=2).shift(torch.tensor([1.0, 2.0, 3.0]), 1)
            tensor([inf, 1., 2.])
        """
        amount = self.units(nbytes)
        fill = torch.inf if table.is_floating_point() else 0
        shifted = torch.full_like(table, fill)
        if amount < self.count:
            shifted[..., amount:] = table[..., : self.count - amount]
        return shifted

    def cuts(self, peak_units: torch.Tensor) -> torch.Tensor:
        """One row per peak (in units): infinity at the levels below it, zero from there on.

        Example:
            >>> MemoryLevels(unit_bytes=1, room_bytes=2).cuts(torch.tensor([2, 0]))
            tensor([[inf, inf, 0.],
                    [0., 0., 0.]])
        """
        return self._cuts.index_select(0, self.count - peak_units.clamp(0, self.count))

    def fit(self, table: torch.Tensor, peak_units: torch.Tensor) -> torch.Tensor:
        """``table`` (in place) with infinity at the levels below each row's peak (in units).

        Example:
            >>> levels = MemoryLevels(unit_bytes=1, room_bytes=2)
            >>> levels.fit(torch.zeros(1, 3), torch.tensor([1]))
            tensor([[inf, 0., 0.]])
        """
        return table.add_(self.cuts(peak_units))


@dataclass
class Choices:
    """Per cell of some table rows, the best option offered so far: its time as the table
    stores it (``seconds``, ``TIME_DTYPE``), its time as the plan adds it up (``exact``,
    float64) and which option it is (``what``).

    The choice compares ``exact``: the sum in float64 of the float32 entries it reads, as
    ``simulate`` adds a plan's seconds. The float32 sums round apart options of equal time
    (the same blocks recomputed, in segments split another way), which would otherwise pick
    between them. Among options of equal ``exact`` time, the one offered first stays: a later
    one replaces it only when faster by more than ``tolerance`` (relative), ``SUM_ROUNDING``
    (the last bits of sums added in another order), or the timing noise band when ``solve``
    settled the profile's times (``timing_noise``).

    Example:
        >>> kept = torch.tensor([2.0, 1.0])
        >>> best = Choices(kept, kept.double(), torch.full((2,), -1, dtype=CHOICE_DTYPE))
        >>> segment = torch.tensor([1.0, 1.0])
        >>> best.offer(segment, segment.double(), 3)  # segment ..3: faster at level 0 only
        >>> best.what.tolist(), best.seconds.tolist()
        ([3, -1], [1.0, 1.0])
    """

    seconds: torch.Tensor
    exact: torch.Tensor
    what: torch.Tensor
    # How much faster, relatively, an option must be to replace the one offered before it.
    tolerance: float = SUM_ROUNDING

    @classmethod
    def first(cls, seconds: torch.Tensor, what: int, tolerance: float = SUM_ROUNDING) -> Choices:
        """The rows of one option, offered first.

        Example:
            >>> Choices.first(torch.tensor([[1.0]]), -1).what
            tensor([[-1]], dtype=torch.int16)
        """
        return cls(seconds, seconds.double(), torch.full(seconds.shape, what, dtype=CHOICE_DTYPE),
                   tolerance)

    def offer(self, seconds: torch.Tensor, exact: torch.Tensor, what: int | torch.Tensor,
              rows: slice = slice(None)) -> None:
        """Offer an option at ``rows``: its table time ``seconds``, its ``exact`` time, and
        what it is (one for all cells, or per cell).

        Example:
            >>> best = Choices.first(torch.tensor([1.0, 1.0]), -1)
            >>> best.offer(torch.tensor([0.5]), torch.tensor([0.5], dtype=torch.float64), 0,
            ...            rows=slice(1, 2))
            >>> best.what.tolist()
            [-1, 0]
        """
        torch.minimum(self.seconds[rows], seconds, out=self.seconds[rows])
        # Better by more than the tolerance: sums of the same times added in another order (a
        # plan and its mirror) differ in their last bits, and times within the timing noise
        # are one (timing_noise.py); neither may decide between equal plans.
        better = exact < self.exact[rows] * (1 - self.tolerance)
        torch.where(better, exact, self.exact[rows], out=self.exact[rows])
        if isinstance(what, int):
            self.what[rows].masked_fill_(better, what)
        else:
            torch.where(better, what, self.what[rows], out=self.what[rows])

    def shifted(self, levels: MemoryLevels, nbytes: int) -> Choices:
        """The options with ``nbytes`` more retained under each (``MemoryLevels.shift``).

        Example:
            >>> best = Choices.first(torch.tensor([1.0, 2.0]), 4)
            >>> best.shifted(MemoryLevels(unit_bytes=1, room_bytes=1), 1).seconds
            tensor([inf, 1.])
        """
        return Choices(levels.shift(self.seconds, nbytes), levels.shift(self.exact, nbytes),
                       levels.shift(self.what, nbytes), self.tolerance)
