"""The PNG plots of ``gradckpt demo`` and ``gradckpt plan --plot``: each plan on the
memory/time plane against the optimal frontier (``draw_frontier``), and activation memory and
extra forward passes against depth (``draw_memory_vs_depth``). Each ``draw_*`` returns what the
matching ``plot_*`` writes, so tests check the data drawn rather than pixels. They need
matplotlib (the ``plot`` extra); without it they raise ``PlotsUnavailable``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import GradckptError
from .labels import LabelPlacement, place_labels

__all__ = [
    "FrontierDrawing",
    "PlotsUnavailable",
    "StrategyPoint",
    "draw_frontier",
    "draw_memory_vs_depth",
    "frontier_staircase",
    "plot_frontier",
    "plot_memory_vs_depth",
]


class PlotsUnavailable(GradckptError):
    """Plots were asked for, but matplotlib (the ``plot`` extra) is not installed."""


class StrategyPoint(NamedTuple):
    """One plan on the memory/time plane: its label, predicted peak memory and step-time ratio,
    and, for a plan that was run, the measured ones."""

    label: str
    peak_bytes: int
    time_ratio: float
    measured_peak_bytes: int | None = None
    measured_time_ratio: float | None = None


def _figure(**kwargs: Any) -> Any:
    """A matplotlib figure drawn by Agg (files only: no display, no pyplot registry to leak
    figures into), or ``PlotsUnavailable`` saying how to get matplotlib."""
    try:  # from the package itself: it tells whether matplotlib is there, its modules may not
        from matplotlib import figure
        from matplotlib.backends import backend_agg
    except ImportError:
        raise PlotsUnavailable(
            "plots need matplotlib, which is not installed; install the plot extra: "
            "pip install 'gradckpt[plot]'"
        ) from None
    drawing = figure.Figure(**kwargs)
    backend_agg.FigureCanvasAgg(drawing)  # the canvas measures text (label placement), writes
    return drawing


class FrontierDrawing(NamedTuple):
    """What ``plot_frontier`` writes: the figure, the optimal frontier's staircase as drawn
    ((step-time ratio, peak bytes) vertices), the plans and where their labels went."""

    figure: Any
    line: list[tuple[float, int]]
    points: list[StrategyPoint]
    labels: list[LabelPlacement]


def frontier_staircase(frontier: Sequence[StrategyPoint]) -> list[tuple[float, int]]:
    """The vertices of the optimal frontier as a staircase, fastest plan first: at each step
    time, the least peak a plan that fast reaches. A point slower than another yet no smaller
    is not on the frontier and is left out.

    Example:
        >>> frontier_staircase([StrategyPoint("optimal", 100, 1.0),
        ...                     StrategyPoint("optimal", 70, 1.3),
        ...                     StrategyPoint("optimal", 60, 1.2)])
        [(1.0, 100), (1.2, 100), (1.2, 60)]
    """
    vertices: list[tuple[float, int]] = []
    for point in sorted(frontier, key=lambda point: (point.time_ratio, point.peak_bytes)):
        if vertices and point.peak_bytes >= vertices[-1][1]:
            continue
        if vertices:
            vertices.append((point.time_ratio, vertices[-1][1]))  # across, then down
        vertices.append((point.time_ratio, point.peak_bytes))
    return vertices


def draw_frontier(
    points: Sequence[StrategyPoint],
    frontier: Sequence[StrategyPoint] = (),
    title: str = "Peak memory against step time",
) -> FrontierDrawing:
    """The figure ``plot_frontier`` saves, with what it draws: each plan's predicted point
    (hollow), its measured point where it has one (filled, joined to the predicted), the optimal
    frontier's staircase, and each plan's label placed where it overlaps no other label,
    marker or the legend.

    Example:
        >>> drawing = draw_frontier([StrategyPoint("none", 300 * 2**20, 1.0, 290 * 2**20, 1.0),
        ...                          StrategyPoint("sqrt", 60 * 2**20, 1.4)],
        ...                         frontier=[StrategyPoint("optimal", 300 * 2**20, 1.0),
        ...                                   StrategyPoint("optimal", 55 * 2**20, 1.3)])
        >>> drawing.line[-1][1] / 2**20, [label.text for label in drawing.labels]
        (55.0, ['none', 'sqrt'])
    """
    figure = _figure(figsize=(6.4, 4.6), dpi=100)
    axes = figure.subplots()
    line = frontier_staircase(frontier)
    paths: list[Any] = []  # (x, y) polylines in data coordinates: labels had better not cross
    legend_lines = []
    if line:
        legend_lines += axes.plot(*_mebibyte_series(line), color="0.55", linestyle="--",
                                  linewidth=1.2, label="optimal at each memory (predicted)")
        paths.append(_mebibyte_series(line))
    markers, anchors = [], []
    for index, point in enumerate(points):
        color = f"C{index % 10}"
        marks, joint = _draw_plan(axes, point, color)
        markers += marks
        paths += [joint] if joint else []
        anchors.append((point.label, marks[-1], color))  # the measured point, if measured
    _frame_frontier_axes(axes, line, markers, title)
    _frontier_legend(axes, points, legend_lines)
    figure.tight_layout()
    figure.canvas.draw()  # fixes the layout and the legend: the labels are placed against them
    labels = place_labels(axes, anchors, markers, paths)
    return FrontierDrawing(figure, line, list(points), labels)


def plot_frontier(
    points: Sequence[StrategyPoint],
    path: str | Path,
    frontier: Sequence[StrategyPoint] = (),
    title: str = "Peak memory against step time",
) -> Path:
    """A PNG of each plan as a point (step-time ratio, peak memory), labeled (``draw_frontier``).

    ``frontier``: predicted (time, memory) pairs of the optimal plans from the least peak to no
    limit, drawn as a staircase: the least memory each step time can be had for.

    Example:
        >>> import tempfile, os
        >>> points = [StrategyPoint("none", 300 * 2**20, 1.0),
        ...           StrategyPoint("every-layer", 60 * 2**20, 1.4)]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = plot_frontier(points, os.path.join(folder, "frontier.png"))
        ...     open(path, "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
        True
    """
    drawing = draw_frontier(points, frontier, title)
    return _save(drawing.figure, path, lay_out=False)  # the labels were placed in this layout


def _draw_plan(
    axes: Any, point: StrategyPoint, color: str
) -> tuple[list[tuple[float, float]], tuple[list[float], list[float]] | None]:
    """A plan's predicted point (hollow) and, if it was run, its measured point (filled) joined
    to it by a dotted line; returns the points drawn, predicted first, and the joint."""
    predicted = (point.time_ratio, point.peak_bytes / 2**20)
    axes.plot(*predicted, "o", markersize=8, markerfacecolor="white", color=color,
              markeredgewidth=1.6, zorder=3)
    if point.measured_peak_bytes is None or point.measured_time_ratio is None:
        return [predicted], None
    measured = (point.measured_time_ratio, point.measured_peak_bytes / 2**20)
    joint = ([predicted[0], measured[0]], [predicted[1], measured[1]])
    axes.plot(*joint, color=color, linewidth=1, linestyle=":", zorder=2)
    axes.plot(*measured, "o", markersize=7, color=color, zorder=4)
    return [predicted, measured], joint


def _mebibyte_series(vertices: Sequence[tuple[float, int]]) -> tuple[list[float], list[float]]:
    return [time for time, _ in vertices], [peak / 2**20 for _, peak in vertices]


def _frame_frontier_axes(
    axes: Any, line: list[tuple[float, int]], markers: list[tuple[float, float]], title: str
) -> None:
    """Axes' names and limits: from zero memory, with room on the right for labels."""
    times = [time for time, _ in markers] + [time for time, _ in line]
    if times:
        highest = max([mib for _, mib in markers] + [peak / 2**20 for _, peak in line])
        span = max(times) - min(times) or 0.5
        axes.set_xlim(min(times) - 0.06 * span, max(times) + 0.18 * span)
        axes.set_ylim(0, highest * 1.12)
    axes.set_xlabel("step time (x the step without checkpointing)")
    axes.set_ylabel("peak memory of a training step (MiB)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)


def _frontier_legend(axes: Any, points: Sequence[StrategyPoint], handles: list[Any]) -> None:
    """What the marks mean, in grey: the frontier, hollow = predicted, filled = measured."""
    grey = {"color": "0.35", "linestyle": "none", "marker": "o"}
    handles.append(axes.plot([], [], markerfacecolor="white", markersize=8,
                             markeredgewidth=1.6, label="each plan, predicted", **grey)[0])
    if any(point.measured_peak_bytes is not None for point in points):
        handles.append(axes.plot([], [], markersize=7, label="the same plan, measured",
                                 **grey)[0])
    axes.legend(handles=handles, loc="upper right", fontsize=8)


def draw_memory_vs_depth(
    depths: Sequence[int],
    memory_by_strategy: dict[str, Sequence[float]],
    measured_by_strategy: dict[str, Sequence[tuple[int, float]]] | None = None,
    extra_forwards_by_strategy: dict[str, Sequence[float]] | None = None,
    title: str = "Activation memory against depth",
) -> Any:
    """The figure ``plot_memory_vs_depth`` saves: memory per strategy against depth, log-log;
    given ``extra_forwards_by_strategy``, below it on the same depths the extra forward passes
    each strategy pays for that memory (``figure.axes[1]``, one line per strategy, in order).

    Example:
        >>> figure = draw_memory_vs_depth([4, 16], {"none": [4, 16], "sqrt": [3, 6]},
        ...                               extra_forwards_by_strategy={"none": [0, 0],
        ...                                                           "sqrt": [1, 1]})
        >>> [line.get_ydata().tolist() for line in figure.axes[1].get_lines()]
        [[0, 0], [1, 1]]
    """
    panels = 2 if extra_forwards_by_strategy else 1
    figure = _figure(figsize=(6.4, 4.4 if panels == 1 else 6.6), dpi=100)
    axes = figure.subplots(panels, 1, sharex=True, squeeze=False,
                           height_ratios=[3, 2][:panels])
    memory_axes, bottom = axes[0][0], axes[-1][0]
    colors = _memory_panel(memory_axes, depths, memory_by_strategy, measured_by_strategy or {})
    memory_axes.set_title(title, fontsize=10)
    _depth_ticks(bottom, depths)
    bottom.set_xlabel("blocks in the chain (n)")
    if extra_forwards_by_strategy:
        _extra_forwards_panel(bottom, depths, extra_forwards_by_strategy, colors)
        figure.tight_layout()
        figure.canvas.draw()  # the layout the panel's labels are placed in
        _label_line_ends(bottom, depths, extra_forwards_by_strategy, colors)
    return figure


def plot_memory_vs_depth(
    depths: Sequence[int],
    memory_by_strategy: dict[str, Sequence[float]],
    path: str | Path,
    measured_by_strategy: dict[str, Sequence[tuple[int, float]]] | None = None,
    title: str = "Activation memory against depth",
    extra_forwards_by_strategy: dict[str, Sequence[float]] | None = None,
) -> Path:
    """A PNG, log-log, of activation memory (blocks' worth) against chain length per strategy,
    and below it, given ``extra_forwards_by_strategy``, the extra forward passes each pays
    (``draw_memory_vs_depth``).

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
    figure = draw_memory_vs_depth(depths, memory_by_strategy, measured_by_strategy,
                                  extra_forwards_by_strategy, title)
    return _save(figure, path, lay_out=not extra_forwards_by_strategy)  # labels placed in it


def _memory_panel(
    axes: Any,
    depths: Sequence[int],
    memory_by_strategy: dict[str, Sequence[float]],
    measured_by_strategy: dict[str, Sequence[tuple[int, float]]],
) -> dict[str, str]:
    """Memory against depth, log-log, per strategy; returns each strategy's color."""
    colors = {}
    for strategy, memory in memory_by_strategy.items():
        (line,) = axes.plot(depths, memory, marker=".", label=strategy)
        colors[strategy] = line.get_color()
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
    axes.set_ylabel("activation memory (blocks' worth)")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8)
    return colors


def _extra_forwards_panel(
    axes: Any,
    depths: Sequence[int],
    extra_forwards_by_strategy: dict[str, Sequence[float]],
    colors: dict[str, str],
) -> None:
    """Extra forward passes against depth per strategy: what each pays for its memory."""
    for strategy, extra in extra_forwards_by_strategy.items():
        axes.plot(depths, extra, marker=".", label=strategy, color=colors.get(strategy))
    highest = max((max(extra, default=0) for extra in extra_forwards_by_strategy.values()),
                  default=0)
    axes.set_ylim(-0.08, max(highest, 1.0) * 1.2)
    axes.set_ylabel("extra forward passes\n(recomputation)")
    axes.grid(alpha=0.3, which="both")


def _depth_ticks(axes: Any, depths: Sequence[int]) -> None:
    """The depths themselves as ticks (4, 16, 100 rather than powers of ten), with room on the
    right for the lines' labels."""
    from matplotlib.ticker import NullLocator

    axes.set_xscale("log")
    axes.set_xticks(list(depths), [str(depth) for depth in depths])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xlim(min(depths) / 1.3, max(depths) * 2.6)


def _label_line_ends(
    axes: Any,
    depths: Sequence[int],
    values_by_strategy: dict[str, Sequence[float]],
    colors: dict[str, str],
) -> list[LabelPlacement]:
    """Each line named at its last point; strategies drawing the same line share one label
    ("every-layer, sqrt"), so a line hidden under another is still told."""
    groups: dict[tuple[float, ...], list[str]] = {}
    for strategy, values in values_by_strategy.items():
        groups.setdefault(tuple(round(value, 6) for value in values), []).append(strategy)
    anchors = [
        (", ".join(names), (depths[-1], values[-1]),
         colors.get(names[0], "0.2") if len(names) == 1 else "0.2")
        for values, names in groups.items()
    ]
    markers = [(depth, value) for values in groups for depth, value in zip(depths, values,
                                                                         strict=True)]
    lines = [(list(depths), list(values)) for values in groups]
    return place_labels(axes, anchors, markers, lines)


def _save(figure: Any, path: str | Path, lay_out: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if lay_out:
        figure.tight_layout()
    figure.savefig(path, format="png")
    return path
