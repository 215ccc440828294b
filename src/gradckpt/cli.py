"""The ``gradckpt`` command line.

    gradckpt demo            train TinyGPT plainly and with every block checkpointed; compare
    gradckpt --version

Errors print one line on stderr and exit 1 (``--debug`` shows the traceback instead); usage
errors exit 2, as argparse does.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from gradckpt import __version__

__all__ = ["main", "build_parser"]


# ----------------------------------------------------------------------------------------------
# argument parsing


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
    """How big the demo's model and batch are, and how long it trains and times."""

    layers: int
    batch: int
    seq: int
    steps: int
    timing_repeats: int


# The default runs in well under two minutes on a laptop CPU and shows a clear memory saving;
# --quick is for tests and CI (seconds).
DEFAULT_DEMO = DemoSize(layers=8, batch=16, seq=128, steps=5, timing_repeats=7)
QUICK_DEMO = DemoSize(layers=3, batch=4, seq=64, steps=2, timing_repeats=2)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gradckpt`` command.

    Example:
        >>> build_parser().parse_args(["demo", "--quick"]).quick
        True
    """
    # --debug is accepted before and after the subcommand; SUPPRESS keeps the subcommand's
    # default from overwriting a --debug given before it.
    debug_parent = argparse.ArgumentParser(add_help=False)
    debug_parent.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )

    parser = argparse.ArgumentParser(
        prog="gradckpt",
        description="Gradient checkpointing for PyTorch: trade recomputation for memory.",
    )
    parser.add_argument("--version", action="version", version=f"gradckpt {__version__}")
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        parents=[debug_parent],
        help="train a small GPT with and without checkpointing and compare memory and time",
        description=(
            "Train TinyGPT for a few AdamW steps twice, seeded identically: plainly and with "
            "every transformer block checkpointed. Prints the measured peak memory of one "
            "training step (forward + backward), the step-time ratio, and whether losses and "
            "gradients matched exactly."
        ),
    )
    demo.add_argument(
        "--layers", type=_positive_int, help=f"transformer blocks (default {DEFAULT_DEMO.layers})"
    )
    demo.add_argument(
        "--batch", type=_positive_int, help=f"sequences per batch (default {DEFAULT_DEMO.batch})"
    )
    demo.add_argument(
        "--seq", type=_positive_int, help=f"tokens per sequence (default {DEFAULT_DEMO.seq})"
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        help=f"AdamW training steps per run (default {DEFAULT_DEMO.steps})",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help=(
            f"a tiny run for tests: {QUICK_DEMO.layers} layers, batch {QUICK_DEMO.batch}, "
            f"{QUICK_DEMO.seq} tokens, {QUICK_DEMO.steps} steps (explicit flags still win)"
        ),
    )
    demo.add_argument(
        "--device",
        default="auto",
        help="device to run on: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradckpt`` console script; returns the exit status.

    Example:
        >>> main(["--version"])  # doctest: +SKIP
        gradckpt 0.1.0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("gradckpt: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # one clear line for users; the traceback with --debug
        if args.debug:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"gradckpt: error: {message} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------------------------
# gradckpt demo


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; expected auto, cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the demo runs on cpu or cuda, not {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA GPU")
    return device


def _mebibytes(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def run_demo(args: argparse.Namespace) -> int:
    """``gradckpt demo``: the same training, plain and with every block checkpointed."""
    import torch

    from gradckpt import checkpoint_module
    from gradckpt.measure import compare_step_times, measure_peak_bytes
    from gradckpt.models import GPTConfig, TinyGPT

    preset = QUICK_DEMO if args.quick else DEFAULT_DEMO
    size = DemoSize(
        layers=args.layers or preset.layers,
        batch=args.batch or preset.batch,
        seq=args.seq or preset.seq,
        steps=args.steps or preset.steps,
        timing_repeats=preset.timing_repeats,
    )
    device = _resolve_device(args.device)
    config = GPTConfig(n_layer=size.layers, block_size=size.seq)

    # Two copies of one model: identical weights, one with every block checkpointed.
    torch.manual_seed(args.seed)
    plain = TinyGPT(config).to(device)
    checkpointed = copy.deepcopy(plain)
    for block in checkpointed.transformer.h:
        checkpoint_module(block)

    # Random token batches (next-token prediction on noise: the numbers, not the text, matter).
    generator = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(size.steps):
        tokens = torch.randint(
            0, config.vocab_size, (size.batch, size.seq + 1), generator=generator
        )
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))

    # 1. Train both, seeded identically: dropout draws the same masks, so with correct
    #    checkpointing every loss and gradient must be bit-for-bit the same.
    _progress(f"gradckpt demo: training {size.steps} steps plain, then checkpointed ...")
    runs = {}
    for label, model in (("plain", plain), ("checkpointed", checkpointed)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(args.seed + 1)
        losses = []
        for inputs, targets in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        gradients = [p.grad.detach().clone() for p in model.parameters()]
        runs[label] = (optimizer, torch.stack(losses), gradients)

    plain_losses, checkpointed_losses = runs["plain"][1], runs["checkpointed"][1]
    losses_match = torch.equal(plain_losses, checkpointed_losses)
    gradients_match = all(
        torch.equal(a, b) for a, b in zip(runs["plain"][2], runs["checkpointed"][2], strict=True)
    )
    parameters_match = all(
        torch.equal(a, b)
        for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True)
    )

    # 2. Peak memory of one training step (forward + backward), measured, for each model.
    _progress("gradckpt demo: measuring peak memory of one step ...")
    inputs, targets = batches[0]
    peaks = {}
    for label, model in (("plain", plain), ("checkpointed", checkpointed)):
        optimizer = runs[label][0]
        optimizer.zero_grad(set_to_none=True)

        def forward_backward(model=model):
            model(inputs, targets).backward()

        peaks[label] = measure_peak_bytes(forward_backward, model, optimizer, inputs, targets)

    # 3. Step time, side by side: A, B, A, B, ... after a warm-up; medians.
    _progress("gradckpt demo: timing steps side by side ...")

    def training_step(label, model):
        optimizer = runs[label][0]

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(inputs, targets).backward()
            optimizer.step()

        return step

    median_plain, median_checkpointed = compare_step_times(
        training_step("plain", plain),
        training_step("checkpointed", checkpointed),
        repeats=size.timing_repeats,
        warmup=1,
        device=device,
    )
    time_ratio = median_checkpointed / median_plain

    # 4. The table.
    def verdict(match: bool, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> str:
        if match:
            return "identical (bit for bit)"
        if a is not None and b is not None:
            return f"DIFFERENT (max abs difference {(a - b).abs().max().item():.3g})"
        return "DIFFERENT"

    saving = 1 - peaks["checkpointed"] / peaks["plain"] if peaks["plain"] else 0.0
    rows = [
        ("", "plain", "every block checkpointed"),
        (
            "peak memory, forward+backward",
            _mebibytes(peaks["plain"]),
            f"{_mebibytes(peaks['checkpointed'])} ({-saving:+.0%})",
        ),
        ("step time (median, ratio)", "1.00x", f"{time_ratio:.2f}x"),
    ]
    first_width = max(len(row[0]) for row in rows) + 2
    second_width = max(len(row[1]) for row in rows) + 2
    print(
        f"TinyGPT: {size.layers} layers, n_embd {config.n_embd}, batch {size.batch} x "
        f"{size.seq} tokens, {size.steps} AdamW steps, {device}, torch {torch.__version__}"
    )
    print()
    for name, plain_cell, checkpointed_cell in rows:
        print(f"{name:<{first_width}}{plain_cell:<{second_width}}{checkpointed_cell}")
    checks = [
        (f"losses ({size.steps} steps)", verdict(losses_match, plain_losses, checkpointed_losses)),
        ("gradients", verdict(gradients_match)),
        ("parameters after training", verdict(parameters_match)),
    ]
    for name, result in checks:
        print(f"{name:<{first_width}}{result}")
    print()

    identical = losses_match and gradients_match and parameters_match
    if not identical:
        print(
            "gradckpt demo: FAILED: checkpointed training differs from plain training "
            "(this is a bug in gradckpt; please report it)",
            file=sys.stderr,
        )
        return 1
    change = (
        f"cut the step's peak memory by {saving:.0%}"
        if saving > 0
        else (f"changed the step's peak memory by {-saving:+.0%}")
    )
    print(
        f"Checkpointing every block {change} for {time_ratio:.2f}x the step time, "
        "with bit-identical training."
    )
    return 0
