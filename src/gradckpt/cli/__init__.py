"""The ``gradckpt`` command line.

    gradckpt demo                   what checkpointing buys on a small GPT, and the sqrt(n) law
    gradckpt plan MODEL --budget B  the plan for a model: per block, predicted peak and time
    gradckpt plan --list            the built-in models
    gradckpt --version

Exit status: 0 done; 1 an error while working (a missing file, a factory that raised, a budget
no plan meets); 2 a usage error (the command line itself is wrong). Every error is one line on
stderr; ``--debug`` shows the traceback instead. ``python -m gradckpt`` is the same command.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import inspect
import os
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from gradckpt import __version__

__all__ = ["main", "build_parser"]

EXAMPLES = """\
examples:
  gradckpt demo                                   # about a minute on a laptop CPU
  gradckpt demo --quick --out /tmp/demo           # seconds; plots in /tmp/demo
  gradckpt plan --list                            # the built-in models
  gradckpt plan tinygpt --batch 8 --seq 128 --budget 60%
  gradckpt plan path/to/config.json --batch 1 --seq 2048 --budget 6GiB --optimizer adam
  gradckpt plan mypackage.models:build --budget 2GiB --json plan.json --plot frontier.png
"""


# ----------------------------------------------------------------------------------------------
# Errors and argument parsing
# ----------------------------------------------------------------------------------------------


class CommandLineError(Exception):
    """The command line is wrong (exit status 2); the message says what to write instead."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: what was wrong and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: usage error: {message} (see '{self.prog} --help')\n")


def _paragraph(text: str) -> str:
    """Wrapped for --help (the raw formatter, kept for the examples, does not wrap)."""
    return textwrap.fill(text, width=88)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


@dataclass(frozen=True)
class DemoSize:
    """How big the demo's model, batch and chains are, and how long it trains and times.

    ``layers``..``timing_repeats``: the GPT of part 1. ``depths``: the chain lengths of the
    sqrt(n) table; chains up to ``measured_depth`` blocks are also run and measured. Each chain
    block is an MLP layer of ``chain_width`` on ``chain_rows`` rows.
    """

    layers: int
    batch: int
    seq: int
    steps: int
    timing_repeats: int
    depths: tuple[int, ...]
    measured_depth: int
    chain_width: int
    chain_rows: int


