"""The plots of ``gradckpt demo`` and ``gradckpt plan --plot``, checked on the data they draw
(not on pixels): the optimal frontier, each plan's predicted and measured points, where the
labels went; the depth plot's two panels; and the demo table's predicted time."""

from __future__ import annotations

import dataclasses
import re
from itertools import combinations

import pytest
import torch

import gradckpt
from gradckpt import solve
from gradckpt.cli.demo_size import QUICK_DEMO
from gradckpt.cli.demo_strategies import strategies_table
from gradckpt.cli.frontier import optimal_frontier, plan_point
from gradckpt.cli.plan_measurements import PlanRun
from gradckpt.cli.sqrt_table import depth_series, sqrt_rows, sqrt_table
from gradckpt.plan import Plan
from gradckpt.report import StrategyPoint, draw_frontier, draw_memory_vs_depth
from gradckpt.solvers import BUDGET_DRIVEN
from gradckpt.toy_models import GPTConfig, TinyGPT

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

pytest.importorskip("matplotlib")

MiB = 2**20


@pytest.fixture(scope="module")
def gpt_profile() -> gradckpt.Profile:
    """A small TinyGPT's profile: blocks of unequal cost and a large output head, as the demo's."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=4, block_size=32))
    tokens = torch.randint(0, 100, (4, 33), generator=torch.Generator().manual_seed(0))
    return gradckpt.profile(model, {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}, repeats=1)


def demo_plans(profile: gradckpt.Profile) -> dict[str, Plan]:
    """The plans the demo draws: the fixed strategies and optimal at 75%, 50% and its least."""
    lowest = BUDGET_DRIVEN["optimal"](profile)
    plans = {name: solve(profile, None, name) for name in ("none", "every-layer", "sqrt")}
    for share in (0.75, 0.5):
        plans[f"optimal {share:.0%}"] = solve(
            profile, max(lowest, int(share * profile.peak_bytes)), "optimal"
        )
    plans["optimal least"] = solve(profile, lowest, "optimal")
    return plans


def frontier_peak_at(line: list[tuple[float, int]], time_ratio: float) -> int:
    """The least peak the drawn frontier offers at ``time_ratio``: its staircase's height."""
    return min(peak for time, peak in line if time <= time_ratio + 1e-12)


# --------------------------------------------------------------------------------------------
# The frontier plot
# --------------------------------------------------------------------------------------------


def test_the_frontier_runs_from_no_limit_down_to_the_least_plan(gpt_profile):
    drawing = draw_frontier([], optimal_frontier(gpt_profile))
    least = solve(gpt_profile, BUDGET_DRIVEN["optimal"](gpt_profile), "optimal")
    none = solve(gpt_profile, None, "none")
    assert min(peak for _, peak in drawing.line) == least.predicted_peak_bytes
    # It ends at the least peak, no slower than the least plan: a larger budget may find a
    # plan as small and faster (the solver's memory units depend on the budget).
    end_time, end_peak = drawing.line[-1]
    assert end_peak == least.predicted_peak_bytes
    assert end_time <= 1 + least.predicted_overhead
    assert drawing.line[0] == (1.0, none.predicted_peak_bytes)


def test_no_plan_drawn_beats_the_optimal_frontier_at_its_memory(gpt_profile):
    # Even steps of budget skipped the frontier's plans near the least peak: every-layer's
    # predicted point then sat below the line.
    points = [plan_point(label, plan) for label, plan in demo_plans(gpt_profile).items()]
    drawing = draw_frontier(points, optimal_frontier(gpt_profile))
    for point in drawing.points:
        assert point.peak_bytes >= frontier_peak_at(drawing.line, point.time_ratio), point


def test_the_frontier_walk_finds_every_plan_even_steps_of_budget_skip(gpt_profile):
    frontier = optimal_frontier(gpt_profile)
    peaks = [point.peak_bytes for point in frontier]
    times = [point.time_ratio for point in frontier]
    assert peaks == sorted(peaks, reverse=True) and times == sorted(times)  # a Pareto front
    assert len(frontier) >= 3


# The demo's plans as `gradckpt demo` measured them: every-layer and optimal least nearly on one
# spot, where labels at one fixed offset from their points overlapped.
CROWDED = [
    StrategyPoint("none", int(261.9 * MiB), 1.0, int(261.9 * MiB), 1.0),
    StrategyPoint("every-layer", int(50.2 * MiB), 1.49, int(50.2 * MiB), 1.39),
    StrategyPoint("sqrt", int(107.0 * MiB), 1.49, int(107.0 * MiB), 1.39),
    StrategyPoint("optimal 75%", int(188.8 * MiB), 1.17, int(188.8 * MiB), 1.16),
    StrategyPoint("optimal 50%", int(129.7 * MiB), 1.29, int(129.7 * MiB), 1.20),
    StrategyPoint("optimal least", int(48.7 * MiB), 1.40, int(48.7 * MiB), 1.40),
]


