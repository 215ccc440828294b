"""The optimal frontier: predicted peak and step time of optimal plans across budgets, the line
that the plots of ``gradckpt demo`` and ``gradckpt plan --plot`` draw each plan against; and the
plot of ``gradckpt plan --plot``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradckpt.plan import Plan
    from gradckpt.profile_types import Profile
    from gradckpt.report import StrategyPoint

__all__ = ["optimal_frontier", "plan_point", "plot_plan"]


def optimal_frontier(profile: Profile, max_plans: int = 200) -> list[StrategyPoint]:
    """Predicted (peak, time) of the optimal plans from no limit down to the least peak.

    It walks down the frontier: each next budget is just under the last plan's peak, so no plan
    between two budgets is skipped (even steps of budget did skip them: near the least peak
    one step spanned many plans and the line jumped). ``max_plans`` bounds the walk on models
    with very many plans: the budget then falls by at least 1/``max_plans`` of the range each
    time. The least plan is always the last point.

    Example:
        >>> from gradckpt import solve
        >>> from gradckpt.profile_types import example_block
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> from gradckpt.solvers import BUDGET_DRIVEN
        >>> chain = homogeneous_chain(example_block("b"), 16)
        >>> points = optimal_frontier(chain)
        >>> points[0].peak_bytes == chain.peak_bytes, points[0].time_ratio
        (True, 1.0)
        >>> least = solve(chain, BUDGET_DRIVEN["optimal"](chain), "optimal")
        >>> points[-1].peak_bytes == least.predicted_peak_bytes
        True
    """
    from gradckpt import BudgetError, solve
    from gradckpt.solvers import BUDGET_DRIVEN

    lowest = BUDGET_DRIVEN["optimal"](profile)
    least_step = max(1, (profile.peak_bytes - lowest) // max_plans)
    points = []
    budget = max(profile.peak_bytes, lowest)
    while budget > lowest:
        try:
            plan = solve(profile, budget, "optimal")
        except BudgetError:  # not expected above the least peak; the least plan ends the line
            break
        points.append(plan_point("optimal", plan))
        budget = min(plan.predicted_peak_bytes - 1, budget - least_step)
    points.append(plan_point("optimal", solve(profile, lowest, "optimal")))
    return _pareto(points)


def _pareto(points: list[StrategyPoint]) -> list[StrategyPoint]:
    """The points no other beats on both peak and time, from the largest peak down.

    Example:
        >>> from gradckpt.report import StrategyPoint
        >>> walk = [StrategyPoint("optimal", 100, 1.0), StrategyPoint("optimal", 90, 1.2),
        ...         StrategyPoint("optimal", 80, 1.2)]  # 90 MiB costs what 80 does
        >>> [point.peak_bytes for point in _pareto(walk)]
        [100, 80]
    """
    kept: list[StrategyPoint] = []
    for point in sorted(points, key=lambda point: (point.peak_bytes, point.time_ratio)):
        if not kept or point.time_ratio < kept[-1].time_ratio:
            kept.append(point)
    return kept[::-1]


def plot_plan(profile: Profile, plan: Plan, path: Path) -> None:
    """``gradckpt plan --plot``: each fixed strategy and this plan as points, the optimal
    frontier as a line (needs the ``plot`` extra).

    Example:
        >>> import tempfile
        >>> from gradckpt import solve
        >>> from gradckpt.profile_types import example_block
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> chain = homogeneous_chain(example_block("b"), 8)
        >>> path = Path(tempfile.mkdtemp()) / "plan.png"
        >>> plot_plan(chain, solve(chain, None, "sqrt"), path)  # doctest: +SKIP
    """
    from gradckpt import solve
    from gradckpt.report import plot_frontier

    points = [plan_point(name, solve(profile, None, name))
              for name in ("none", "every-layer", "sqrt")]
    points.append(plan_point(f"this plan ({plan.strategy})", plan))
    plot_frontier(
        points, path, frontier=optimal_frontier(profile), title="Predicted peak and step time"
    )


def plan_point(label: str, plan: Plan, measured_peak_bytes: int | None = None,
               measured_time_ratio: float | None = None) -> StrategyPoint:
    """A plan on the memory/time plane: its predicted peak and step-time ratio, and, for a plan
    that was run, the measured ones.

    Example:
        >>> from gradckpt import solve
        >>> from gradckpt.profile_types import example_block
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> chain = homogeneous_chain(example_block("b"), 4)
        >>> plan_point("every-layer", solve(chain, None, "every-layer"))
        StrategyPoint(label='every-layer', peak_bytes=90, time_ratio=1.3333333333333333, measured_peak_bytes=None, measured_time_ratio=None)
    """  # noqa: E501  (a doctest's output is one line)
    from gradckpt.report import StrategyPoint

    return StrategyPoint(label, plan.predicted_peak_bytes, 1 + plan.predicted_overhead,
                         measured_peak_bytes, measured_time_ratio)