# The default runs in about a minute on a 2-core CPU; --quick is for tests and CI (seconds).
# Chain blocks are narrow and tall (small weights, large activations), so that the sqrt(n)
# table is about activations, not parameter gradients.
DEFAULT_DEMO = DemoSize(
    layers=8, batch=16, seq=128, steps=2, timing_repeats=4,
    depths=(4, 8, 16, 32, 64, 100, 256), measured_depth=16,
    chain_width=128, chain_rows=4096,
)
QUICK_DEMO = DemoSize(
    layers=3, batch=4, seq=64, steps=2, timing_repeats=2,
    depths=(4, 8, 16, 100), measured_depth=8,
    chain_width=64, chain_rows=1024,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gradckpt`` command.

    Example:
        >>> build_parser().parse_args(["demo", "--quick"]).quick
        True
        >>> build_parser().parse_args(["plan", "tinygpt", "--budget", "60%"]).budget
        '60%'
    """
    # --debug is accepted before and after the subcommand; SUPPRESS keeps the subcommand's
    # default from overwriting a --debug given before it.
    debug_parent = argparse.ArgumentParser(add_help=False)
    debug_parent.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    parser = _Parser(
        prog="gradckpt",
        description="Gradient checkpointing for PyTorch: state a memory budget, get a plan.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gradckpt {__version__}")
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo_parser(commands, debug_parent)
    _add_plan_parser(commands, debug_parent)
    return parser


def _add_demo_parser(commands: Any, debug_parent: argparse.ArgumentParser) -> None:
    demo = commands.add_parser(
        "demo",
        parents=[debug_parent],
        help="what each strategy costs on a small GPT, the sqrt(n) table, and plots",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraph(
            "1. Profiles TinyGPT, plans it with none / every-layer / sqrt / optimal at a few "
            "budgets, and measures each plan's peak memory (forward + backward), step time and "
            "whether training stays bit-identical. 2. The sqrt(n) table: activation memory and "
            "extra forward work of each strategy on chains of n identical blocks, computed by "
            "the solvers and measured where quick. 3. Plots (PNG) in --out."
        ),
    )
    size = DEFAULT_DEMO
    demo.add_argument("--layers", type=_positive_int, help=f"GPT blocks (default {size.layers})")
    demo.add_argument(
        "--batch", type=_positive_int, help=f"sequences per batch (default {size.batch})"
    )
    demo.add_argument("--seq", type=_positive_int, help=f"tokens per sequence (default {size.seq})")
    demo.add_argument(
        "--steps",
        type=_positive_int,
        help=f"AdamW steps of the bit-identity check (default {size.steps})",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help=(
            f"a small run for tests: {QUICK_DEMO.layers} layers, batch {QUICK_DEMO.batch}, "
            f"{QUICK_DEMO.seq} tokens, chains of {', '.join(map(str, QUICK_DEMO.depths))} "
            "blocks (explicit flags still win)"
        ),
    )
    demo.add_argument(
        "--out",
        default="gradckpt-demo",
        help="folder for the PNG plots (default ./gradckpt-demo/)",
    )
    demo.add_argument(
        "--device",
        default="auto",
        help="device to run on: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=run_demo)


def _add_plan_parser(commands: Any, debug_parent: argparse.ArgumentParser) -> None:
    plan = commands.add_parser(
        "plan",
        parents=[debug_parent],
        help="profile a model and print the checkpointing plan for a budget",
        description=_paragraph(
            "Profile one training step of MODEL on this machine, solve for the budget and "
            "print the plan: what happens to each block, the predicted peak and extra time, "
            "and what takes the memory. MODEL is a Hugging Face config.json (or a folder "
            "holding one; the model is built with random weights, nothing is downloaded), a "
            "built-in name (--list), or package.module:factory, a function returning a module "
            "or (module, sample); it gets batch= and seq= when it takes them."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("model", nargs="?", metavar="MODEL", help="what to plan (see above)")
    plan.add_argument("--list", action="store_true", help="list the built-in models and exit")
    plan.add_argument("--batch", type=_positive_int, default=4, help="batch size (default 4)")
    plan.add_argument(
        "--seq", type=_positive_int, default=128, help="tokens per sequence (default 128)"
    )
    plan.add_argument(
        "--budget",
        help="peak memory of a training step: 6GiB, 512MiB, 6GB, 60%% (of the peak without "
        "checkpointing) or auto; needed by the optimal and chen-greedy strategies",
    )
    plan.add_argument(
        "--strategy",
        default="optimal",
        help="none, every-layer, sqrt, chen-greedy or optimal (default)",
    )
    plan.add_argument(
        "--optimizer",
        choices=["none", "adam"],
        default="none",
        help="adam: count Adam's state (2 fp32 values per parameter) in the peak and budget",
    )
    plan.add_argument(
        "--drop-output",
        action="store_true",
        help="the training loop drops the model's output before backward, as the Hugging Face "
        "Trainer does; by default it is held through backward (out = model(**batch); "
        "out.loss.backward()), which for a language model keeps the logits alive",
    )
    plan.add_argument("--json", metavar="FILE", help="write the plan as JSON (Plan.from_json)")
    plan.add_argument("--plot", metavar="FILE", help="write the memory/time frontier as a PNG")
    plan.add_argument(
        "--device", default="auto", help="where to profile: auto (default), cpu, cuda, cuda:1, ..."
    )
    plan.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    plan.set_defaults(func=run_plan)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradckpt`` console script; returns the exit status.

    Example:
        >>> main(["plan", "--list"])  # doctest: +ELLIPSIS
        tinygpt ...
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("gradckpt: interrupted", file=sys.stderr)
        return 130
    except CommandLineError as error:
        if args.debug:
            raise
        print(f"gradckpt {args.command}: usage error: {_one_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # one clear line for users; the traceback with --debug
        if args.debug:
            raise
        print(
            f"gradckpt: error: {_one_line(error)} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def _resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; expected auto, cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"gradckpt runs on cpu or cuda, not {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for, but torch sees no CUDA GPU")
    return device


def _profile_with_bar(model, sample, **options: Any):
    """``gradckpt.profile`` with a bar on stderr: every profile the command line takes shows
    one, as profiling is the slow part of both commands."""
    import gradckpt
    from gradckpt.cli.progress import progress_bar

    with progress_bar("gradckpt: profiling") as report:
        return gradckpt.profile(model, sample, progress=report, **options)


def _mebibytes(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe_plan(plan, block_count: int) -> str:
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


def _frontier(profile, steps: int = 16) -> list:
    """Predicted (peak, time) of the optimal plans for budgets from the least to no limit."""
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


# ----------------------------------------------------------------------------------------------
# gradckpt demo, part 1: each strategy on a small GPT, measured
# ----------------------------------------------------------------------------------------------


@dataclass
class _PlanRun:
    """One plan of the demo's GPT and what was measured with it installed."""

    label: str
    budget: str
    plan: Any
    peak_bytes: int = 0
    median_seconds: float = 0.0
    losses: Any = None
    parameters: list = dataclasses.field(default_factory=list)


def _demo_size(args: argparse.Namespace) -> DemoSize:
    preset = QUICK_DEMO if args.quick else DEFAULT_DEMO
    return dataclasses.replace(
        preset,
        layers=args.layers or preset.layers,
        batch=args.batch or preset.batch,
        seq=args.seq or preset.seq,
        steps=args.steps or preset.steps,
    )


def _demo_plans(profile) -> list[_PlanRun]:
    """The fixed strategies, and optimal at 75% and 50% of the plain peak and at its least."""
    from gradckpt import BudgetError, solve
    from gradckpt.budget import format_bytes
    from gradckpt.solvers import BUDGET_DRIVEN

    runs = [_PlanRun(name, "-", solve(profile, None, name)) for name in ("none", "every-layer")]
    runs.append(_PlanRun("sqrt", "-", solve(profile, None, "sqrt")))
    lowest = BUDGET_DRIVEN["optimal"](profile)
    for budget in ("75%", "50%", lowest):
        try:
            plan = solve(profile, budget, "optimal")
        except BudgetError:
            continue  # a small model may not go down to 50%: the least-memory row covers it
        label = budget if isinstance(budget, str) else f"least, {format_bytes(budget)}"
        runs.append(_PlanRun("optimal", label, plan))
    return runs


def _measure_peaks(model, sample, runs: list[_PlanRun], device) -> None:
    import gradckpt
    from gradckpt.cli.progress import with_progress
    from gradckpt.measure import measure_peak_bytes
    from gradckpt.measure.step import training_step

    def forward_backward() -> None:
        training_step(model, sample)  # as profile() measured it

    for run in with_progress(runs, "gradckpt: measuring the peak of each plan"):
        gradckpt.apply(model, run.plan)
        model.zero_grad(set_to_none=True)  # as in profile(): gradients start the step as None
        run.peak_bytes = measure_peak_bytes(
            forward_backward, model, *sample.values(), device=device
        )
    gradckpt.disable(model)
    model.zero_grad(set_to_none=True)


def _time_plans(model, sample, runs: list[_PlanRun], repeats: int, device) -> None:
    """Median forward+backward time of each plan, in rounds (A, B, C, ..., A, B, C, ...)."""
    import gradckpt
    from gradckpt.cli.progress import with_progress
    from gradckpt.measure.step import training_step

    times: dict[int, list[float]] = {index: [] for index in range(len(runs))}
    rounds = range(1 + repeats)
    for round_index in with_progress(rounds, "gradckpt: timing the plans side by side"):
        for index, run in enumerate(runs):
            gradckpt.apply(model, run.plan)  # outside the timed part: installing is not a step
            model.zero_grad(set_to_none=True)
            _synchronize(device)
            start = time.perf_counter()
            training_step(model, sample)  # the step _measure_peaks and profile() measure
            _synchronize(device)
            if round_index:  # round 0 warms up
                times[index].append(time.perf_counter() - start)
    gradckpt.disable(model)
    model.zero_grad(set_to_none=True)
    for index, run in enumerate(runs):
        run.median_seconds = statistics.median(times[index])


def _train_plans(model, batches, runs: list[_PlanRun], seed: int) -> None:
    """A few AdamW steps under each plan, from the same weights and seed: losses, weights."""
    import torch

    import gradckpt
    from gradckpt.cli.progress import with_progress

    initial = copy.deepcopy(model.state_dict())
    training = f"gradckpt: training {len(batches)} AdamW steps under each plan"
    for run in with_progress(runs, training):
        model.load_state_dict(initial)
        gradckpt.apply(model, run.plan)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(seed + 1)  # the same dropout masks for every plan
        losses = []
        for inputs, targets in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        run.losses = torch.stack(losses)
        run.parameters = [parameter.detach().clone() for parameter in model.parameters()]
    gradckpt.disable(model)
    model.load_state_dict(initial)


def _identical_to(run: _PlanRun, reference: _PlanRun) -> bool:
    import torch

    return torch.equal(run.losses, reference.losses) and all(
        torch.equal(a, b) for a, b in zip(run.parameters, reference.parameters, strict=True)
    )


def _compare_strategies(size: DemoSize, device, seed: int) -> tuple[str, list[_PlanRun], Any]:
    """Part 1: the GPT planned each way; returns the heading, the measured runs, the profile."""
    import torch

    from gradckpt.cli.progress import stage
    from gradckpt.models import GPTConfig, TinyGPT

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
    profile = _profile_with_bar(model, sample)
    runs = _demo_plans(profile)
    _measure_peaks(model, sample, runs, device)
    _time_plans(model, sample, runs, size.timing_repeats, device)
    _train_plans(model, batches, runs, seed)
    heading = (
        f"TinyGPT: {size.layers} blocks, n_embd {config.n_embd}, batch {size.batch} x "
        f"{size.seq} tokens, {device}, torch {torch.__version__}"
    )
    return heading, runs, profile


def _strategies_table(runs: list[_PlanRun], block_count: int, steps: int) -> str:
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
            f"{run.median_seconds / reference.median_seconds:.2f}x",
            "(reference)" if run is reference
            else "identical" if _identical_to(run, reference) else "DIFFERENT",
        ])
    header = [
        "strategy", "budget", "plan", "predicted peak", "measured peak", "step time",
        f"training ({steps} steps)",
    ]
    return format_table(header, rows, align="lllrrrl")


