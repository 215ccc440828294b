"""Tables and plots (gradckpt.report)."""

from __future__ import annotations

import sys

import pytest

from gradckpt.plan import Plan, Segment
from gradckpt.report import (
    MemoryParts,
    PlotsUnavailable,
    StrategyPoint,
    format_table,
    memory_breakdown_table,
    plan_table,
    plot_frontier,
    plot_memory_vs_depth,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_format_table_aligns_labels_left_and_numbers_right():
    table = format_table(["name", "bytes"], [["a", "1"], ["long name", "1000"]])
    assert table.splitlines() == ["name       bytes", "a              1", "long name   1000"]


def test_format_table_refuses_ragged_rows():
    with pytest.raises(ValueError, match="2 columns"):
        format_table(["a", "b"], [["only one"]])


def test_str_of_a_plan_is_the_report_table():
    plan = Plan(
        "optimal", 4096, [Segment(0, 3, [Segment(0, 1), Segment(2, 2, policy="save-matmuls")])],
        3000, 2.0, 0.4, ["a", "b", "c", "d", "e"],
    )
    assert str(plan) == plan_table(plan)
    lines = str(plan).splitlines()
    assert lines[1] == (
        "a      recomputed: segment 0-3 (its input kept); segment 0-1 (nested, level 2)"
    )
    assert lines[-1].startswith("strategy optimal within 4.00 KiB: predicted peak 2.93 KiB")


def test_memory_breakdown_sorts_parts_and_shares_them_of_the_predicted_peak():
    parts = MemoryParts([("small", 1024), ("large", 3072)], predicted_peak_bytes=4096)
    lines = memory_breakdown_table(parts).splitlines()
    assert lines[1].split() == ["large", "3.00", "KiB", "75%"]
    assert lines[2].split() == ["small", "1.00", "KiB", "25%"]
    assert lines[3].endswith("they add up to the predicted peak, 4.00 KiB.")


def test_plots_are_png_files(tmp_path):
    points = [StrategyPoint("none", 100 * 2**20, 1.0), StrategyPoint("sqrt", 30 * 2**20, 1.3)]
    frontier = [StrategyPoint("optimal", 90 * 2**20, 1.05), StrategyPoint("optimal", 40, 1.2)]
    frontier_path = plot_frontier(points, tmp_path / "sub" / "frontier.png", frontier=frontier)
    depth_path = plot_memory_vs_depth(
        [4, 16], {"none": [4, 16], "sqrt": [3, 6]}, tmp_path / "depth.png",
        measured_by_strategy={"sqrt": [(4, 3.1)]},
    )
    for path in (frontier_path, depth_path):
        assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_plots_without_matplotlib_say_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(PlotsUnavailable, match=r"pip install 'gradckpt\[plot\]'"):
        plot_frontier([StrategyPoint("none", 1, 1.0)], tmp_path / "frontier.png")
    assert not (tmp_path / "frontier.png").exists()

