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

__all__ = ["optimal_frontier", "plot_plan"]


def optimal_frontier(profile: Profile, steps: int = 16) -> list[StrategyPoint]:
    """Predicted (peak, time) of the optimal plans for budgets from the least to no limit.

    Example:
        >>> from gradckpt.profile_types import BlockProfile
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> chain = homogeneous_chain(BlockProfile("b", 10, 10, 50, True, 1.0, 2.0), 16)
        >>> points = optimal_frontier(chain)
        >>> points[0].peak_bytes < points[-1].peak_bytes, points[0].time_ratio > 1
        (True, True)
    """
    from gradckpt import BudgetError, solve
    from gradckpt.report import StrategyPoint
    from gradckpt.solvers import BUDGET_DRIVEN

    lowest = BUDGET_DRIVEN["optimal"](profile)
    points = []
    for step in range(steps):
        budget = lowest + (profile.peak_bytes - lowest) * step // (steps - 1)
        try:
            plan = solve(profile, max(budget, lowest), "optimal")
        except BudgetError:
            continue
        points.append(
            StrategyPoint("optimal", plan.predicted_peak_bytes, 1 + plan.predicted_overhead)
        )
    return points


def plot_plan(profile: Profile, plan: Plan, path: Path) -> None:
    """``gradckpt plan --plot``: each fixed strategy and this plan as points, the optimal
    frontier as a line (needs the ``plot`` extra).

    Example:
        >>> import tempfile
        >>> from gradckpt import solve
        >>> from gradckpt.profile_types import BlockProfile
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> chain = homogeneous_chain(BlockProfile("b", 10, 10, 50, True, 1.0, 2.0), 8)
        >>> path = Path(tempfile.mkdtemp()) / "plan.png"
        >>> plot_plan(chain, solve(chain, None, "sqrt"), path)  # doctest: +SKIP
    """
    from gradckpt import solve
    from gradckpt.report import StrategyPoint, plot_frontier

    points = []
    for name in ("none", "every-layer", "sqrt"):
        fixed = solve(profile, None, name)
        points.append(StrategyPoint(name, fixed.predicted_peak_bytes, 1 + fixed.predicted_overhead))
    points.append(
        StrategyPoint(f"this plan ({plan.strategy})", plan.predicted_peak_bytes,
                      1 + plan.predicted_overhead)
    )
    plot_frontier(
        points, path, frontier=optimal_frontier(profile), title="Predicted peak and step time"
    )