# ----------------------------------------------------------------------------------------------
# gradckpt demo, part 2: the sqrt(n) table
# ----------------------------------------------------------------------------------------------

SQRT_TABLE_STRATEGIES = ("none", "every-layer", "sqrt", "optimal")


@dataclass
class _DepthRow:
    """One chain length of the sqrt(n) table, in blocks' worth and extra forward passes."""

    depth: int
    memory: dict[str, float]  # strategy -> activation memory, in blocks' worth
    extra_forwards: dict[str, float]  # strategy -> extra forward passes of the chain
    measured: dict[str, float]  # strategy -> measured activation memory (short chains only)


def homogeneous_chain(block, depth: int):
    """A profile of ``depth`` copies of ``block`` (a ``BlockProfile``), named ``"0"``, ``"1"``...

    Named as the blocks of an ``nn.Sequential``, so its plans apply to ``mlp_chain(depth, ...)``.

    Example:
        >>> from gradckpt.profile_types import BlockProfile
        >>> chain = homogeneous_chain(BlockProfile("b", 10, 10, 50, True, 1.0, 2.0), 100)
        >>> len(chain.blocks), chain.blocks[99].name, chain.step_seconds
        (100, '99', 300.0)
    """
    from gradckpt.plan import simulate
    from gradckpt.profile_types import Profile

    blocks = [dataclasses.replace(block, name=str(index)) for index in range(depth)]
    seconds = depth * (block.forward_seconds + block.backward_seconds)
    chain = Profile(blocks, peak_bytes=0, fixed_bytes=0, step_seconds=seconds)
    chain.peak_bytes = simulate(chain, [])[0]
    return chain


