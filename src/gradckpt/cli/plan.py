"""``gradckpt plan``: profile MODEL, solve for the budget, print (and write) the plan."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .builtin_models import builtin_list
from .devices import resolve_device, to_device
from .errors import CommandLineError
from .frontier import optimal_frontier
from .memory_parts import memory_parts
from .model_lookup import resolve_model
from .profiling import profile_with_bar
from .progress import stage

if TYPE_CHECKING:
    from gradckpt.plan import Plan
    from gradckpt.profile_types import Profile

__all__ = ["run_plan"]


def run_plan(args: argparse.Namespace) -> int:
    """``gradckpt plan``: profile MODEL, solve for the budget, print (and write) the plan.

    Example:
        >>> from gradckpt.cli.parser import build_parser
        >>> run_plan(build_parser().parse_args(["plan", "mlp-chain", "--batch", "2", "--seq",
        ...                                     "4", "--strategy", "sqrt"]))  # doctest: +ELLIPSIS
        mlp_chain(16, 256): 16 blocks (0 .. 15), batch 2 x 4, ...
        0
    """
    import torch

    from gradckpt.budget import format_bytes
    from gradckpt.enable import solve_reserving
    from gradckpt.report import memory_breakdown_table
    from gradckpt.reserved import optimizer_state_bytes

    if args.list:
        print(builtin_list())
        return 0
    _check_plan_arguments(args)
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    stage(f"building {args.model}")
    target = resolve_model(args.model, args.batch, args.seq)
    model = target.model.to(device).train()
    sample = to_device(target.sample, device)
    stage("profiling one training step and each block")
    profile = profile_with_bar(model, sample, keep_output=not args.drop_output)
    optimizer_bytes = optimizer_state_bytes(None if args.optimizer == "none" else "adam", model)
    plan = solve_reserving(
        profile, args.budget, args.strategy, reserved_bytes=optimizer_bytes,
        reserved_for="Adam's state", device=device,
    )

    names = [block.name for block in profile.blocks]
    print(
        f"{target.description}: {len(names)} blocks ({names[0]} .. {names[-1]}), "
        f"batch {args.batch} x {args.seq}, {device}"
    )
    print(
        f"measured here: peak without checkpointing {format_bytes(profile.peak_bytes)}, "
        f"step {profile.step_seconds:.3f} s"
    )
    print()
    print(plan)
    if optimizer_bytes:
        print(
            f"with Adam's state ({format_bytes(optimizer_bytes)}, predicted), counted in the "
            f"predicted peak and the budget"
        )
    print()
    print(memory_breakdown_table(memory_parts(model, profile, plan, optimizer_bytes)))
    if args.json:
        Path(args.json).write_text(plan.to_json())
        print(f"\nplan written to {args.json}")
    if args.plot:
        _plot_plan(profile, plan, Path(args.plot))
        print(f"plot written to {args.plot}")
    return 0


def _check_plan_arguments(args: argparse.Namespace) -> None:
    """What can be wrong with the command line itself, found before any slow work."""
    from gradckpt.budget import parse_budget
    from gradckpt.errors import UsageError
    from gradckpt.solvers import BUDGET_DRIVEN, STRATEGIES

    if args.model is None:
        raise CommandLineError("MODEL is missing (see 'gradckpt plan --list' for built-ins)")
    if args.strategy not in STRATEGIES:
        raise CommandLineError(
            f"unknown strategy {args.strategy!r}; valid strategies: {', '.join(STRATEGIES)}"
        )
    if args.budget is None and args.strategy in BUDGET_DRIVEN:
        raise CommandLineError(
            f"strategy {args.strategy} chooses its plan for a budget: pass --budget (6GiB, "
            "60%, ...) or use --strategy none, every-layer or sqrt"
        )
    if args.budget is not None:
        try:  # the form only: a percentage's base is known once the model is profiled
            parse_budget(args.budget, unconstrained_peak_bytes=1 << 40, device="cpu")
        except UsageError as error:
            raise CommandLineError(f"--budget: {error}") from None


def _plot_plan(profile: Profile, plan: Plan, path: Path) -> None:
    """Each fixed strategy and this plan as points, the optimal frontier as a line."""
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
