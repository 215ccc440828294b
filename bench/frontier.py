"""Does gradckpt's "optimal" plan beat the checkpointing users write today, at the same memory?

The question (the memory/time frontier): on a small GPT on CPU, how much peak memory and extra
step time does each common way of checkpointing cost, and how much extra time does gradckpt's
``"optimal"`` plan need when its budget is each of those peaks? Goal: never worse, clearly better
where an anchor wastes recomputation. Every contender runs the same model instance (same weights,
batch and seed), measured side by side in one run:

    anchors, the way users checkpoint today:
      none                  no checkpointing: the reference for memory and time
      every layer           each block in ``torch.utils.checkpoint.checkpoint(block, x,
                            use_reentrant=False)`` (what ``gradient_checkpointing_enable()`` does)
      every 2nd layer       blocks 0, 2, 4, ... wrapped the same way, the others plain (what
                            Transformers' ``every_n_layers``-style options do)
      every 4th layer       blocks 0, 4, 8, ... likewise
      selective (matmuls)   every block wrapped, with ``create_selective_checkpoint_contexts``
                            saving matmul and attention outputs (MUST_SAVE), recomputing the rest
    gradckpt:
      gradckpt @ <anchor>   ``gradckpt.solve(gradckpt.profile(model, sample), P, "optimal")``
                            with P = the anchor's measured peak, installed with ``gradckpt.apply``

Run it (about 10 minutes on a quiet 2-core CPU, 40 rounds; ``--rounds 16`` takes 4 minutes
and its extra times move by about 10% from run to run; ``--quick`` is a smoke test of seconds):

    .venv/bin/python bench/frontier.py
    .venv/bin/python bench/frontier.py --quick
    .venv/bin/python bench/frontier.py --verbose        # also print each gradckpt plan in full
    .venv/bin/python bench/frontier.py --device cuda    # on a GPU (bench/device_check.sh)

Nothing else CPU-heavy may run meanwhile: like ``bench/engine.py`` the script waits, asleep,
until other processes use at most ``--max-foreign-load`` cores before each timed round, discards
what it timed while they used more, and runs more rounds until each contender has ``--rounds``
undisturbed ones.

How it times (``gradckpt.side_by_side.time_side_by_side``, bracketed, through
``_common.timed_side_by_side``): a round runs a block of "none", then each other contender's
block followed by another block of "none", the contenders in an order shuffled afresh each
round (seeded by ``--seed``). A block is ``--warmup`` untimed steps, then ``--steps`` timed ones
(the block's time: their median), the contender installed around it, outside the timed
steps. A contender's time / none in a round is its block's time over the mean of the two none
blocks around it. Why: a step's time depends on the step
before it (here a plain step right after one of torch's selective checkpointing took 10-15%
longer than after another plain step), so every timed step follows a step of its own kind, as in
a training loop; and these machines speed up and slow down by 10-20% over seconds, so each
contender is compared with "none" run right before and after it. The scheme used before (one
step of each contender per round against the round's single "none" step, in a fixed rotating
order, 15 rounds) put the do-nothing contender's middle half of rounds at 0.91-1.07 (min-max
0.71-1.25); this one, in three runs, at 0.99-1.02, 0.96-1.04 and 1.02-1.09. Its median over a
few rounds still moves by several percent from run to run (1.02, 1.02, 1.08 here; 0.95 and 1.00
before), which is why the noise floor below is measured and printed in every run.

How to read the output:

- ``gradients``: every contender's loss and parameter gradients equal the plain model's, bit for
  bit (dropout on, so RNG replay is exercised). A mismatch stops the script with exit status 1:
  timing contenders that compute different things would be meaningless.
- ``measured``: the peak of one training step (MemTracker "peak"/"Total", in runs of its own,
  never while timing) and the step time divided by "none" (median over rounds; the middle half
  of the rounds and min - max show the spread); extra time = that ratio - 1.
- ``noise floor``: "gradckpt @ none" (gradckpt's plan at none's peak, which checkpoints nothing;
  if it ever does checkpoint, an added copy of "none") runs exactly what "none" runs, so its true
  ratio is 1. How far its middle half of rounds strays from 1 is the noise floor: an extra time
  within it cannot be told from nothing here.
- ``predictions``: for each contender, the cost model's peak and extra time (gradckpt's plans:
  ``predicted_peak_bytes``, ``predicted_overhead``; the anchors' layouts: the same model,
  ``gradckpt.cost.simulate``, for comparison) against the measured ones, extra time as a
  fraction of the plain step (the profile times each block's forward inside its own plain
  steps, so a plan's seconds and the step it divides them by come from the same moments; with
  blocks timed on their own, the profile's ratios were off by the machine's drift, 3-28% here).
  Targets: peak within 5%; extra time within the larger of 15% of the measured extra and the
  noise floor (column "allowed"). The relative error is shown too where the measured extra is
  above the floor.
- ``frontier``: for each anchor, gradckpt's extra time divided by the anchor's, counted only when
  gradckpt's measured peak is at most the anchor's and the anchor's extra time is above the noise
  floor. Below 1: gradckpt recomputes less for the same memory. "Never worse" holds for an
  anchor when the ratio is at most 1.05 or gradckpt's extra time exceeds the anchor's by no more
  than the noise floor (a gap that two identical contenders show), the excess taken round by
  round ("paired gap": the median over rounds of the difference of the two time/none ratios,
  which cancels each round's drift; the ratio of two medians does not, and once put two
  layouts recomputing the same four blocks at +0.158 and +0.256), or gradckpt was slower in
  no more rounds than chance explains (a one-sided sign test over the rounds, p >= 0.05: 12
  of 16 rounds is significant, 10 of 16 is not; 26 of 40 is, 25 of 40 is not). The last
  line is the verdict (prediction counts both ways: against the allowed error, and against 15%
  alone); the exit status is 0 whatever it says.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import _common
import torch
from _common import describe_segments, mib, noise_floor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt
from gradckpt.cost import simulate
from gradckpt.engine import is_matmul_or_attention
from gradckpt.plan import Plan, Segment
from gradckpt.side_by_side import (
    RatioStats,
    Round,
    SideBySideTimes,
    UsersStep,
    installed,
    measure_users_step,
    summarize_ratios,
)
from gradckpt.toy_models import TinyGPT

PEAK_ERROR_TARGET = 0.05  # |predicted - measured| / measured peak
EXTRA_TIME_ERROR_TARGET = 0.15  # |predicted - measured| / measured extra time, or the floor
# "Worse" takes all three: an extra-time ratio above 1 + NEVER_WORSE_SLACK; gradckpt's extra
# time above the anchor's, paired by round, by more than the noise floor (a gap the do-nothing
# contender shows between two identical runs cannot tell the plans apart); and gradckpt slower
# in more rounds than chance explains (one-sided sign test, p < SIGN_TEST_LEVEL). Why the last:
# the floor comes from one contender and can come out small; in one run two layouts that
# recompute the same four blocks showed a paired gap of +0.096 over a floor of 0.039, gradckpt
# slower in 10 rounds of 16 (p = 0.23), while the two identical every-layer layouts differed
# by -0.073 in the same run.
NEVER_WORSE_SLACK = 0.05
SIGN_TEST_LEVEL = 0.05
CLEARLY_BETTER = 0.8  # extra-time ratio counted as "clearly better"
CONTROL = "none again (control)"  # the do-nothing contender when that plan does checkpoint
NO_PLAN = "no plan"
NOT_AT_MEMORY = "NOT at equal or lower memory"

Installer = Callable[[], contextlib.AbstractContextManager]


# --------------------------------------------------------------------------------------------
# Anchors: checkpointing as users write it today, with torch.utils.checkpoint
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Anchor:
    name: str
    every: int | None  # checkpoint blocks 0, every, 2 * every, ...; None: no checkpointing
    selective: bool = False  # torch's selective checkpointing, saving matmuls

    def checkpointed_blocks(self, block_count: int) -> list[int]:
        return [] if self.every is None else list(range(0, block_count, self.every))

    def segments(self, block_count: int) -> list[Segment]:
        """The same layout as a gradckpt plan, for the cost model's prediction."""
        policy = "save-matmuls" if self.selective else None
        return [Segment(i, i, policy=policy) for i in self.checkpointed_blocks(block_count)]