def sqrt_plans(chain) -> dict[str, Any]:
    """none, every-layer and sqrt plans of a chain, and optimal within the sqrt plan's memory.

    Example:
        >>> from gradckpt.profile_types import BlockProfile
        >>> chain = homogeneous_chain(BlockProfile("b", 10, 10, 50, True, 1.0, 2.0), 100)
        >>> plans = sqrt_plans(chain)
        >>> plans["sqrt"].predicted_peak_bytes / 50, plans["sqrt"].predicted_extra_seconds
        (12.0, 100.0)
        >>> plans["optimal"].predicted_extra_seconds < 100  # the same memory, less recomputation
        True
    """
    from gradckpt import solve

    plans = {name: solve(chain, None, name) for name in ("none", "every-layer", "sqrt")}
    plans["optimal"] = solve(chain, plans["sqrt"].predicted_peak_bytes, "optimal")
    return plans


def _measure_chain_block(size: DemoSize, seed: int):
    """The profile of one MLP block, measured inside a short chain (its inner block)."""
    import torch

    from gradckpt.models import mlp_chain

    torch.manual_seed(seed)
    chain = mlp_chain(4, size.chain_width)
    rows = torch.randn(size.chain_rows, size.chain_width)
    return _profile_with_bar(chain, rows).blocks[1]  # an inner block: input from a block


