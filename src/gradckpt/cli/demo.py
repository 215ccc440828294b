"""``gradckpt demo``: what each strategy costs on a small GPT, measured; the sqrt(n) table;
plots of both."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from .demo_size import demo_size_from
from .demo_strategies import compare_strategies, strategies_table
from .devices import resolve_device
from .frontier import optimal_frontier, plan_point
from .plan_measurements import PlanRun, identical_to
from .sqrt_table import DepthRow, depth_series, sqrt_rows, sqrt_table, sqrt_verdict

if TYPE_CHECKING:
    from gradckpt.profile_types import Profile

__all__ = ["run_demo"]


def run_demo(args: argparse.Namespace) -> int:
    """``gradckpt demo``: each strategy measured on a GPT, the sqrt(n) table, plots.

    Example:
        >>> from gradckpt.cli.parser import build_parser
        >>> args = build_parser().parse_args(["demo", "--quick", "--device", "tpu"])
        >>> run_demo(args)  # the full run: gradckpt demo --quick, seconds
        Traceback (most recent call last):
        ...
        ValueError: unknown device 'tpu'; expected auto, cpu or cuda[:N]
    """
    size = demo_size_from(args)
    device = resolve_device(args.device)

    heading, runs, profile = compare_strategies(size, device, args.seed)
    block, depth_rows = sqrt_rows(size, args.seed)

    print(heading)
    print("Peak memory of a training step (forward + backward) and its time, under each plan:")
    print()
    print(strategies_table(runs, len(profile.blocks), size.steps))
    print()
    print(textwrap.fill(
        f"sqrt(n): chains of n identical blocks (Linear {size.chain_width}->"
        f"{size.chain_width} + GELU + Dropout on {size.chain_rows} rows, measured here). "
        "Each cell: activation memory in blocks' worth (what one block keeps for backward) / "
        "extra forward passes. optimal gets the sqrt plan's memory.",
        width=100,
    ))
    print()
    print(sqrt_table(depth_rows))
    print()
    print(sqrt_verdict(depth_rows))
    _write_demo_plots(Path(args.out), runs, profile, depth_rows)

    reference = runs[0]
    if not all(identical_to(run, reference) for run in runs):
        print(
            "gradckpt demo: FAILED: training under a plan differs from plain training "
            "(this is a bug in gradckpt; please report it)",
            file=sys.stderr,
        )
        return 1
    return 0


def _write_demo_plots(
    out: Path, runs: list[PlanRun], profile: Profile, rows: list[DepthRow]
) -> None:
    from gradckpt.report import PlotsUnavailable, plot_frontier, plot_memory_vs_depth

    reference_seconds = runs[0].median_seconds
    points = [
        plan_point(_plot_label(run), run.plan, run.peak_bytes,
                   run.median_seconds / reference_seconds)
        for run in runs
    ]
    series = depth_series(rows)
    try:
        written = [
            plot_frontier(
                points,
                out / "frontier.png",
                frontier=optimal_frontier(profile),
                title="TinyGPT: peak memory and step time of each plan, predicted and measured",
            ),
            plot_memory_vs_depth(
                series.depths,
                series.memory,
                out / "memory_vs_depth.png",
                measured_by_strategy=series.measured,
                title="n identical blocks: activation memory, and the recomputation it costs",
                extra_forwards_by_strategy=series.extra_forwards,
            ),
        ]
    except PlotsUnavailable as error:
        print(f"\nplots skipped: {error}")
        return
    print(f"\nplots: {', '.join(str(path) for path in written)}")


def _plot_label(run: PlanRun) -> str:
    """A run's name on the plot: the strategy, and for optimal its budget ("optimal 75%").

    Example:
        >>> _plot_label(PlanRun("optimal", "least, 48.70 MiB", plan=None))
        'optimal least'
    """
    return run.label if run.budget == "-" else f"{run.label} {run.budget.split(',')[0]}"