def boxes_overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_labels_of_points_close_together_do_not_overlap():
    drawing = draw_frontier(CROWDED)
    axes = drawing.figure.axes[0]
    anchors = axes.transData.transform([label.anchor for label in drawing.labels])
    assert abs(anchors[1] - anchors[5]).max() < 12  # pixels: one offset for both would collide
    for a, b in combinations(drawing.labels, 2):
        assert not boxes_overlap(a.box, b.box), (a.text, b.text)
    frame = axes.get_window_extent(drawing.figure.canvas.get_renderer()).extents
    for label in drawing.labels:
        assert frame[0] <= label.box[0] and label.box[2] <= frame[2], label.text
        assert frame[1] <= label.box[1] and label.box[3] <= frame[3], label.text


def test_labels_cover_no_marker():
    drawing = draw_frontier(CROWDED)
    axes = drawing.figure.axes[0]
    marks = [(p.time_ratio, p.peak_bytes / MiB) for p in CROWDED]
    marks += [(p.measured_time_ratio, p.measured_peak_bytes / MiB) for p in CROWDED]
    for x, y in axes.transData.transform(marks):
        for label in drawing.labels:
            assert not boxes_overlap(label.box, (x - 3, y - 3, x + 3, y + 3)), label.text


def test_each_plan_shows_its_predicted_point_and_its_measured_one_joined():
    drawing = draw_frontier(CROWDED[:2])
    lines = drawing.figure.axes[0].get_lines()
    hollow = [line for line in lines if line.get_markerfacecolor() == "white" and
              len(line.get_xdata()) == 1]
    assert [(line.get_xdata()[0], line.get_ydata()[0]) for line in hollow] == [
        (1.0, pytest.approx(261.9, abs=0.01)), (1.49, pytest.approx(50.2, abs=0.01)),
    ]
    joints = [line for line in lines if line.get_linestyle() == ":"]
    assert [list(line.get_xdata()) for line in joints] == [[1.0, 1.0], [1.49, 1.39]]
    assert [label.anchor[0] for label in drawing.labels] == [1.0, 1.39]  # by the measured point


# --------------------------------------------------------------------------------------------
# The depth plot
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def depth_rows():
    size = dataclasses.replace(QUICK_DEMO, depths=(4, 16, 64, 100), measured_depth=4,
                               chain_width=8, chain_rows=16)
    return sqrt_rows(size, seed=0)[1]


def test_the_depth_plot_draws_the_tables_extra_forward_passes(depth_rows):
    series = depth_series(depth_rows)
    figure = draw_memory_vs_depth(series.depths, series.memory, series.measured,
                                  series.extra_forwards)
    drawn = {line.get_label(): line.get_ydata().tolist() for line in figure.axes[1].get_lines()}
    assert drawn == series.extra_forwards
    assert [line.get_xdata().tolist() for line in figure.axes[1].get_lines()][0] == [
        4, 16, 64, 100
    ]
    table_rows = sqrt_table(depth_rows).splitlines()[1:]
    for row, depth_index in zip(table_rows, range(len(series.depths)), strict=True):
        extras = [float(extra) for extra in re.findall(r"/ \+([\d.]+)", row)]
        assert extras == [round(series.extra_forwards[name][depth_index], 2)
                          for name in ("none", "every-layer", "sqrt", "optimal")]


def test_optimal_recomputes_no_more_than_sqrt_at_each_depth(depth_rows):
    series = depth_series(depth_rows)
    for optimal, sqrt in zip(series.extra_forwards["optimal"], series.extra_forwards["sqrt"],
                             strict=True):
        assert optimal <= sqrt + 1e-9
    assert series.extra_forwards["optimal"][-1] < series.extra_forwards["sqrt"][-1]


# --------------------------------------------------------------------------------------------
# The demo table
# --------------------------------------------------------------------------------------------


def test_the_demo_table_shows_predicted_time_beside_measured():
    losses, weights = torch.zeros(2), [torch.ones(3)]
    none = Plan("none", None, [], 100 * MiB, 0.0, 0.0, ["a", "b"])
    sqrt = solve(gradckpt.Profile(
        [gradckpt.profile_types.BlockProfile(n, 10, 10, 50, True, 1.0, 2.0) for n in "ab"],
        peak_bytes=120, fixed_bytes=0, step_seconds=6.0), None, "every-layer")
    runs = [PlanRun("none", "-", none, 100 * MiB, 2.0, losses, weights),
            PlanRun("every-layer", "-", sqrt, 60 * MiB, 2.5, losses, weights)]
    header, _, row = strategies_table(runs, 2, 2).splitlines()
    assert "measured peak  predicted time  step time" in header
    predicted = f"{1 + sqrt.predicted_overhead:.2f}x"
    assert row.split()[-3:] == [predicted, "1.25x", "identical"]