def _measured_memory(block, depth: int, plans: dict[str, Any], size: DemoSize, seed: int):
    """Run the chain under each plan: activation memory in blocks' worth, measured.

    The peak outside the chain's activations (weights, gradients, input) is what the plain
    step's measured peak leaves over the computed plain chain; the rest is the plan's doing.
    """
    import torch

    import gradckpt
    from gradckpt.measure import measure_peak_bytes
    from gradckpt.models import mlp_chain
    from gradckpt.plan import simulate

    torch.manual_seed(seed)
    chain = mlp_chain(depth, size.chain_width)
    rows = torch.randn(size.chain_rows, size.chain_width)
    peaks = {}
    for name, plan in plans.items():
        gradckpt.apply(chain, plan)
        chain.zero_grad(set_to_none=True)
        peaks[name] = measure_peak_bytes(lambda: chain(rows).sum().backward(), chain, rows)
    gradckpt.disable(chain)
    outside_bytes = peaks["none"] - simulate(homogeneous_chain(block, depth), [])[0]
    return {
        name: (peak - outside_bytes) / block.saved_bytes
        for name, peak in peaks.items()
        if name != "none"  # equal to the computed value by construction
    }


def _sqrt_rows(size: DemoSize, seed: int) -> tuple[Any, list[_DepthRow]]:
    """Part 2: per chain length, each strategy's memory and extra forwards."""
    from gradckpt.cli.progress import stage, with_progress
    from gradckpt.plan import simulate

    stage("profiling one MLP block")
    block = _measure_chain_block(size, seed)
    rows = []
    solving = "gradckpt: solving chains of n blocks (measuring the short ones)"
    for depth in with_progress(size.depths, solving):
        chain = homogeneous_chain(block, depth)
        plans = sqrt_plans(chain)
        # In extra forward passes: one pass recomputes every block once.
        chain_recompute_seconds = depth * block.recompute_seconds()
        memory, extra = {}, {}
        for name, plan in plans.items():
            chain_peak, extra_seconds = simulate(chain, plan.segments)
            memory[name] = chain_peak / block.saved_bytes
            extra[name] = (extra_seconds / chain_recompute_seconds
                           if chain_recompute_seconds else 0.0)
        measured = {}
        if depth <= size.measured_depth:
            measured = _measured_memory(block, depth, plans, size, seed)
        rows.append(_DepthRow(depth, memory, extra, measured))
    return block, rows


def _sqrt_table(rows: list[_DepthRow]) -> str:
    from gradckpt.report import format_table

    table_rows = []
    for row in rows:
        cells = [str(row.depth)]
        cells += [
            f"{row.memory[name]:.1f} / +{row.extra_forwards[name]:.2f}"
            for name in SQRT_TABLE_STRATEGIES
        ]
        measured = [row.measured.get(name) for name in SQRT_TABLE_STRATEGIES[1:]]
        cells.append(
            " / ".join(f"{value:.1f}" for value in measured) if row.measured else "-"
        )
        table_rows.append(cells)
    header = ["n", *SQRT_TABLE_STRATEGIES, "measured: every-layer / sqrt / optimal"]
    return format_table(header, table_rows, align="rrrrrr")


