"""``gradckpt fit MODEL``: when a training step does not fit, the cheapest changes that do.

The model is built on the meta device as for ``gradckpt plan --estimate``, and
``gradckpt.integrations.fit.fit`` predicts the step as it is and, where it does not fit, with
the levers pulled (its docstring says which, in what order, and how the search stays small).
Adapters are made as ``gradckpt plan --lora`` (and ``--qlora``) makes them, by
``fine_tuning.fine_tuned``, so that each option's plan command predicts the same model. What is
printed: the answer for the step as it is, its model and device, the options best first (what
each changes, its predicted peak and time per optimizer step), the ``gradckpt plan`` command
that shows each option's plan, and the levers not tried, with why.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import TYPE_CHECKING

from gradckpt.tables import format_count, format_table

from .builtin_models import DTYPES, PlanTarget
from .errors import CommandLineError
from .estimate import target_device
from .fine_tuning import fine_tuned, trained_dtype
from .model_lookup import resolve_model
from .progress import stage
from .step_arguments import autocast_dtype, check_step_arguments

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradckpt.integrations.fit import Adapters, FineTune, FitOption, FitSearch
    from gradckpt.predict.devices import DeviceSpec

__all__ = ["run_fit"]

# torch's dtype names as --dtype writes them (the inverse of DTYPES).
_SHORT_DTYPES = {f"torch.{name}": short for short, name in DTYPES.items()}


def run_fit(args: argparse.Namespace) -> int:
    """``gradckpt fit MODEL``: the cheapest configurations of the step that fit, printed.

    Example:
        >>> from gradckpt.cli.parser import build_parser
        >>> run_fit(build_parser().parse_args(
        ...     ["fit", "mlp-chain", "--device", "h100", "--batch", "8", "--seq", "64",
        ...      "--budget", "9MiB", "--levers", "recompute,bf16"]))  # doctest: +ELLIPSIS
        does not fit as it is: the least predicted peak of any plan is ... MiB, above the budget of 9.00 MiB on h100-80gb
        mlp_chain(16, 256): 1.05M parameters, batch 8 x 64, float32, optimizer none
        <BLANKLINE>
        the cheapest change that fits, least change to what is trained first, then the fastest ...
        <BLANKLINE>
        #  what changes                            predicted peak  time per step  vs as it is
        1  bf16 throughout; ... blocks recomputed        ... MiB ...
        <BLANKLINE>
        each option's plan, predicted:
          1: gradckpt plan mlp-chain --estimate --device h100-80gb --batch 8 --seq 64 --budget 9MiB --dtype bf16
        Predicted on fake tensors for h100-80gb; ...
        0
    """  # noqa: E501  (doctest output lines are as printed)
    import torch

    from gradckpt.errors import UsageError
    from gradckpt.integrations.fit import check_levers, fit

    check_step_arguments(args, "fit")
    try:
        levers = None if args.levers is None else check_levers(args.levers)
    except UsageError as error:
        raise CommandLineError(f"--levers: {error}") from None
    spec = target_device(args.device)  # an unknown target is told before any slow work
    torch.manual_seed(args.seed)
    stage(f"building {args.model} (configs on the meta device: shapes, no memory)")
    target = resolve_model(args.model, args.batch, args.seq, on_meta=True)
    dtype = trained_dtype(args, target)
    optimizer = None if args.optimizer == "none" else args.optimizer
    started = time.perf_counter()
    search = fit(
        target.model, target.sample, args.budget or "auto", device=spec, optimizer=optimizer,
        dtype=dtype, autocast=autocast_dtype(args), accumulation_steps=args.accumulation_steps,
        keep_output=not args.drop_output, world_size=args.world_size, ddp=args.ddp,
        adapters=_adapters(args), levers=levers, count=args.count,
        max_world_size=args.max_gpus, lora_rank=args.lora or args.adapter_rank,
        lora_targets=args.lora_targets, output_head=args.output_head,
        fine_tune=_fine_tune_as_plan_does(target),
        on_estimate=lambda words: stage(f"estimating: {words}"),
    )
    seconds = time.perf_counter() - started
    print(_as_it_is_line(search, spec))
    print(_header(args, target, dtype, optimizer))
    print()
    _print_options(args, search, spec, seconds)
    print(
        f"Predicted on fake tensors for {spec.name}; times are rooflines of an optimizer step "
        "over the same effective batch (read them as ratios), per GPU with fsdp (its "
        "all-gathers and reduce-scatters left out)."
    )
    return 0


def _print_options(args: argparse.Namespace, search: FitSearch, spec: DeviceSpec,
                   seconds: float) -> None:
    """The options best first, each one's ``gradckpt plan`` command, the levers not tried."""
    if search.options and search.options[0].levers:
        print(f"the {_cheapest(len(search.options))}, least change to what is trained "
              f"first, then the fastest ({search.estimated} configurations estimated in "
              f"{seconds:.0f} s):")
        print()
        print(_options_table(search.options))
        print()
        print("each option's plan, predicted:")
        for number, option in enumerate(search.options, 1):
            print(f"  {number}: {_plan_command(args, option, spec)}")
    if search.skipped:
        print("not tried: " + "; ".join(f"{name} ({reason})"
                                        for name, reason in search.skipped.items()))


def _adapters(args: argparse.Namespace) -> Adapters | None:
    """The adapters the step as it is trains: ``--lora R``, on a 4-bit (``--qlora``) or
    8-bit (``--8bit``) base where given."""
    from gradckpt.integrations.fit import Adapters

    base = ("4-bit" if getattr(args, "qlora", False)
            else "8-bit" if getattr(args, "eight_bit", False) else "as-is")
    if args.lora is None and base == "as-is":
        return None
    return Adapters(args.lora or args.adapter_rank, args.lora_targets, base)


