"""Tables and plots: how the command line shows a plan and what it measured.

So that ``str(plan)``, ``gradckpt plan`` and ``gradckpt demo`` say things the same way, the
tables the core needs live below this module and are re-exported here:

- ``format_table`` (``gradckpt.tables``): rows of text cells in aligned columns;
- ``plan_table``, ``plan_summary`` (``gradckpt.plan``): one row per block saying what happens
  to its activations, then the plan's predictions (this is ``str(plan)``);
- ``memory_breakdown_table``: what takes the memory of a step (parameters, gradients, ...),
  read against the predicted peak;
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

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .budget import format_bytes
from .errors import GradckptError
from .plan import plan_summary, plan_table
from .tables import format_table

__all__ = [
    "MemoryParts",
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


class MemoryParts(NamedTuple):
    """What takes a step's memory, part by part, and the predicted peak they are read against.

    ``parts``: (name, bytes) pairs. They are sizes, not one instant: what the forward pass keeps
    is freed as the backward pass makes the gradients, so they need not add up to the peak.
    ``outside_peak``: names of parts the peak does not count (an estimate's CUDA reserve).
    """

    parts: Sequence[tuple[str, int]]
    predicted_peak_bytes: int
    outside_peak: frozenset[str] = frozenset()


MEMORY_TABLE_TITLE = "what takes the memory (sizes; not all alive at one instant)"


def memory_breakdown_table(memory: MemoryParts, device_bytes: int | None = None) -> str:
    """What takes the memory, largest first: each part's size and share of the predicted peak
    (and of the device, given ``device_bytes``), then how the parts relate to the peak.

    Example:
        >>> parts = [("parameters", 6 * 2**20), ("logits", 20 * 2**20), ("gradients", 6 * 2**20)]
        >>> print(memory_breakdown_table(MemoryParts(parts, 26 * 2**20)))
        what takes the memory (sizes; not all alive at one instant)       size  of the predicted peak
        logits                                                       20.00 MiB                    77%
        parameters                                                    6.00 MiB                    23%
        gradients                                                     6.00 MiB                    23%
        The parts are sizes, not one instant: they add up to 32.00 MiB, more than the predicted peak
        of 26.00 MiB, since they live at different moments (what the forward pass keeps, activations
        and logits, is freed as the backward pass makes the gradients).
    """  # noqa: E501  (a table's lines are longer than code's)
    header = [MEMORY_TABLE_TITLE, "size", "of the predicted peak"]
    if device_bytes:
        header.append("of the device")
    rows = []
    for name, size in sorted(memory.parts, key=lambda part: -part[1]):
        of_peak = ("outside" if name in memory.outside_peak
                   else _share(size, memory.predicted_peak_bytes))
        row = [name, format_bytes(size), of_peak]
        if device_bytes:
            row.append(_share(size, device_bytes))
        rows.append(row)
    return f"{format_table(header, rows)}\n{parts_against_peak(memory)}"


def parts_against_peak(memory: MemoryParts) -> str:
    """How the parts add up against the predicted peak, and why they need not equal it.

    Example:
        >>> print(parts_against_peak(MemoryParts([("a", 3 * 2**20), ("b", 2**20)], 4 * 2**20)))
        The parts are sizes, not one instant: they add up to the predicted peak, 4.00 MiB.
    """
    inside = sum(size for name, size in memory.parts if name not in memory.outside_peak)
    outside = any(name in memory.outside_peak for name, _ in memory.parts)
    parts = "those inside the peak" if outside else "they"
    peak = format_bytes(memory.predicted_peak_bytes)
    if inside == memory.predicted_peak_bytes:
        relation = f"{parts} add up to the predicted peak, {peak}."
    elif inside > memory.predicted_peak_bytes:
        relation = (
            f"{parts} add up to {format_bytes(inside)}, more than the predicted peak of {peak}, "
            "since they live at different moments (what the forward pass keeps, activations and "
            "logits, is freed as the backward pass makes the gradients)."
        )
    else:
        relation = (
            f"{parts} add up to {format_bytes(inside)}, less than the predicted peak of {peak}; "
            "the rest is what the step holds briefly (temporaries, recomputed activations)."
        )
    sentence = f"The parts are sizes, not one instant: {relation}"
    return textwrap.fill(sentence, width=92)


def _share(part_bytes: int, whole_bytes: int) -> str:
    """``part_bytes`` as a percentage of ``whole_bytes``; "<1%" rather than a misleading 0%."""
    if not whole_bytes:
        return "-"
    share = part_bytes / whole_bytes
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"


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

