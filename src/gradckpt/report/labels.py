"""Where a plot's point labels go: the first spot around each point that covers no other
label, marker or the legend and stays inside the axes (``place_labels``), so that labels of
points close together (every-layer and the least plan, often) never overlap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["LabelPlacement", "place_labels"]


class LabelPlacement(NamedTuple):
    """Where a plot put a point's label: the point (data coordinates), the text's offset from
    it (points) and the text's extent (display pixels: x0, y0, x1, y1)."""

    text: str
    anchor: tuple[float, float]
    offset: tuple[float, float]
    box: tuple[float, float, float, float]



# Where a label may sit around its point, as directions, nearest rings first: beside it, then
# above or below, then diagonally; farther rings get a leader line back to the point.
_LABEL_DIRECTIONS = ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1))
_LABEL_DISTANCES = (8, 18, 30, 44)  # points: the first clears a marker


def place_labels(
    axes: Any,
    anchors: Sequence[tuple[str, tuple[float, float], str]],
    markers: Sequence[tuple[float, float]],
    paths: Sequence[tuple[Sequence[float], Sequence[float]]],
) -> list[LabelPlacement]:
    """Each label (text, point, color) at the first spot around its point that overlaps no
    placed label, marker or the legend and stays inside the axes (crossing a line counts
    against a spot, less)."""
    from matplotlib.path import Path as LinePath
    from matplotlib.transforms import Bbox

    renderer = axes.figure.canvas.get_renderer()
    to_pixels = axes.transData.transform
    radius = 5 * axes.figure.dpi / 72  # about a marker's half width
    blocked = [Bbox.from_extents(x - radius, y - radius, x + radius, y + radius)
               for x, y in to_pixels(list(markers))] if markers else []
    legend = axes.get_legend()
    if legend is not None:
        blocked.append(legend.get_window_extent(renderer))
    lines = [LinePath(to_pixels(list(zip(*path, strict=True)))) for path in paths]
    frame = axes.get_window_extent(renderer)
    def cost(rank: int, box: Any) -> tuple[float, int, int]:
        covered = sum(_overlap(box, other) for other in blocked)
        outside = box.width * box.height - _overlap(box, frame)
        crossed = sum(line.intersects_bbox(box, filled=False) for line in lines)
        return covered + outside, crossed, rank

    placements = []
    for text, anchor, color in anchors:
        boxes = [(offset, _label_box(axes, renderer, text, anchor, offset))
                 for offset in _label_offsets()]
        rank = min(range(len(boxes)), key=lambda rank: cost(rank, boxes[rank][1]))
        offset, box = boxes[rank]
        _annotate(axes, text, anchor, offset).set_color(color)
        blocked.append(box)
        placements.append(LabelPlacement(text, anchor, offset, tuple(box.extents)))
    return placements


def _label_offsets() -> list[tuple[float, float]]:
    return [(dx * distance, dy * distance)
            for distance in _LABEL_DISTANCES for dx, dy in _LABEL_DIRECTIONS]


def _annotate(axes: Any, text: str, anchor: tuple[float, float],
              offset: tuple[float, float], leader: bool = True) -> Any:
    """The label at ``offset`` points from its point, aligned away from it."""
    far = leader and max(abs(offset[0]), abs(offset[1])) > _LABEL_DISTANCES[0]
    horizontal = "left" if offset[0] > 0 else "right" if offset[0] < 0 else "center"
    vertical = "bottom" if offset[1] > 0 else "top" if offset[1] < 0 else "center"
    return axes.annotate(
        text, anchor, xytext=offset, textcoords="offset points", fontsize=8,
        ha=horizontal, va=vertical,
        arrowprops={"arrowstyle": "-", "color": "0.5", "linewidth": 0.6, "shrinkB": 4}
        if far else None,
    )


def _label_box(axes: Any, renderer: Any, text: str, anchor: tuple[float, float],
               offset: tuple[float, float]) -> Any:
    """The pixels a label would cover at ``offset``, padded so labels do not touch."""
    trial = _annotate(axes, text, anchor, offset, leader=False)
    box = trial.get_window_extent(renderer).padded(2)
    trial.remove()
    return box


def _overlap(box: Any, other: Any) -> float:
    width = min(box.x1, other.x1) - max(box.x0, other.x0)
    height = min(box.y1, other.y1) - max(box.y0, other.y0)
    return width * height if width > 0 and height > 0 else 0.0
