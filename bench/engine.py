"""Does gradckpt's engine cost the same as torch.utils.checkpoint for per-layer checkpointing?

The question: with every transformer block of a small GPT checkpointed, is a training step
(forward + backward) with gradckpt's engine as fast as with PyTorch's own
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``, and does it reach the same
peak memory? Three contenders run the same model, weights, batch and random seed:

    A  gradckpt   ``gradckpt.checkpoint(block, x)`` around each block
                  (``--form module``: ``gradckpt.checkpoint_module`` on each block instead)
    B  torch      ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
    C  none       no checkpointing: the reference for memory and time

Run it (3-4 minutes on a quiet 2-core CPU; ``--quick`` is a smoke test of a few seconds):

    .venv/bin/python bench/engine.py
    .venv/bin/python bench/engine.py --quick
    .venv/bin/python bench/engine.py --device cuda --layers 12 --batch 16 --seq 1024

Nothing else CPU-heavy may run meanwhile. The script checks: before each timed round it waits,
asleep, until other processes use at most ``--max-foreign-load`` cores (0.1), and a round during
which they used more ("foreign load", printed per round) is discarded and run again. After
``--patience`` seconds (600) it stops waiting and says the result is unreliable.

How to read the output:

- ``gradients``: A's parameter gradients equal B's and C's bit for bit (dropout included, so the
  RNG replay is exercised). A mismatch stops the script with exit status 1: timing contenders
  that compute different things would be meaningless.
- ``time``: ratios of step times measured side by side in one process
  (``gradckpt.side_by_side.time_side_by_side``: warm-up rounds, then rounds of A, B, C in
  rotating order; one ratio per round). The median is the result; the
  middle half of the rounds (quartiles) and min - max show the noise. A/B is the engine's
  overhead over PyTorch's; A/C and B/C are what recomputation costs (one extra forward pass and
  its bookkeeping: ~1.3-1.6 on CPU). Seconds are printed for orientation only: on shared CPUs
  only the ratios mean something.
- ``memory``: the peak of one training step: ``MemTracker``'s "peak"/"Total" on CPU,
  ``torch.cuda.max_memory_allocated()`` on CUDA, in runs of their own (MemTracker is slow).
  A and B keep the same tensors (each block's input), so A/B must be 1.00.
- The last line is the verdict: the A/B time ratio against the 1.03 target, and peak memory
  equal (A/B rounds to 1.00). The exit status is 0 whatever the verdict.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import _common
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt
from gradckpt.measure import measure_peak_bytes
from gradckpt.side_by_side import Round, summarize_ratios
from gradckpt.toy_models import TinyGPT

TIME_TARGET = 1.03  # gradckpt / torch step-time ratio that passes

RunBlock = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Contender:
    label: str  # "A", "B", "C"
    name: str
    description: str
    run_block: RunBlock
    module_form: bool = False  # checkpoint_module on every block for the duration of the step


def run_plain(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def run_gradckpt(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return gradckpt.checkpoint(block, x)


def run_torch(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint(block, x, use_reentrant=False)


def contenders(form: str) -> list[Contender]:
    if form == "module":
        gradckpt_contender = Contender(
            "A", "gradckpt", "gradckpt.checkpoint_module(block)", run_plain, module_form=True
        )
    else:
        gradckpt_contender = Contender(
            "A", "gradckpt", "gradckpt.checkpoint(block, x)", run_gradckpt
        )
    return [
        gradckpt_contender,
        Contender("B", "torch", "torch.utils.checkpoint (non-reentrant)", run_torch),
        Contender("C", "none", "no checkpointing", run_plain),
    ]


def gpt_loss(
    model: TinyGPT, idx: torch.Tensor, targets: torch.Tensor, run_block: RunBlock
) -> torch.Tensor:
    """``TinyGPT.forward(idx, targets)`` with each block called through ``run_block``.

    Kept line for line equal to the model's own forward; ``check_forward_matches_model`` fails
    the run if the two ever drift apart.
    """
    transformer = model.transformer
    positions = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
    x = transformer.drop(transformer.wte(idx) + transformer.wpe(positions))
    for block in transformer.h:
        x = run_block(block, x)
    logits = model.lm_head(transformer.ln_f(x))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_step(
    model: TinyGPT, idx: torch.Tensor, targets: torch.Tensor, contender: Contender, seed: int
) -> Callable[[], torch.Tensor]:
    """One training step (forward + backward, gradients reset first) for ``contender``."""

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # same dropout masks for every contender
        if contender.module_form:
            for block in model.transformer.h:
                gradckpt.checkpoint_module(block)
        try:
            loss = gpt_loss(model, idx, targets, contender.run_block)
            loss.backward()
        finally:
            if contender.module_form:
                for block in model.transformer.h:
                    gradckpt.uncheckpoint_module(block)
        return loss.detach()

    return step


def check_forward_matches_model(
    model: TinyGPT, idx: torch.Tensor, targets: torch.Tensor, seed: int
) -> None:
    torch.manual_seed(seed)
    expected = model(idx, targets)
    torch.manual_seed(seed)
    actual = gpt_loss(model, idx, targets, run_plain)
    if not torch.equal(expected, actual):
        sys.exit(
            "bench/engine.py: gpt_loss() no longer matches TinyGPT.forward "
            f"(loss {actual.item()!r} vs {expected.item()!r}); update gpt_loss()"
        )


def check_gradients(
    model: TinyGPT, steps: dict[str, Callable[[], torch.Tensor]], names: dict[str, str]
) -> str:
    """Run each step once; all gradients and losses must be bit-for-bit equal. Returns a line."""
    compared = _common.require_identical_gradients(model, steps, display=names.__getitem__)
    reference = next(iter(steps))
    others = ", ".join(names[label] for label in steps if label != reference)
    return (
        f"gradients: {names[reference]} == {others}, bit for bit "
        f"({compared} tensors and the loss)"
    )


# Sizes and repetitions: the full run (one step about 1 s on 2 CPU cores, the script 3-4 minutes)
# and --quick (a smoke test of seconds). Flags given explicitly win over both.
FULL = dict(layers=6, batch=8, seq=256, embd=256, heads=4, rounds=30, warmup=2, patience=600.0)
QUICK = dict(layers=2, batch=2, seq=32, embd=64, heads=2, rounds=3, warmup=1, patience=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="gradckpt vs torch.utils.checkpoint: per-layer checkpointing of TinyGPT. "
        "Defaults in [brackets]: full run / --quick.",
    )
    _common.add_run_arguments(
        parser, FULL, QUICK, {"rounds": "timed rounds, each running A, B and C once"}
    )
    _common.add_device_argument(parser, "auto")
    parser.add_argument(
        "--form",
        choices=["call", "module"],
        default="call",
        help="how A checkpoints: gradckpt.checkpoint(block, x) or checkpoint_module(block) [call]",
    )
    return _common.parse_run_arguments(parser, argv, FULL, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device

    gpt = _common.GPTRun.from_args(args, device)
    model, idx, targets = gpt.model, gpt.sample["idx"], gpt.sample["targets"]

    all_contenders = contenders(args.form)
    names = {c.label: c.name for c in all_contenders}
    steps = {c.label: make_step(model, idx, targets, c, args.seed) for c in all_contenders}

    print("bench/engine.py: per-layer checkpointing, gradckpt vs torch.utils.checkpoint")
    print(_common.describe_machine(device))
    print(gpt.description)
    for c in all_contenders:
        print(f"  {c.label}  {c.name:<9} {c.description}")
    print(f"load average before: {_common.load_average()}")
    print()

    check_forward_matches_model(model, idx, targets, args.seed)
    print(check_gradients(model, steps, names))
    print()

    # ---- time: side by side, rotating order -------------------------------------------------
    print(
        f"time: {args.warmup} warm-up rounds, then {args.rounds} rounds "
        "(seconds per step, for orientation only)"
    )

    def show_round(index: int, measured: Round) -> None:
        seconds = {label: measured.seconds(label) for label in steps}
        parts = "  ".join(f"{label} {seconds[label]:.3f}s" for label in steps)
        loads = [turn.load for turn in measured.turns if turn.load is not None]
        foreign = f"{max(loads):.2f}" if loads else "n/a"
        note = "  DISCARDED (machine busy)" if measured.disturbed else ""
        print(
            f"  round {index + 1:>2}  {parts}  A/B {seconds['A'] / seconds['B']:.3f}  "
            f"foreign load {foreign}{note}",
            flush=True,
        )

    timings = _common.timed_side_by_side(
        steps,
        args.rounds,
        warmup_rounds=args.warmup,
        device=device,
        on_round=show_round,
        max_foreign_cores=args.max_foreign_load,
        patience_seconds=args.patience,
    )
    # Each round's ratios, from the undisturbed rounds (all rounds if none was undisturbed).
    pairs = {pair: _common.ratios_or_all(timings, pair[0], pair[2])[0]
             for pair in ("A/B", "A/C", "B/C")}
    used_rounds = len(pairs["A/B"])
    time_ratios = {pair: summarize_ratios(ratios) for pair, ratios in pairs.items()}

    # ---- memory: one measured step per contender, separately from timing --------------------
    peaks = {}
    for label, step in steps.items():
        model.zero_grad(set_to_none=True)
        peaks[label] = measure_peak_bytes(step, model, idx, targets, device=device)
    model.zero_grad(set_to_none=True)

    # ---- report ---------------------------------------------------------------------------
    print()
    memory_tool = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "MemTracker"
    print(f"memory: peak of one training step ({memory_tool})")
    rows = [
        (
            f"{label}  {names[label]}",
            f"{peaks[label] / _common.MIB:.2f}",
            f"{peaks[label] / peaks['C']:.3f}",
        )
        for label in steps
    ]
    print(_common.format_table(["contender", "peak MiB", "vs none"], rows))
    memory_ratio = peaks["A"] / peaks["B"]
    difference = peaks["A"] - peaks["B"]
    print(f"peak A/B = {memory_ratio:.4f} (A - B = {difference:+,} bytes)")
    print()

    median_seconds = {label: timings.median_seconds(label)
                      or timings.median_seconds(label, include_disturbed=True) for label in steps}
    print(f"time: step-time ratios over {used_rounds} rounds")
    rows = [
        (
            pair,
            f"{stats.median:.3f}",
            f"{stats.lower_quartile:.3f} - {stats.upper_quartile:.3f}",
            f"{stats.low:.3f}",
            f"{stats.high:.3f}",
        )
        for pair, stats in time_ratios.items()
    ]
    print(_common.format_table(["ratio", "median", "middle half", "min", "max"], rows))
    print(
        "median seconds per step: "
        + ", ".join(f"{label} {median_seconds[label]:.3f}" for label in steps)
    )
    discarded = sum(measured.disturbed for measured in timings.rounds)
    print(
        f"rounds: {used_rounds} used, {discarded} discarded because other processes used more "
        f"than {args.max_foreign_load} core; load average after: {_common.load_average()}"
    )
    if not timings.reliable:
        print(
            "WARNING: fewer undisturbed rounds than asked for; the time ratios are suspect. "
            "Rerun on a quiet machine."
        )
    print()

    time_ratio = time_ratios["A/B"].median
    time_verdict = "PASS" if time_ratio <= TIME_TARGET else "FAIL"
    if not timings.reliable:
        time_verdict += " (unreliable: machine busy)"
    memory_verdict = "PASS" if round(memory_ratio, 2) == 1.0 else "FAIL"
    print(
        f"verdict: gradckpt/torch step-time ratio {time_ratio:.3f} "
        f"(target <= {TIME_TARGET:.2f}): {time_verdict}; "
        f"peak memory equal (A/B {memory_ratio:.2f}): {memory_verdict}"
    )
    return 0


if __name__ == "__main__":
    _common.keep_freed_memory()
    sys.exit(main())
