"""Tables and plots: how the command line shows a plan and what it measured.

So that ``str(plan)``, ``gradckpt plan`` and ``gradckpt demo`` say things the same way, the
tables the core needs live below this module and are re-exported here:

- ``format_table`` (``gradckpt.tables``): rows of text cells in aligned columns;
- ``plan_table``, ``plan_summary`` (``gradckpt.plan``): one row per block saying what happens
  to its activations, then the plan's predictions (this is ``str(plan)``);
- ``memory_breakdown_table``: what takes the memory of a step (parameters, gradients, ...);
- ``plot_frontier``, ``plot_memory_vs_depth``: PNG plots. They need matplotlib (the ``plot``
  extra, ``pip install 'gradckpt[plot]'``); without it they raise ``PlotsUnavailable``, which
  says so.

Example:
    >>> print(format_table(["strategy", "peak"], [["none", "275.1 MiB"], ["sqrt", "90.2 MiB"]]))
    strategy       peak
    none      275.1 MiB
    sqrt       90.2 MiB
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .budget import format_bytes
from .errors import GradckptError
from .plan import plan_summary, plan_table
from .tables import format_table

__all__ = [
    "PlotsUnavailable",
    "StrategyPoint",
    "format_table",
    "plan_table",
    "plan_summary",
    "memory_breakdown_table",
    "plot_frontier",
    "plot_memory_vs_depth",
]


class PlotsUnavailable(GradckptError):
    """Plots were asked for, but matplotlib (the ``plot`` extra) is not installed."""


class StrategyPoint(NamedTuple):
    """One plan on the memory/time plane: its label, peak memory and step-time ratio."""

    label: str
    peak_bytes: int
    time_ratio: float


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def memory_breakdown_table(parts: Sequence[tuple[str, int]]) -> str:
    """What takes the memory: each part's size and share of all parts, largest first.

    Example:
        >>> print(memory_breakdown_table([("parameters", 3 * 2**20), ("activations", 2**20)]))
        what takes the memory        size  share
        parameters               3.00 MiB    75%
        activations              1.00 MiB    25%
        all of these together    4.00 MiB   100%
    """
    total = sum(size for _, size in parts)
    rows = [
        [name, format_bytes(size), f"{size / total:.0%}" if total else "-"]
        for name, size in sorted(parts, key=lambda part: -part[1])
    ]
    rows.append(["all of these together", format_bytes(total), "100%" if total else "-"])
    return format_table(["what takes the memory", "size", "share"], rows)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or ``PlotsUnavailable`` saying how."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(
            "plots need matplotlib, which is not installed; install the plot extra: "
            "pip install 'gradckpt[plot]'"
        ) from None
    matplotlib.use("Agg")  # write files only: no display needed (servers, CI)
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_frontier(
    points: Sequence[StrategyPoint],
    path: str | Path,
    frontier: Sequence[StrategyPoint] = (),
    title: str = "Peak memory against step time",
) -> Path:
    """A PNG of each plan as a point (step-time ratio, peak memory), labeled.

    ``frontier``: predicted (time, memory) pairs of the optimal plans over a range of budgets,
    drawn as a line: the least time each memory can be had for.

    Example:
        >>> import tempfile, os
        >>> points = [StrategyPoint("none", 300 * 2**20, 1.0),
        ...           StrategyPoint("every-layer", 60 * 2**20, 1.4)]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = plot_frontier(points, os.path.join(folder, "frontier.png"))
        ...     open(path, "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
        True
    """
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(6.4, 4.4), dpi=100)
    if frontier:
        ordered = sorted(frontier, key=lambda point: point.time_ratio)
        axes.step(
            [point.time_ratio for point in ordered],
            [point.peak_bytes / 2**20 for point in ordered],
            where="post",
            color="0.6",
            linestyle="--",
            label="optimal, any budget (predicted)",
        )
    for point in points:
        axes.plot(point.time_ratio, point.peak_bytes / 2**20, "o", markersize=7)
        axes.annotate(
            point.label,
            (point.time_ratio, point.peak_bytes / 2**20),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=8,
        )
    axes.set_xlabel("step time (x the step without checkpointing)")
    axes.set_ylabel("peak memory of a training step (MiB)")
    axes.set_ylim(bottom=0)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    if frontier:
        axes.legend(fontsize=8)
    return _save(figure, pyplot, path)


def plot_memory_vs_depth(
    depths: Sequence[int],
    memory_by_strategy: dict[str, Sequence[float]],
    path: str | Path,
    measured_by_strategy: dict[str, Sequence[tuple[int, float]]] | None = None,
    title: str = "Activation memory against depth",
) -> Path:
    """A PNG, log-log, of activation memory (blocks' worth) against chain length per strategy.

    ``memory_by_strategy`` holds one value per depth (computed); ``measured_by_strategy``
    optional (depth, value) pairs drawn as hollow markers on top.

    Example:
        >>> import tempfile, os
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = plot_memory_vs_depth([4, 16, 64], {"none": [4, 16, 64], "sqrt": [4, 8, 16]},
        ...                                 os.path.join(folder, "depth.png"))
        ...     path.stat().st_size > 0
        True
    """
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(6.4, 4.4), dpi=100)
    measured_by_strategy = measured_by_strategy or {}
    for strategy, memory in memory_by_strategy.items():
        (line,) = axes.plot(depths, memory, marker=".", label=strategy)
        measured = measured_by_strategy.get(strategy, ())
        if measured:
            axes.plot(
                [depth for depth, _ in measured],
                [value for _, value in measured],
                "o",
                markerfacecolor="none",
                color=line.get_color(),
                markersize=9,
            )
    if measured_by_strategy:
        axes.plot([], [], "o", markerfacecolor="none", color="0.3", label="measured")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("blocks in the chain (n)")
    axes.set_ylabel("activation memory (blocks' worth)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8)
    return _save(figure, pyplot, path)


def _save(figure: Any, pyplot: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, format="png")
    pyplot.close(figure)  # figures stay alive in pyplot's registry until closed
    return path

