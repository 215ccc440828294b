"""``gradckpt demo``, part 1: each strategy on a small GPT, planned, measured and tabled."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .demo_size import DemoSize
from .plan_measurements import PlanRun, identical_to, measure_plans, train_plans
from .profiling import profile_with_bar
from .progress import stage

if TYPE_CHECKING:
    import torch

    from gradckpt.plan import Plan
    from gradckpt.profile_types import Profile

__all__ = ["compare_strategies", "strategies_table"]


def _demo_plans(profile: Profile) -> list[PlanRun]:
    """The fixed strategies, and optimal at 75% and 50% of the plain peak and at its least."""
    from gradckpt import BudgetError, solve
    from gradckpt.budget import format_bytes
    from gradckpt.solvers import BUDGET_DRIVEN

    runs = [PlanRun(name, "-", solve(profile, None, name)) for name in ("none", "every-layer")]
    runs.append(PlanRun("sqrt", "-", solve(profile, None, "sqrt")))
    lowest = BUDGET_DRIVEN["optimal"](profile)
    for budget in ("75%", "50%", lowest):
        try:
            plan = solve(profile, budget, "optimal")
        except BudgetError:
            continue  # a small model may not go down to 50%: the least-memory row covers it
        label = budget if isinstance(budget, str) else f"least, {format_bytes(budget)}"
        runs.append(PlanRun("optimal", label, plan))
    return runs


def compare_strategies(
    size: DemoSize, device: torch.device, seed: int
) -> tuple[str, list[PlanRun], Profile]:
    """Part 1: the GPT planned each way; returns the heading, the measured runs, the profile.

    Example:
        >>> import dataclasses, torch
        >>> from gradckpt.cli.demo_size import QUICK_DEMO
        >>> size = dataclasses.replace(QUICK_DEMO, layers=2, batch=2, seq=8, timing_repeats=1)
        >>> heading, runs, profile = compare_strategies(size, torch.device("cpu"), seed=0)
        >>> heading  # doctest: +ELLIPSIS
        'TinyGPT: 2 blocks, n_embd 128, batch 2 x 8 tokens, cpu, torch ...'
        >>> [run.label for run in runs[:3]]
        ['none', 'every-layer', 'sqrt']
        >>> table = strategies_table(runs, len(profile.blocks), size.steps).splitlines()
        >>> table[0]  # doctest: +ELLIPSIS
        'strategy ... predicted peak  measured peak  predicted time  step time  training (2 steps)'
        >>> table[1]  # doctest: +ELLIPSIS
        'none ... nothing recomputed ...1.00x ...1.00x  (reference)'
        >>> table[2]  # doctest: +ELLIPSIS
        'every-layer ... 2/2 blocks recomputed, 2 segments ...x  ...x  identical'
    """
    import torch

    from gradckpt.toy_models import GPTConfig, TinyGPT

    config = GPTConfig(n_layer=size.layers, block_size=size.seq)
    torch.manual_seed(seed)
    model = TinyGPT(config).to(device)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(size.steps):  # next-token prediction on noise: the numbers matter, not text
        shape = (size.batch, size.seq + 1)
        tokens = torch.randint(0, config.vocab_size, shape, generator=generator)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    sample = {"idx": batches[0][0], "targets": batches[0][1]}

    stage("profiling TinyGPT (one training step, then each block)")
    profile = profile_with_bar(model, sample)
    runs = _demo_plans(profile)
    measure_plans(model, sample, runs, size.timing_repeats)
    train_plans(model, batches, runs, seed)
    heading = (
        f"TinyGPT: {size.layers} blocks, n_embd {config.n_embd}, batch {size.batch} x "
        f"{size.seq} tokens, {device}, torch {torch.__version__}"
    )
    return heading, runs, profile


def strategies_table(runs: list[PlanRun], block_count: int, steps: int) -> str:
    """The runs as the demo prints them: each plan's predicted peak and step time beside the
    measured ones, step times as ratios (predicted: to the profiled step; measured: to the
    first run's). See ``compare_strategies`` for an example."""
    from gradckpt.report import format_table

    reference = runs[0]
    rows = []
    for run in runs:
        rows.append([
            run.label,
            run.budget,
            _describe_plan(run.plan, block_count),
            _mebibytes(run.plan.predicted_peak_bytes),
            _mebibytes(run.peak_bytes),
            _times(1 + run.plan.predicted_overhead),
            _times(run.median_seconds / reference.median_seconds),
            "(reference)" if run is reference
            else "identical" if identical_to(run, reference) else "DIFFERENT",
        ])
    header = [
        "strategy", "budget", "plan", "predicted peak", "measured peak", "predicted time",
        "step time", f"training ({steps} steps)",
    ]
    return format_table(header, rows, align="lllrrrrl")


def _describe_plan(plan: Plan, block_count: int) -> str:
    """A few words on what a plan does: how many blocks it recomputes, and how."""
    recomputed = sum(len(segment.blocks()) for segment in plan.segments)
    if not recomputed:
        return "nothing recomputed"
    words = f"{recomputed}/{block_count} blocks recomputed, {len(plan.segments)} segments"
    if any(segment.children for segment in plan.segments):
        words += ", nested"
    if any(segment.policy for segment in plan.segments):
        words += ", some save matmuls"
    return words


def _mebibytes(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def _times(ratio: float) -> str:
    """A step-time ratio as the table shows it: ``1.12x``."""
    return f"{ratio:.2f}x"