ANCHORS = [
    Anchor("none", None),
    Anchor("every layer", 1),
    Anchor("every 2nd layer", 2),
    Anchor("every 4th layer", 4),
    Anchor("selective (matmuls)", 1, selective=True),
]


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    """torch's selective-checkpoint policy: keep matmul/attention outputs, recompute the rest."""
    if is_matmul_or_attention(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def anchor_installed(model: TinyGPT, anchor: Anchor) -> Iterator[None]:
    """Run the anchor's blocks through ``torch.utils.checkpoint`` while the context is open.

    An instance attribute ``forward`` shadows ``Block.forward``, which ``nn.Module.__call__``
    calls: parameters, hooks and ``state_dict`` stay as they are, and deleting the attribute
    restores the block exactly.
    """
    blocks = [model.transformer.h[i] for i in anchor.checkpointed_blocks(len(model.transformer.h))]
    options = {"use_reentrant": False}
    if anchor.selective:
        options["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, save_matmuls_policy
        )
    for block in blocks:
        if "forward" in vars(block):
            raise RuntimeError("a block already has an instance-level forward; cannot wrap it")
        block.forward = functools.partial(torch_checkpoint, block.forward, **options)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


# --------------------------------------------------------------------------------------------
# Contenders: what runs, and what was predicted and measured about it
# --------------------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    layout: str  # the segments, in short
    install: Installer
    predicted_peak_bytes: int
    predicted_overhead: float
    plan: Plan | None = None  # gradckpt contenders only
    budgets: list[str] = field(default_factory=list)  # anchors whose peak gave this plan
    peak_bytes: int = 0  # measured


def anchor_contenders(model: TinyGPT, measured: gradckpt.Profile) -> list[Contender]:
    block_count = len(model.transformer.h)
    contenders = []
    for anchor in ANCHORS:
        segments = anchor.segments(block_count)
        chain_peak, extra_seconds = simulate(measured, segments)
        contenders.append(
            Contender(
                name=anchor.name,
                layout=describe_segments(segments),
                install=functools.partial(anchor_installed, model, anchor),
                predicted_peak_bytes=measured.fixed_bytes + chain_peak,
                predicted_overhead=extra_seconds / measured.step_seconds,
            )
        )
    return contenders


def gradckpt_contenders(
    model: TinyGPT, measured: gradckpt.Profile, anchors: list[Contender]
) -> tuple[list[Contender], dict[str, Contender | str]]:
    """One gradckpt contender per distinct plan for the anchors' measured peaks.

    Returns the contenders and, per anchor name, the contender at its budget (or why none).
    """
    by_layout: dict[str, Contender] = {}
    at_budget: dict[str, Contender | str] = {}
    for anchor in anchors:
        try:
            plan = gradckpt.solve(measured, anchor.peak_bytes, "optimal")
        except gradckpt.BudgetError as error:
            short = error.minimum_bytes - anchor.peak_bytes
            at_budget[anchor.name] = (
                f"{NO_PLAN} (BudgetError): gradckpt's lowest predicted peak, "
                f"{error.minimum_bytes:,} bytes, is {short:,} bytes "
                f"({100 * short / anchor.peak_bytes:.2f}%) above this budget"
            )
            continue
        layout = describe_segments(plan.segments)
        if layout not in by_layout:  # two budgets, same plan: run and measure it once
            by_layout[layout] = Contender(
                name=f"gradckpt @ {anchor.name}",
                layout=layout,
                install=functools.partial(installed, model, plan),
                predicted_peak_bytes=plan.predicted_peak_bytes,
                predicted_overhead=plan.predicted_overhead,
                plan=plan,
            )
        by_layout[layout].budgets.append(anchor.name)
        at_budget[anchor.name] = by_layout[layout]
    return list(by_layout.values()), at_budget


def do_nothing_contender(
    anchors: list[Contender], ours: list[Contender]
) -> tuple[Contender, Contender | None]:
    """The contender that runs exactly what "none" runs, whose time ratio is the noise floor.

    Normally gradckpt's plan at none's peak: it checkpoints nothing, installed and removed by
    ``gradckpt.apply``/``disable`` like every gradckpt plan. Should that plan checkpoint
    something, a copy of "none" is returned as a second, added contender.
    """
    for contender in ours:
        if contender.plan is not None and not contender.plan.segments:
            return contender, None
    none = anchors[0]
    control = Contender(
        CONTROL, none.layout, none.install, none.predicted_peak_bytes, none.predicted_overhead
    )
    return control, control


# --------------------------------------------------------------------------------------------
# Gradient check, memory
# --------------------------------------------------------------------------------------------


def check_gradients(model: TinyGPT, step: UsersStep, contenders: list[Contender]) -> str:
    """Run each contender's step once; losses and gradients must equal the first's bit for bit.
    """
    steps = {c.name: _common.with_installed(model, step, c.install) for c in contenders}
    compared = _common.require_identical_gradients(model, steps)
    return (
        f"gradients: all {len(steps)} contenders == {next(iter(steps))}, bit for bit "
        f"({compared} tensors and the loss)"
    )


def measure_peak(model: TinyGPT, sample: dict[str, torch.Tensor], install: Installer,
                 seed: int) -> int:
    """The peak of the loop's second training step with ``install`` in effect."""
    return measure_users_step(model, sample, install, seed=seed).peak_bytes


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def measured_table(
    contenders: list[Contender], ratios: dict[str, RatioStats | None]
) -> str:
    none_peak = contenders[0].peak_bytes
    rows = []
    for c in contenders:
        stats = ratios[c.name]
        if stats is None:  # the reference itself
            time_text, spread, extra = "1 (reference)", "", "+0.000"
        else:
            time_text = f"{stats.median:.3f}"
            spread = f"{stats.lower_quartile:.3f}-{stats.upper_quartile:.3f} ({stats.low:.3f}-"
            spread += f"{stats.high:.3f}, n={stats.rounds})"
            extra = f"{stats.median - 1:+.3f}"
        rows.append(
            (
                c.name,
                c.layout,
                mib(c.peak_bytes),
                f"{c.peak_bytes / none_peak:.3f}",
                time_text,
                spread,
                extra,
            )
        )
    headers = [
        "contender",
        "checkpointed blocks",
        "peak MiB",
        "peak/none",
        "time/none",
        "middle half (min-max, rounds)",
        "extra time",
    ]
    return _common.format_table(headers, rows)


@dataclass(frozen=True)
class PredictionCheck:
    peak_error: float  # (predicted - measured) / measured peak
    predicted_extra: float  # fractions of the plain step
    measured_extra: float
    extra_allowed: float  # max(EXTRA_TIME_ERROR_TARGET * |measured|, noise floor)
    relative_extra_error: float | None  # None: the measured extra time is noise-sized

    @property
    def extra_difference(self) -> float:
        return self.predicted_extra - self.measured_extra

    @property
    def peak_met(self) -> bool:
        return abs(self.peak_error) <= PEAK_ERROR_TARGET

    @property
    def extra_met(self) -> bool:
        return abs(self.extra_difference) <= self.extra_allowed

    @property
    def extra_met_by_target_alone(self) -> bool | None:
        if self.relative_extra_error is None:
            return None
        return abs(self.relative_extra_error) <= EXTRA_TIME_ERROR_TARGET


def check_prediction(contender: Contender, extra_ratio: float, floor: float) -> PredictionCheck:
    """The contender's predictions against what was measured (extra time: fractions of the
    plain step)."""
    peak_error = (contender.predicted_peak_bytes - contender.peak_bytes) / contender.peak_bytes
    predicted = contender.predicted_overhead
    allowed = max(EXTRA_TIME_ERROR_TARGET * abs(extra_ratio), floor)
    relative = (predicted - extra_ratio) / extra_ratio if abs(extra_ratio) > floor else None
    return PredictionCheck(peak_error, predicted, extra_ratio, allowed, relative)


def prediction_table(
    contenders: list[Contender], extras: dict[str, float], checks: dict[str, PredictionCheck]
) -> str:
    rows = []
    for c in contenders:
        check = checks[c.name]
        relative = (
            "n/a (noise)"
            if check.relative_extra_error is None
            else f"{100 * check.relative_extra_error:+.1f}%"
        )
        rows.append(
            (
                c.name,
                mib(c.predicted_peak_bytes),
                mib(c.peak_bytes),
                f"{100 * check.peak_error:+.1f}%{'' if check.peak_met else ' !'}",
                f"{check.predicted_extra:+.3f}",
                f"{check.measured_extra:+.3f}",
                f"{check.extra_difference:+.3f}{'' if check.extra_met else ' !'}",
                f"{check.extra_allowed:.3f}",
                relative,
            )
        )
    headers = [
        "contender",
        "pred. peak MiB",
        "meas. peak MiB",
        "peak err",
        "pred. extra",
        "meas. extra",
        "pred-meas",
        "allowed",
        "extra err",
    ]
    return _common.format_table(headers, rows)


@dataclass(frozen=True)
class FrontierRow:
    anchor: str
    text: str  # the row's comparison, or why there is none
    ratio: float | None  # gradckpt extra / anchor extra, when comparable
    gap: float = 0.0  # gradckpt's extra time minus the anchor's, paired by round (median)
    sign_p: float = 1.0  # chance of gradckpt slower in as many rounds if neither were faster


def frontier_rows(
    anchors: list[Contender],
    at_budget: dict[str, Contender | str],
    extras: dict[str, float],
    timings: SideBySideTimes,
    floor: float,
) -> list[FrontierRow]:
    rows = []
    for anchor in anchors:
        found = at_budget[anchor.name]
        if isinstance(found, str):
            rows.append(FrontierRow(anchor.name, found, None))
            continue
        memory = f"peak {mib(found.peak_bytes)} vs {mib(anchor.peak_bytes)} MiB"
        time_text = step_time_text(found.name, anchor.name, timings)
        extra_text = f"extra time {extras[found.name]:+.3f} vs {extras[anchor.name]:+.3f}"
        if extras[anchor.name] > floor:
            ratio = max(extras[found.name], 0.0) / extras[anchor.name]
            extra_text += f" -> gradckpt/anchor {ratio:.2f}"
        if found.peak_bytes > anchor.peak_bytes:
            over = found.peak_bytes / anchor.peak_bytes - 1
            text = (
                f"{NOT_AT_MEMORY} ({memory}, +{100 * over:.1f}%), not counted: "
                f"{extra_text}; {time_text}"
            )
            rows.append(FrontierRow(anchor.name, text, None))
        elif extras[anchor.name] <= floor:
            text = (
                f"anchor's extra time is within the noise floor, nothing to beat ({extra_text}); "
                f"{memory}; {time_text}"
            )
            rows.append(FrontierRow(anchor.name, text, None))
        else:
            gap = paired_gap(found.name, anchor.name, timings)
            slower, rounds, sign_p = sign_test(found.name, anchor.name, timings)
            text = (
                f"{extra_text}; paired gap {gap:+.3f}, gradckpt slower in {slower} of {rounds} "
                f"rounds (sign test p {sign_p:.2f}); {memory}; {time_text}"
            )
            rows.append(FrontierRow(anchor.name, text, ratio, gap, sign_p))
    return rows


def paired_rounds(
    ours: str, anchor: str, timings: SideBySideTimes
) -> list[tuple[float, float]]:
    """(gradckpt's time/none, the anchor's) in each round where both were undisturbed; the
    reference "none" is 1 in every round."""
    mine = timings.ratios_by_round(ours)
    if anchor == timings.reference:
        return [(ratio, 1.0) for ratio in mine.values()]
    theirs = timings.ratios_by_round(anchor)
    return [(mine[index], theirs[index]) for index in sorted(mine.keys() & theirs.keys())]


def paired_gap(ours: str, anchor: str, timings: SideBySideTimes) -> float:
    """Median over rounds of gradckpt's time/none minus the anchor's in the same round: how
    much more extra time gradckpt takes, each round's drift cancelled (the difference of the
    two medians is not: two equal-work layouts once measured +0.158 and +0.256 that way)."""
    pairs = paired_rounds(ours, anchor, timings)
    if not pairs:
        return math.inf
    return statistics.median(mine - theirs for mine, theirs in pairs)


def sign_test(
    ours: str, anchor: str, timings: SideBySideTimes
) -> tuple[int, int, float]:
    """In how many rounds gradckpt took longer than the anchor, of the rounds where they
    differed, and the chance of at least that many if neither were faster (one-sided sign
    test: no assumption on how the machine's noise is distributed).

    Example (with made-up rounds: 12 of 16 slower is unlikely by chance, 10 of 16 is not):
        >>> round(sum(math.comb(16, i) for i in range(12, 17)) / 2**16, 3)
        0.038
    """
    differences = [mine - theirs for mine, theirs in paired_rounds(ours, anchor, timings)
                   if mine != theirs]
    slower = sum(difference > 0 for difference in differences)
    n = len(differences)
    p = sum(math.comb(n, i) for i in range(slower, n + 1)) / 2**n if n else 1.0
    return slower, n, p


def step_time_text(ours: str, anchor: str, timings: SideBySideTimes) -> str:
    """gradckpt's step time / the anchor's, per round (each measured against "none" there)."""
    if ours == anchor:
        return "the same contender"
    ratios = [mine / theirs for mine, theirs in paired_rounds(ours, anchor, timings)]
    if not ratios:
        return "step time gradckpt/anchor: no round where both were undisturbed"
    paired = summarize_ratios(ratios)
    return (
        f"step time gradckpt/anchor {paired.median:.3f} "
        f"[{paired.lower_quartile:.3f}-{paired.upper_quartile:.3f}]"
    )


def verdict(rows: list[FrontierRow], checks: dict[str, PredictionCheck], floor: float) -> str:
    compared = [row for row in rows if row.ratio is not None]
    slower = [row for row in compared if row.ratio > 1 + NEVER_WORSE_SLACK]
    worse = [row.anchor for row in slower
             if row.gap > floor and row.sign_p < SIGN_TEST_LEVEL]
    within_noise = [row.anchor for row in slower if row.anchor not in worse]
    better = [row.anchor for row in compared if row.ratio <= CLEARLY_BETTER]
    not_comparable = [row.anchor for row in rows if row.text.startswith(NOT_AT_MEMORY)]
    no_plan = [row.anchor for row in rows if row.text.startswith(NO_PLAN)]
    never_worse = "PASS" if not (worse or not_comparable or no_plan) else "FAIL"
    peak_ok = sum(check.peak_met for check in checks.values())
    extra_ok = sum(check.extra_met for check in checks.values())
    by_target = [
        check.extra_met_by_target_alone
        for check in checks.values()
        if check.extra_met_by_target_alone is not None
    ]
    return (
        f"verdict: never worse (at <= memory, extra-time ratio <= {1 + NEVER_WORSE_SLACK:.2f}, "
        f"or extra time within the noise floor {floor:.3f} of the anchor's, or slower in no "
        f"more rounds than chance explains (sign test p >= {SIGN_TEST_LEVEL})) {never_worse}"
        + (f" (worse: {', '.join(worse)})" if worse else "")
        + (f" (slower within the noise: {', '.join(within_noise)})" if within_noise else "")
        + (f" (more memory: {', '.join(not_comparable)})" if not_comparable else "")
        + (f" (no plan that low: {', '.join(no_plan)})" if no_plan else "")
        + f"; clearly better (<= {CLEARLY_BETTER}) vs {len(better)} of {len(compared)} anchors"
        + (f" ({', '.join(better)})" if better else "")
        + f"; gradckpt predictions: peak within {100 * PEAK_ERROR_TARGET:.0f}% "
        f"{peak_ok}/{len(checks)}, extra time within max({100 * EXTRA_TIME_ERROR_TARGET:.0f}%, "
        f"the noise floor) {extra_ok}/{len(checks)} (within "
        f"{100 * EXTRA_TIME_ERROR_TARGET:.0f}% alone: {sum(by_target)}/{len(by_target)} "
        "of those above the floor)"
    )


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

# Sizes and repetitions: the full run (a plain step ~0.45 s on 2 CPU cores, up to 10 contenders,
# a round ~13 s, the script about 10 minutes) and --quick (a smoke test of seconds). Explicit
# flags win over both. 40 rounds: one step's time strays by 10-15% here. With 6 rounds a
# two-block recomputation measured anywhere from -2% to +12% of a step from run to run; with
# 16, every layer checkpointed measured +0.40 to +0.59 in five runs (two identical layouts in
# one run up to 0.08 apart), too loose to check a 15% target on; with 40, those two layouts
# measured +0.477 and +0.477.
FULL = dict(
    layers=8, batch=8, seq=128, embd=256, heads=4, rounds=40, warmup=1, steps=1, patience=300.0
)
QUICK = dict(layers=4, batch=2, seq=32, embd=64, heads=2, rounds=3, warmup=1, steps=1, patience=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Memory/time frontier: torch.utils.checkpoint anchors vs gradckpt 'optimal' "
        "at each anchor's peak, on TinyGPT (CPU). Defaults in [brackets]: full run / --quick.",
    )
    _common.add_run_arguments(
        parser,
        FULL,
        QUICK,
        {
            "rounds": "undisturbed timed rounds wanted, each running every contender once "
            "between two blocks of 'none'",
            "warmup": "untimed steps at the start of every block",
            "steps": "timed steps in every block after those (the block's time: their median)",
        },
    )
    parser.add_argument("--verbose", action="store_true", help="print each gradckpt plan in full")
    # CPU by default, as the planning issue asks (MemTracker peaks); on a GPU, peaks are the
    # CUDA allocator's and times far steadier than on a shared CPU.
    _common.add_device_argument(parser, "cpu")
    return _common.parse_run_arguments(parser, argv, FULL, QUICK)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device

    gpt = _common.GPTRun.from_args(args, device)
    model, sample = gpt.model, gpt.sample

    print("bench/frontier.py: memory/time frontier, torch.utils.checkpoint anchors vs gradckpt")
    print(f"command: {_common.command_line(argv)}")
    print(_common.describe_machine(device))
    print(f"gradckpt {gradckpt.__version__} from {os.path.dirname(gradckpt.__file__)}")
    print(gpt.description)
    print(f"load average before: {_common.load_average()}")
    print()

    # ---- profile once, measure the anchors' peaks, solve for each -------------------------
    measured_profile = _common.quiet_profile(
        model, sample, max_foreign_cores=args.max_foreign_load,
        deadline=time.monotonic() + args.patience,
    ).profile
    anchors = anchor_contenders(model, measured_profile)
    for anchor in anchors:
        anchor.peak_bytes = measure_peak(model, sample, anchor.install, args.seed)
    ours, at_budget = gradckpt_contenders(model, measured_profile, anchors)
    for name, found in at_budget.items():
        if isinstance(found, str):
            print(f"  budget {name}: {found}")
    do_nothing, control = do_nothing_contender(anchors, ours)
    contenders = anchors + ours + ([control] if control else [])
    for c in contenders[len(anchors) :]:
        c.peak_bytes = measure_peak(model, sample, c.install, args.seed)
    print()
    print("contenders:")
    for index, c in enumerate(contenders):
        budget = f"  (budget = peak of {', '.join(c.budgets)})" if c.budgets else ""
        print(f"  {index:>2}  {c.name:<28} {c.layout}{budget}")
    if args.verbose:
        for c in ours:
            print(f"\n{c.name} (budget = peak of {', '.join(c.budgets)}):\n{c.plan}")
    print()

    # One step for all: installing and removing a contender happens around its block of steps,
    # so that every contender runs the same model instance.
    step = UsersStep(model, sample, seed=args.seed)  # the same dropout masks for everyone
    print(check_gradients(model, step, contenders))
    print()

    # ---- time: each contender between two blocks of none, in shuffled order -----------------
    block = f"{args.warmup} untimed + {args.steps} timed step(s)"
    print(
        f"time: {args.rounds} rounds; per round none, then each contender followed by none, the "
        f"contenders shuffled (seed {args.seed}); each a block of {block}. Per round: none's "
        "block time, then each contender's time / the mean of the none blocks around it, in the "
        "order listed above (- : disturbed)"
    )
    others = contenders[1:]

    def show_round(index: int, measured: Round) -> None:
        ratios = measured.ratios()
        base = measured.seconds("none")
        cells = " ".join(
            "  - " if ratios[c.name] is None else f"{ratios[c.name]:.2f}" for c in others
        )
        loads = [turn.load for turn in measured.turns if turn.load is not None]
        foreign = f"max {max(loads):.2f}" if loads else "n/a"
        disturbed = sum(turn.disturbed for turn in measured.turns)
        note = f"  {disturbed} block(s) DISCARDED (machine busy)" if disturbed else ""
        print(
            f"  round {index + 1:>2}  none {base:.3f}s  {cells}  foreign load {foreign}{note}",
            flush=True,
        )

    timings = _common.timed_side_by_side(
        {c.name: step for c in contenders},  # "none" first: the reference
        args.rounds,
        warmup_rounds=0,
        warmup_steps=args.warmup,
        timed_steps=args.steps,
        bracketed=True,
        shuffle_seed=args.seed,
        device=device,
        setup={c.name: c.install for c in contenders},
        on_round=show_round,
        max_foreign_cores=args.max_foreign_load,
        patience_seconds=args.patience,
    )
    ratios: dict[str, RatioStats | None] = {"none": None}
    for c in others:
        ratios[c.name] = timings.ratio_stats(c.name)
    missing = [c.name for c in others if ratios[c.name] is None]
    if missing:
        sys.exit(f"FAIL: no undisturbed round for {', '.join(missing)}; rerun on a quiet machine")
    extras = {"none": 0.0} | {c.name: ratios[c.name].median - 1 for c in others}
    floor = noise_floor(ratios[do_nothing.name])
    blocks = [turn for measured in timings.rounds for turn in measured.turns]
    plain_seconds = statistics.median(timings.seconds("none"))
    print(
        f"rounds: {len(timings.rounds)} run, {sum(b.disturbed for b in blocks)} of {len(blocks)} "
        f"blocks discarded (other processes above {args.max_foreign_load} core); load average "
        f"after: {_common.load_average()}"
    )
    # Seconds differ from run to run with the machine's pace; predicted extra times are
    # fractions of the profile's own plain step, measured ones of the plain step timed here.
    print(
        f"plain step: {plain_seconds:.3f} s here (median), {measured_profile.step_seconds:.3f} s "
        f"in gradckpt.profile (ratio {measured_profile.step_seconds / plain_seconds:.3f})"
    )
    if not timings.reliable:
        print("WARNING: fewer undisturbed rounds than asked for; the time ratios are suspect.")
    print()

    # ---- report -------------------------------------------------------------------------
    print(
        "measured: peak of one step (MemTracker); step time / none: median over the rounds, "
        "middle half of the rounds, min-max"
    )
    print(measured_table(contenders, ratios))
    stats = ratios[do_nothing.name]
    print(
        f"noise floor {floor:.3f}: {do_nothing.name!r} runs exactly what none runs, yet its "
        f"time/none was {stats.median:.3f} (middle half {stats.lower_quartile:.3f}-"
        f"{stats.upper_quartile:.3f}, min-max {stats.low:.3f}-{stats.high:.3f}); extra times "
        f"within +-{floor:.3f} are noise-sized"
    )
    print()

    checks = {c.name: check_prediction(c, extras[c.name], floor) for c in contenders}
    print(
        "predictions (gradckpt cost model) vs measured; extra time as a fraction of the plain "
        f"step; targets: peak within {100 * PEAK_ERROR_TARGET:.0f}%, extra time within max("
        f"{100 * EXTRA_TIME_ERROR_TARGET:.0f}% of the measured, noise floor {floor:.3f}) "
        "(allowed; ! = missed); extra err: relative, where the measured extra is above the floor"
    )
    print(prediction_table(contenders, extras, checks))
    print()

    print("frontier: gradckpt 'optimal' at each anchor's measured peak")
    rows = frontier_rows(anchors, at_budget, extras, timings, floor)
    width = max(len(row.anchor) for row in rows)
    for row in rows:
        print(f"  {row.anchor:<{width}}  {row.text}")
    print()
    print(verdict(rows, {c.name: checks[c.name] for c in ours}, floor))
    return 0


if __name__ == "__main__":
    _common.keep_freed_memory()
    sys.exit(main())