def _sqrt_verdict(rows: list[_DepthRow]) -> str:
    row = min(rows, key=lambda r: abs(r.depth - 100))
    return (
        f"At n = {row.depth}: no checkpointing keeps {row.memory['none']:.1f} blocks' worth; "
        f"sqrt keeps {row.memory['sqrt']:.1f} for +{row.extra_forwards['sqrt']:.2f} forward "
        f"pass; optimal, given the same memory, recomputes +{row.extra_forwards['optimal']:.2f}."
    )


# ----------------------------------------------------------------------------------------------
# gradckpt demo: the whole
# ----------------------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    """``gradckpt demo``: each strategy measured on a GPT, the sqrt(n) table, plots."""
    size = _demo_size(args)
    device = _resolve_device(args.device)

    heading, runs, profile = _compare_strategies(size, device, args.seed)
    block, depth_rows = _sqrt_rows(size, args.seed)

    print(heading)
    print("Peak memory of a training step (forward + backward) and its time, under each plan:")
    print()
    print(_strategies_table(runs, len(profile.blocks), size.steps))
    print()
    print(textwrap.fill(
        f"sqrt(n): chains of n identical blocks (Linear {size.chain_width}->"
        f"{size.chain_width} + GELU + Dropout on {size.chain_rows} rows, measured here). "
        "Each cell: activation memory in blocks' worth (what one block keeps for backward) / "
        "extra forward passes. optimal gets the sqrt plan's memory.",
        width=100,
    ))
    print()
    print(_sqrt_table(depth_rows))
    print()
    print(_sqrt_verdict(depth_rows))
    _write_demo_plots(Path(args.out), runs, profile, depth_rows)

    reference = runs[0]
    if not all(_identical_to(run, reference) for run in runs):
        print(
            "gradckpt demo: FAILED: training under a plan differs from plain training "
            "(this is a bug in gradckpt; please report it)",
            file=sys.stderr,
        )
        return 1
    return 0


def _write_demo_plots(out: Path, runs: list[_PlanRun], profile, rows: list[_DepthRow]) -> None:
    from gradckpt.report import (
        PlotsUnavailable,
        StrategyPoint,
        plot_frontier,
        plot_memory_vs_depth,
    )

    reference_seconds = runs[0].median_seconds
    points = [
        StrategyPoint(
            run.label if run.budget == "-" else f"optimal {run.budget.split(',')[0]}",
            run.peak_bytes,
            run.median_seconds / reference_seconds,
        )
        for run in runs
    ]
    depths = [row.depth for row in rows]
    try:
        written = [
            plot_frontier(
                points,
                out / "frontier.png",
                frontier=_frontier(profile),
                title="TinyGPT: measured peak and step time of each plan",
            ),
            plot_memory_vs_depth(
                depths,
                {name: [row.memory[name] for row in rows] for name in SQRT_TABLE_STRATEGIES},
                out / "memory_vs_depth.png",
                measured_by_strategy={
                    name: [(row.depth, row.measured[name]) for row in rows if row.measured]
                    for name in SQRT_TABLE_STRATEGIES[1:]
                },
                title="Activation memory of n identical blocks",
            ),
        ]
    except PlotsUnavailable as error:
        print(f"\nplots skipped: {error}")
        return
    print(f"\nplots: {', '.join(str(path) for path in written)}")


# ----------------------------------------------------------------------------------------------
# gradckpt plan: what to plan (MODEL)
# ----------------------------------------------------------------------------------------------


@dataclass
class _Target:
    """A model to plan, the batch it trains on, and a few words saying what it is."""

    model: Any
    sample: Any
    description: str


def _tinygpt(layers: int) -> Callable[[int, int], _Target]:
    def build(batch: int, seq: int) -> _Target:
        import torch

        from gradckpt.models import GPTConfig, TinyGPT

        model = TinyGPT(GPTConfig(n_layer=layers, block_size=max(seq, 128)))
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1))
        sample = {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}
        return _Target(model, sample, "TinyGPT (n_embd 128, vocab 512)")

    return build


