"""``gradckpt plan MODEL --estimate``: the plan for a target device, predicted without running
the model.

``gradckpt.estimate`` runs the training step and each block on fake tensors (shapes, no memory)
with the model built on the meta device (no weights), so an 8B model plans on a laptop in under
a minute; the solvers then plan it as they plan a measured profile. What is printed: the model
and the target device, the per-block plan (``str(plan)``, as for a measured plan), what takes
the memory part by part, and whether the predicted peak fits the device. With ``--world-size N``
all of it is for one of N ranks sharding the model (``gradckpt.predict.per_rank``): the parameters,
gradients and optimizer state it keeps (1/N), what it gathers in full while a block computes,
and whether that fits one device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradckpt.tables import format_count

from .builtin_models import DTYPES
from .errors import CommandLineError, explained_for_the_command_line
from .fine_tuning import fine_tuned, trained_dtype
from .frontier import plot_plan
from .model_lookup import resolve_model
from .progress import progress_bar, stage
from .step_arguments import autocast_dtype, step_words

if TYPE_CHECKING:
    from torch import nn

    from gradckpt.plan import Plan
    from gradckpt.predict.devices import DeviceSpec
    from gradckpt.profile_types import Profile

__all__ = ["DTYPES", "run_estimate", "target_device", "without_optimizer_note"]



def target_device(name: str | None) -> DeviceSpec:
    """``--device`` with ``--estimate``: the device the plan is for: a preset or an alias,
    ``this`` (default: this machine), or a JSON object of numbers for any other device (the
    keys ``gradckpt.predict.devices.device_spec`` takes).

    Example:
        >>> target_device("H100").name
        'h100-80gb'
        >>> target_device('{"memory": "48GiB", "bf16_tflops": 180, "fp32_tflops": 90, '
        ...               '"bandwidth_gbps": 960, "name": "mine"}').name
        'mine'
        >>> target_device("h1000")
        Traceback (most recent call last):
        ...
        gradckpt.cli.errors.CommandLineError: --device: unknown device 'h1000'; did you mean ...
    """
    from gradckpt.errors import UsageError
    from gradckpt.predict.devices import device_spec

    device: Any = name or "this"
    if device.lstrip().startswith("{"):
        try:
            device = json.loads(device)
        except json.JSONDecodeError as error:
            raise CommandLineError(f"--device: not a JSON object of numbers ({error})") from None
    try:
        return device_spec(device)
    except UsageError as error:
        raise CommandLineError(f"--device: {error}") from None


def without_optimizer_note(model: nn.Module, optimizer: str | None) -> str | None:
    """With ``--optimizer none`` and parameters to train, the line saying what the plan leaves
    out: the state AdamW would add from the second step on. None otherwise.

    Example:
        >>> import torch
        >>> print(without_optimizer_note(torch.nn.Linear(4, 4), None))  # 20 fp32 parameters
        no optimizer counted (--optimizer none): a loop stepping AdamW holds 160 B more from its
        second step on; --optimizer adamw plans for that
        >>> without_optimizer_note(torch.nn.Linear(4, 4), "adamw") is None
        True
    """
    from gradckpt.budget import format_bytes
    from gradckpt.measure.training_state import optimizer_state_bytes

    if optimizer is not None:
        return None
    adamw_bytes = optimizer_state_bytes("adamw", model)
    if not adamw_bytes:
        return None
    return (f"no optimizer counted (--optimizer none): a loop stepping AdamW holds "
            f"{format_bytes(adamw_bytes)} more from its\nsecond step on; --optimizer adamw "
            "plans for that")


def run_estimate(args: argparse.Namespace) -> int:
    """``gradckpt plan MODEL --estimate``: predict the step on ``--device``, solve, print.

    Example:
        >>> from gradckpt.cli.parser import build_parser
        >>> arguments = ["plan", "mlp-chain", "--estimate", "--device", "a100-40gb",
        ...              "--batch", "2", "--seq", "4", "--strategy", "sqrt"]
        >>> run_estimate(build_parser().parse_args(arguments))  # doctest: +ELLIPSIS
        fits: predicted peak ... of 38.00 GiB usable on a100-40gb ...
        mlp_chain(16, 256): 1.05M parameters, 16 blocks (0 .. 15), batch 2 x 4, float32, ...
        0
    """
    import gradckpt
    from gradckpt.budget import format_bytes
    from gradckpt.integrations.fit_step import fed_in
    from gradckpt.measure.memory_parts import memory_parts
    from gradckpt.predict.devices import format_device
    from gradckpt.report import head_chunk_options, memory_breakdown_table, part_label

    spec = target_device(args.device)
    stage(f"building {args.model} (configs on the meta device: shapes, no memory)")
    built = resolve_model(args.model, args.batch, args.seq, on_meta=True)
    target = fine_tuned(built, args)
    dtype = trained_dtype(args, target)
    # Fed in the dtype it trains in, as ``gradckpt fit`` feeds each option it suggests.
    sample = fed_in(target.sample, trained_dtype(args, built))
    optimizer = None if args.optimizer == "none" else args.optimizer
    with progress_bar(f"gradckpt: estimating on fake tensors for {spec.name}") as report:
        profile = gradckpt.estimate(
            target.model, sample, device=spec, optimizer=optimizer, dtype=dtype,
            autocast=autocast_dtype(args), accumulation_steps=args.accumulation_steps,
            keep_output=not args.drop_output, world_size=args.world_size, ddp=args.ddp,
            progress=report,
        )
    with explained_for_the_command_line():  # "auto": the target's memory (solve reads it)
        plan = gradckpt.solve(profile, args.budget, args.strategy,
                              output_head=args.output_head)
    memory = memory_parts(target.model, profile, plan, optimizer=optimizer)
    parts = dict(memory.parts)
    largest = max((name for name in parts if name not in memory.outside_peak), key=parts.get)
    world_size = memory.world_size

    # The answer first (fits or not, at what peak and extra time), then what it rests on; the
    # same line ends the output, after the tables.
    verdict = fit_line(profile, plan, spec)
    print(verdict)
    names = [block.name for block in profile.blocks]
    parameter_count = sum({id(p): p.numel() for p in target.model.parameters()}.values())
    step_dtype = _trained_dtype(target.model, dtype)
    print(
        f"{target.description}: {format_count(parameter_count)} parameters, {len(names)} blocks "
        f"({names[0]} .. {names[-1]}), batch {args.batch} x {args.seq}, {step_dtype}, "
        f"optimizer {args.optimizer}{step_words(args)}{_per_rank(world_size)}"
    )
    print(f"estimated for {format_device(spec)}")
    held = ", the optimizer's state included" if optimizer else ""
    per_rank = " per rank" if world_size > 1 else ""
    print(
        f"predicted, not measured: peak without checkpointing {format_bytes(profile.peak_bytes)}"
        f"{per_rank}{held}; step {profile.step_seconds:.3g} s (roofline)"
    )
    note = without_optimizer_note(target.model, optimizer)
    if note:
        print(note)
    print()
    print(plan)
    print()
    print(memory_breakdown_table(memory, spec.memory_bytes))
    print(f"largest part: {part_label(largest, world_size)}, {format_bytes(parts[largest])}")
    options = head_chunk_options(profile, plan.head_chunks)
    if options:
        print(options)
    print(verdict)
    print(
        f"Predicted on fake tensors for {_device_name(spec)}; times are rooflines (the fastest "
        "it could run each operation): read the extra time as a share of the step, not as "
        "seconds."
    )
    if world_size > 1:
        print(
            f"Per rank of {world_size}: each keeps 1/{world_size} of the parameters, gradients "
            "and optimizer state, and holds in full what FSDP2 gathers (the parts naming FSDP); "
            "--batch is one rank's batch. The step time leaves out the all-gathers and "
            "reduce-scatters."
        )
    if args.json:
        report = estimate_json(args, target.description, step_dtype, profile, plan, spec,
                               parts)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nplan and estimate written to {args.json}")
    if args.plot:
        plot_plan(profile, plan, Path(args.plot))
        print(f"plot written to {args.plot}")
    return 0


def fit_line(profile: Profile, plan: Plan, spec: DeviceSpec) -> str:
    """Whether the plan's predicted peak fits what the device has for it, at what predicted
    extra time; and if not, what would.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import mlp_chain
        >>> profile = gradckpt.estimate(mlp_chain(4, 8), torch.randn(16, 8), device="l4")
        >>> l4 = gradckpt.predict.devices.DEVICES["l4-24gb"]
        >>> print(fit_line(profile, gradckpt.solve(profile, None, "none"), l4))
        fits: predicted peak ... KiB of 22.00 GiB usable on l4-24gb (24.00 GiB less 2.00 GiB for the CUDA context and allocator reserve); predicted extra time +0.0% (none)
    """  # noqa: E501  (a doctest's output is one line)
    from gradckpt import BudgetError, solve
    from gradckpt.budget import format_bytes

    usable_bytes = profile.notes["device_usable_bytes"]
    reserve_bytes = spec.memory_bytes - usable_bytes
    world_size = profile.notes.get("world_size", 1)
    each = "each " if world_size > 1 else ""
    room = f"{format_bytes(usable_bytes)} usable on {each}{_device_name(spec)}"
    if reserve_bytes:
        room += (
            f" ({format_bytes(spec.memory_bytes)} less {format_bytes(reserve_bytes)} for the CUDA "
            "context and allocator reserve)"
        )
    peak = format_bytes(plan.predicted_peak_bytes)
    if world_size > 1:
        peak = f"per rank {peak}"
    if plan.predicted_peak_bytes <= usable_bytes:
        return (f"fits: predicted peak {peak} of {room}; predicted extra time "
                f"+{100 * plan.predicted_overhead:.1f}% ({plan.strategy})")
    try:
        solve(profile, 1, "optimal")
        least_bytes = 1  # pragma: no cover - no plan fits in one byte
    except BudgetError as error:
        least_bytes = error.minimum_bytes
    if least_bytes <= usable_bytes:
        advice = (
            f"a plan does fit: --budget auto (the {format_bytes(usable_bytes)} usable; the "
            f"least any plan reaches is {format_bytes(least_bytes)})"
        )
    else:
        advice = (
            f"no plan fits: the least any plan reaches is {format_bytes(least_bytes)}; use a "
            "smaller batch or sequence, a lighter optimizer or dtype, "
            + ("more ranks " if world_size > 1 else "") + "or a larger device"
        )
    return f"does not fit: predicted peak {peak}, above the {room}; {advice}"


def estimate_json(
    args: argparse.Namespace, description: str, trained_dtype: str, profile: Profile,
    plan: Plan, spec: DeviceSpec, parts: dict[str, int],
) -> dict[str, Any]:
    """What ``--json FILE`` writes with ``--estimate`` (docs/cli.md lists the keys)."""
    usable_bytes = profile.notes["device_usable_bytes"]
    return {
        "model": args.model,
        "description": description,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": trained_dtype,
        "optimizer": args.optimizer,
        "world_size": profile.notes.get("world_size", 1),
        "plan": json.loads(plan.to_json()),
        "profile": {
            "peak_bytes": profile.peak_bytes,
            "fixed_bytes": profile.fixed_bytes,
            "step_seconds": profile.step_seconds,
        },
        "device": {
            "name": spec.name,
            "description": spec.description,
            "kind": spec.kind,
            "memory_bytes": spec.memory_bytes,
            "flops_per_second": {
                str(dtype).removeprefix("torch."): rate
                for dtype, rate in spec.flops_per_second.items()
            },
            "memory_bandwidth_bytes_per_second": spec.memory_bandwidth_bytes_per_second,
            "source": spec.source,
        },
        "memory_parts": parts,
        "memory_parts_without_checkpointing": profile.notes["memory_parts"],
        "largest_part": max(parts, key=parts.get),
        "device_usable_bytes": usable_bytes,
        "fits": plan.predicted_peak_bytes <= usable_bytes,
    }


def _per_rank(world_size: int) -> str:
    """What the header adds for a sharded estimate.

    Example:
        >>> _per_rank(8)
        ', per rank of 8 (FSDP2/ZeRO-3 sharding)'
        >>> _per_rank(1)
        ''
    """
    return f", per rank of {world_size} (FSDP2/ZeRO-3 sharding)" if world_size > 1 else ""


def _device_name(spec: DeviceSpec) -> str:
    return "this machine" if spec.name == "this" else spec.name


def _trained_dtype(model: Any, dtype: Any) -> str:
    """The dtype the step is predicted in: ``--dtype``, the config's, or the model's own."""
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return str(dtype).removeprefix("torch.")
