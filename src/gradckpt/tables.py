"""Aligned text tables: the building block of every table gradckpt prints.

Example:
    >>> print(format_table(["strategy", "peak"], [["none", "275.1 MiB"], ["sqrt", "90.2 MiB"]]))
    strategy       peak
    none      275.1 MiB
    sqrt       90.2 MiB
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["format_count", "format_table"]


def format_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], align: str | None = None
) -> str:
    """Cells in columns two spaces apart; ``align`` has an ``l`` or ``r`` per column.

    The default aligns the first column left and the others right (labels, then numbers).

    Example:
        >>> print(format_table(["n", "memory"], [["4", "4.0"], ["100", "15.2"]], align="rl"))
          n  memory
          4  4.0
        100  15.2
    """
    rows = [list(header), *(list(row) for row in rows)]
    columns = len(header)
    align = align or "l" + "r" * (columns - 1)
    if len(align) != columns or any(len(row) != columns for row in rows):
        raise ValueError(f"every row and align must have {columns} columns, as the header has")
    widths = [max(len(row[column]) for row in rows) for column in range(columns)]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if side == "l" else cell.rjust(width)
            for cell, width, side in zip(row, widths, align, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def format_count(n: int) -> str:
    """A count as people say it: 8.03B parameters, 124M, 1.05K.

    Example:
        >>> format_count(8_030_261_248), format_count(124_439_808), format_count(512)
        ('8.03B', '124M', '512')
    """
    for size, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)