def _mlp_chain(batch: int, seq: int) -> _Target:
    import torch

    from gradckpt.models import mlp_chain

    return _Target(mlp_chain(16, 256), torch.randn(batch, seq, 256), "mlp_chain(16, 256)")


BUILTIN_MODELS: dict[str, tuple[str, Callable[[int, int], _Target]]] = {
    "tinygpt": ("TinyGPT, 8 blocks, n_embd 128, vocab 512 (the demo's GPT)", _tinygpt(8)),
    "tinygpt-24": ("TinyGPT, 24 blocks, n_embd 128, vocab 512", _tinygpt(24)),
    "mlp-chain": ("16 blocks of Linear 256->256 + GELU + Dropout; input (batch, seq, 256)",
                  _mlp_chain),
}

_FACTORY_PATTERN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _builtin_list() -> str:
    from gradckpt.report import format_table

    rows = [[name, description] for name, (description, _) in BUILTIN_MODELS.items()]
    return format_table(["built-in model", "what it is"], rows, align="ll").split("\n", 1)[1]


def resolve_model(spec: str, batch: int, seq: int) -> _Target:
    """The model MODEL names: a config.json or a folder with one, a built-in, or a factory.

    Example:
        >>> target = resolve_model("mlp-chain", batch=2, seq=3)
        >>> target.description, tuple(target.sample.shape)
        ('mlp_chain(16, 256)', (2, 3, 256))
    """
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"folder {spec} holds no config.json")
    if path.is_file():
        return _from_config_json(path, batch, seq)
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec][1](batch, seq)
    if _FACTORY_PATTERN.fullmatch(spec):
        return _from_factory(spec, batch, seq)
    if spec.endswith(".json") or os.sep in spec:
        raise FileNotFoundError(f"no such file: {spec}")
    raise CommandLineError(
        f"unknown model {spec!r}: give a Hugging Face config.json (or a folder holding one), "
        f"a built-in name ({', '.join(BUILTIN_MODELS)}; see 'gradckpt plan --list') or "
        "package.module:factory"
    )


def _from_config_json(path: Path, batch: int, seq: int) -> _Target:
    from gradckpt.integrations import hf

    try:
        model = hf.model_from_config_json(path)
    except hf.NoLanguageModelError as error:
        raise ValueError(
            f"{error}; plan it with package.module:factory (a function returning the model and "
            "a sample)"
        ) from None
    sample = hf.token_sample(model, batch, seq)
    return _Target(model, sample, f"{type(model).__name__} from {path}")


def _from_factory(spec: str, batch: int, seq: int) -> _Target:
    from torch import nn

    from gradckpt.integrations import hf

    module_name, function_name = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: factories next to the user
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"cannot import {module_name!r} for {spec}: {error}") from None
    factory = module
    for attribute in function_name.split("."):
        factory = getattr(factory, attribute, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no function {function_name!r} (from {spec})")
    parameters = _parameter_names(factory)
    keywords = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in parameters}
    try:
        result = factory(**keywords)
    except Exception as error:
        raise RuntimeError(
            f"factory {spec} raised {type(error).__name__}: {_one_line(error)}"
        ) from error
    model, sample = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"factory {spec} returned {type(model).__name__}; it must return an nn.Module or "
            "(module, sample)"
        )
    if sample is None:
        if not hf.is_language_model(model):
            raise ValueError(
                f"factory {spec} returned a {type(model).__name__} without a sample, and "
                "gradckpt cannot tell what it takes: return (model, sample), where the sample "
                "is a tensor, a tuple or a dict of the model's inputs"
            )
        sample = hf.token_sample(model, batch, seq)
    return _Target(model, sample, f"{type(model).__name__} from {spec}")


def _parameter_names(function: Callable) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


# ----------------------------------------------------------------------------------------------
# gradckpt plan
# ----------------------------------------------------------------------------------------------


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


def _optimizer_state_bytes(model, optimizer: str) -> int:
    """Adam keeps two fp32 values (moments) per trainable parameter; other choices nothing."""
    if optimizer != "adam":
        return 0
    return sum(8 * p.numel() for p in model.parameters() if p.requires_grad)