def _fine_tune_as_plan_does(target: PlanTarget) -> FineTune:
    """``fine_tune`` for ``fit``: the model made by ``fine_tuned``, as ``gradckpt plan --lora
    R [--qlora] --dtype D`` makes it; a quantised base it did not build is the lever's skip
    reason."""
    from gradckpt.integrations.fit import LeverSkipped

    def fine_tune(model: nn.Module, adapters: Adapters, dtype: torch.dtype | None
                  ) -> nn.Module:
        options = argparse.Namespace(
            lora=adapters.rank, lora_targets=adapters.targets, autocast=None,
            qlora=adapters.base == "4-bit", eight_bit=adapters.base == "8-bit",
            dtype=_SHORT_DTYPES.get(str(dtype)),
        )
        tuned = fine_tuned(dataclasses.replace(target, model=model, config_dtype=None),
                           options).model
        layer = {"4-bit": "Linear4bit", "8-bit": "Linear8bitLt"}.get(adapters.base)
        if layer and not any(type(m).__name__ == layer for m in tuned.modules()):
            raise LeverSkipped(f"gradckpt plan does not build a {adapters.base} base yet")
        return tuned

    return fine_tune


def _as_it_is_line(search: FitSearch, spec: DeviceSpec) -> str:
    """The answer for the step as it is, first."""
    from gradckpt.budget import format_bytes

    room = f"the budget of {format_bytes(search.budget_bytes)} on {spec.name}"
    best = search.options[0] if search.options else None
    if best is not None and not best.levers:
        return (f"fits as it is: predicted peak {format_bytes(best.predicted_peak_bytes)} "
                f"within {room}, no change needed")
    if best is not None and set(best.levers) <= {"recompute", "chunked-head"}:
        return (f"fits with a plan: predicted peak {format_bytes(best.predicted_peak_bytes)} "
                f"within {room} ({best.description}); nothing else needs to change")
    return (f"does not fit as it is: the least predicted peak of any plan is "
            f"{format_bytes(search.as_is_least_peak_bytes)}, above {room}")


def _header(args: argparse.Namespace, target: PlanTarget, dtype: object,
            optimizer: str | None) -> str:
    from .step_arguments import step_words

    parameters = sum({id(p): p.numel() for p in target.model.parameters()}.values())
    trained = str(dtype or next(p.dtype for p in target.model.parameters())).removeprefix(
        "torch.")
    return (f"{target.description}: {format_count(parameters)} parameters, batch {args.batch} "
            f"x {args.seq}, {trained}, optimizer {optimizer or 'none'}{step_words(args)}"
            + (f", {args.world_size} GPUs (FSDP2)" if args.world_size > 1 else ""))


def _cheapest(count: int) -> str:
    return "cheapest change that fits" if count == 1 else f"{count} cheapest changes that fit"


def _duration(seconds: float) -> str:
    """A roofline step time: three figures, in ms below a second.

    Example:
        >>> _duration(0.000243), _duration(0.412), _duration(12.3)
        ('0.243 ms', '412 ms', '12.3 s')
    """
    return f"{seconds:.3g} s" if seconds >= 1 else f"{1000 * seconds:.3g} ms"


def _options_table(options: list[FitOption]) -> str:
    """One row per option: what it changes, its predicted peak and step time.

    Example:
        >>> from types import SimpleNamespace
        >>> option = SimpleNamespace(description="LoRA r=16 on all-linear; no block recomputed",
        ...     predicted_peak_bytes=2**30, predicted_step_seconds=0.5, relative_time=0.71)
        >>> print(_options_table([option]))
        #  what changes                                 predicted peak  time per step  vs as it is
        1  LoRA r=16 on all-linear; no block recomputed       1.00 GiB         500 ms        0.71x
    """
    from gradckpt.budget import format_bytes

    rows = [
        [str(number), option.description,
         format_bytes(option.predicted_peak_bytes), _duration(option.predicted_step_seconds),
         f"{option.relative_time:.2f}x"]
        for number, option in enumerate(options, 1)
    ]
    header = ["#", "what changes", "predicted peak", "time per step", "vs as it is"]
    return format_table(header, rows, align="llrrr")


def _plan_command(args: argparse.Namespace, option: FitOption, spec: DeviceSpec) -> str:
    """The ``gradckpt plan --estimate`` command line that predicts ``option``'s plan."""

    config = option.configuration
    words = ["gradckpt plan", args.model, "--estimate", "--device", spec.name,
             "--batch", str(config.batch), "--seq", str(args.seq)]
    if args.budget:
        words += ["--budget", args.budget]
    if args.optimizer != "none":
        words += ["--optimizer", args.optimizer]
    if config.dtype is not None and (args.dtype or "bf16" in option.levers):
        words += ["--dtype", _SHORT_DTYPES[str(config.dtype)]]
    if config.autocast is not None:
        words += ["--autocast", _SHORT_DTYPES[str(config.autocast)]]
    if config.accumulation_steps > 1:
        words += ["--accumulation-steps", str(config.accumulation_steps)]
    if not config.keep_output:
        words += ["--trainer"] if args.trainer else ["--drop-output"]
    if config.adapters is not None:
        words += ["--lora", str(config.adapters.rank)]
        if config.adapters.targets:
            words += ["--lora-targets", config.adapters.targets]
        words += {"4-bit": ["--qlora"], "8-bit": ["--8bit"]}.get(config.adapters.base, [])
    if config.world_size > 1:
        words += ["--world-size", str(config.world_size)]
    if config.ddp:
        words += ["--ddp"]
    if args.output_head != "auto":
        words += ["--output-head", args.output_head]
    return " ".join(words)
