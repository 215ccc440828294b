"""``gradckpt plan``: profile MODEL, solve for the budget, print (and write) the plan.

With ``--estimate`` the profile is predicted instead (``estimate.run_estimate``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .builtin_models import builtin_list
from .devices import resolve_device, to_device
from .errors import CommandLineError, explained_for_the_command_line
from .estimate import run_estimate, target_device, without_optimizer_note
from .fine_tuning import fine_tuned
from .frontier import plot_plan
from .known_configs import KNOWN_CONFIGS, known_config_rows
from .model_lookup import check_measurable, resolve_model
from .profiling import profile_with_bar
from .progress import stage
from .step_arguments import autocast_dtype, check_step_arguments, step_words

if TYPE_CHECKING:
    import torch

__all__ = ["run_plan", "model_list"]


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
    from gradckpt.measure.memory_parts import OPTIMIZER_NAMES, memory_parts
    from gradckpt.report import head_chunk_options, memory_breakdown_table
    from gradckpt.solvers import solve

    if args.list:
        print(model_list())
        return 0
    _check_plan_arguments(args)
    torch.manual_seed(args.seed)
    if args.estimate:
        return run_estimate(args)
    device = _measuring_device(args.device)
    if args.model in KNOWN_CONFIGS:
        check_measurable(args.model, device)
    stage(f"building {args.model}")
    target = fine_tuned(resolve_model(args.model, args.batch, args.seq), args)
    model = target.model.to(device).train()
    sample = to_device(target.sample, device)
    stage("profiling one training step and each block")
    optimizer = None if args.optimizer == "none" else args.optimizer
    optimizer_name = OPTIMIZER_NAMES.get(args.optimizer, args.optimizer)
    autocast = autocast_dtype(args)
    if autocast is not None:  # as Accelerate applies mixed precision: the forward wrapped
        model.forward = torch.autocast(device.type, dtype=autocast)(model.forward)
    profile = profile_with_bar(model, sample, keep_output=not args.drop_output,
                               optimizer=optimizer, accumulation_steps=args.accumulation_steps,
                               ddp=args.ddp)
    optimizer_bytes = profile.optimizer_state_bytes
    with explained_for_the_command_line():  # a percentage of the whole step, "auto" here
        plan = solve(profile, args.budget, args.strategy, output_head=args.output_head)

    names = [block.name for block in profile.blocks]
    print(
        f"{target.description}: {len(names)} blocks ({names[0]} .. {names[-1]}), "
        f"batch {args.batch} x {args.seq}, {device}{step_words(args)}"
    )
    print(
        f"measured here: peak without checkpointing {format_bytes(profile.peak_bytes)}, "
        f"step {profile.step_seconds:.3f} s"
    )
    print()
    print(plan)
    note = without_optimizer_note(model, optimizer)
    if note:
        print(note)
    if optimizer is not None:
        print(
            f"with {optimizer_name}'s state ({format_bytes(optimizer_bytes)}, measured) and "
            f"optimizer.step() (its peak "
            f"{format_bytes(profile.fixed_bytes + profile.optimizer_step_bytes)}), counted in "
            "the predicted peak and the budget"
        )
    print()
    print(memory_breakdown_table(memory_parts(model, profile, plan, optimizer=optimizer)))
    options = head_chunk_options(profile, plan.head_chunks)
    if options:
        print(options)
    if args.json:
        Path(args.json).write_text(plan.to_json())
        print(f"\nplan written to {args.json}")
    if args.plot:
        plot_plan(profile, plan, Path(args.plot))
        print(f"plot written to {args.plot}")
    return 0


def _check_plan_arguments(args: argparse.Namespace) -> None:
    """What can be wrong with the command line itself, found before any slow work."""
    from gradckpt.solvers import BUDGET_DRIVEN, STRATEGIES

    check_step_arguments(args, "plan")
    if args.world_size != 1 and not args.estimate:
        raise CommandLineError(
            f"--world-size {args.world_size} is for --estimate: a measured plan profiles one "
            "process on this machine holding the whole model; add --estimate (and --device, "
            "the target GPU) to predict one rank of a sharded (FSDP2, ZeRO-3) run"
        )
    if args.dtype is not None and not args.estimate:
        raise CommandLineError(
            "--dtype is for --estimate; a measured plan runs the model in the dtype it is "
            "built in"
        )
    if args.strategy not in STRATEGIES:
        raise CommandLineError(
            f"unknown strategy {args.strategy!r}; valid strategies: {', '.join(STRATEGIES)}"
        )
    if args.budget is None and args.strategy in BUDGET_DRIVEN:
        args.budget = "auto"  # what the device has: free now here, or the target's memory
    if args.estimate:
        target_device(args.device)  # an unknown target is told before any slow work


def _measuring_device(name: str | None) -> torch.device:
    """``--device`` without ``--estimate``: where to profile; a target device's name there
    means --estimate was forgotten."""
    try:
        return resolve_device(name or "auto")
    except ValueError:
        if _is_target_device(name or ""):
            raise CommandLineError(
                f"--device {name} names a target device: add --estimate to predict the plan for "
                "it; without --estimate, --device is where to profile (auto, cpu, cuda, cuda:N)"
            ) from None
        raise


def _is_target_device(name: str) -> bool:
    from gradckpt.errors import UsageError
    from gradckpt.predict.devices import THIS, device_spec

    if name.strip().lower() == THIS:
        return True
    try:
        device_spec(name)  # a preset or an alias: no measuring
    except UsageError:
        return False
    return True


def model_list() -> str:
    """What ``gradckpt plan --list`` prints: the built-in models, then the known configs.

    Example:
        >>> print(model_list())  # doctest: +ELLIPSIS
        tinygpt ...
        llama-3-8b    32 layers, hidden 4096, 32 heads (8 kv), vocab 128256; meta-llama/...
        ...
    """
    from gradckpt.tables import format_table

    table = format_table(["known config", "what it is"], known_config_rows(), align="ll")
    known_rows = table.split("\n", 1)[1]  # the heading line says more than a header would
    return (
        f"{builtin_list()}\n\nknown configs: hyper-parameters only, no weights; plan them with "
        f"--estimate\n{known_rows}"
    )