def _memory_parts(model, profile, plan, optimizer_bytes: int) -> list[tuple[str, int]]:
    """What takes the step's memory at the predicted peak, part by part."""
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gradient_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )
    activation_bytes = _retained_activation_bytes(profile, plan)
    head_bytes = getattr(profile, "head_bytes", 0)  # the logits, mostly, where profiled
    parts = [
        ("parameters", parameter_bytes),
        ("gradients", gradient_bytes),
        ("activations kept for backward (under this plan)", activation_bytes),
    ]
    if head_bytes:
        parts.append(("logits and loss (the output head)", head_bytes))
    if optimizer_bytes:
        parts.append(("optimizer state (Adam, predicted)", optimizer_bytes))
    rest = plan.predicted_peak_bytes - parameter_bytes - gradient_bytes - activation_bytes
    rest -= head_bytes
    if rest > 0:
        parts.append(("the rest (inputs, temporaries, recomputation)", rest))
    return parts


def _retained_activation_bytes(profile, plan) -> int:
    """What the chain keeps for backward at the end of the forward pass under the plan."""
    blocks = profile.blocks
    covered = {index for segment in plan.segments for index in segment.blocks()}
    kept = sum(block.saved_bytes for index, block in enumerate(blocks) if index not in covered)
    inputs = sum(blocks[segment.start].input_bytes for segment in plan.segments)
    matmuls = sum(
        blocks[index].matmul_bytes
        for segment in plan.segments
        if segment.policy and not segment.children
        for index in segment.blocks()
    )
    return kept + inputs + matmuls


def _solve_with_optimizer(profile, budget: str | None, strategy: str, optimizer_bytes: int):
    """Solve with the optimizer's state taken out of the budget (it is alive all step)."""
    from gradckpt import BudgetError, solve
    from gradckpt.budget import format_bytes, parse_budget

    if budget is None:
        return solve(profile, None, strategy)
    budget_bytes = parse_budget(
        budget, unconstrained_peak_bytes=profile.peak_bytes + optimizer_bytes
    )
    if budget_bytes <= optimizer_bytes:
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} does not even hold Adam's state, "
            f"{format_bytes(optimizer_bytes)}; raise the budget",
            minimum_bytes=optimizer_bytes,
        )
    try:
        return solve(profile, budget_bytes - optimizer_bytes, strategy)
    except BudgetError as error:
        if not optimizer_bytes:
            raise
        minimum = error.minimum_bytes + optimizer_bytes
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} is below the smallest peak {strategy} reaches "
            f"with Adam's state, {format_bytes(minimum)}; raise the budget to at least that",
            minimum_bytes=minimum,
        ) from None


def run_plan(args: argparse.Namespace) -> int:
    """``gradckpt plan``: profile MODEL, solve for the budget, print (and write) the plan."""
    import torch

    from gradckpt.budget import format_bytes
    from gradckpt.cli.progress import stage
    from gradckpt.report import memory_breakdown_table

    if args.list:
        print(_builtin_list())
        return 0
    _check_plan_arguments(args)
    device = _resolve_device(args.device)
    torch.manual_seed(args.seed)
    stage(f"building {args.model}")
    target = resolve_model(args.model, args.batch, args.seq)
    model = target.model.to(device).train()
    sample = _to_device(target.sample, device)
    stage("profiling one training step and each block")
    profile = _profile_with_bar(model, sample, keep_output=not args.drop_output)
    optimizer_bytes = _optimizer_state_bytes(model, args.optimizer)
    plan = _solve_with_optimizer(profile, args.budget, args.strategy, optimizer_bytes)

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
            f"with Adam's state ({format_bytes(optimizer_bytes)}, predicted): predicted peak "
            f"{format_bytes(plan.predicted_peak_bytes + optimizer_bytes)}"
        )
    print()
    print(memory_breakdown_table(_memory_parts(model, profile, plan, optimizer_bytes)))
    if args.json:
        Path(args.json).write_text(plan.to_json())
        print(f"\nplan written to {args.json}")
    if args.plot:
        _plot_plan(profile, plan, Path(args.plot))
        print(f"plot written to {args.plot}")
    return 0


def _to_device(sample: Any, device) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, sample)


def _plot_plan(profile, plan, path: Path) -> None:
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
    plot_frontier(points, path, frontier=_frontier(profile), title="Predicted peak and step time")

