"""Does gradckpt's "optimal" plan beat the checkpointing users write today, at the same memory?

The question (issue 25, the memory/time frontier): on a Hugging Face Transformers Llama trained
on CPU, how much peak memory and extra step time does each common way of checkpointing cost,
and how much extra time does gradckpt's ``"optimal"`` plan need (a) at each of those measured
peaks and (b) at budgets below the plain step's peak, down to the least peak it can reach?
Goal: gradckpt's extra time at most 0.75x the anchor's at every point, and never without a plan
where an anchor's layout fits. Every contender runs the same model instance (same weights,
batch and seed), measured side by side in one run.

The model (``--model llama``, the default): ``transformers.LlamaForCausalLM`` with random
weights (nothing is downloaded), 10 layers, hidden 256, MLP 688, 4 attention heads (2
key/value), vocabulary 2048, SDPA attention, attention dropout 0 (Llama's own setting), fp32,
in training mode with its caches off (``_common.LlamaRun``); its batch 2 x 768 tokens with
``labels = input_ids``; the step users write, ``out = model(**batch); out.loss.backward()``,
no optimizer. ``--model tinygpt`` runs ``gradckpt.toy_models.TinyGPT`` instead (8 layers,
n_embd 256, batch 8 x 128, dropout on, so RNG replay is exercised), the model of the README's
frontier table.

    anchors, the way users checkpoint today, on the blocks of the chain gradckpt profiles
    (``model.model.layers[i]`` on Llama):
      none                  no checkpointing: the reference for memory and time
      every layer           each block in ``torch.utils.checkpoint.checkpoint(block, ...,
                            use_reentrant=False)`` (what ``gradient_checkpointing_enable()`` does)
      every 2nd layer       blocks 0, 2, 4, ... wrapped the same way, the others plain (what
                            Transformers' ``every_n_layers``-style options do)
      every 4th layer       blocks 0, 4, 8, ... likewise
      selective (matmuls)   every block wrapped, with ``create_selective_checkpoint_contexts``
                            saving matmul and attention outputs (MUST_SAVE), recomputing the rest
    gradckpt: ``gradckpt.solve(gradckpt.profile(model, batch), B, "optimal")``, installed with
    ``gradckpt.apply``; one contender per distinct plan, named after the first budget giving it:
      gradckpt @ <anchor>   B = the anchor's measured peak (at none's: the do-nothing plan)
      gradckpt @ 90% .. 40% B = that share of the plain step's measured peak
      gradckpt @ least      B = the least peak any plan reaches (``BudgetError.minimum_bytes``
                            of ``solve(profile, 1, "optimal")``)

Layouts read (``_common.describe_layout``): "0-1" blocks 0 and 1 recomputed as one segment,
"2+m" block 2 recomputed keeping its matmul and attention outputs, "3+ops(2)" block 3
recomputed keeping the outputs of two operations (``--verbose`` prints the plan's table, which
names them), "; head/8" the output head and its loss computed in 8 chunks of tokens, each
chunk's logits recomputed in backward, which no anchor does.

Run it (Llama: about 18 minutes on a quiet 2-core CPU at the default 20 rounds: the profile,
the peaks and the gradient check 1.3 minutes, then ~17 contenders and a round of ~48 s; more
while it waits for a quiet machine. TinyGPT: 24 rounds, about 10 minutes. ``--quick``, both
models: a smoke test of 10-25 s):

    .venv/bin/python bench/frontier.py
    .venv/bin/python bench/frontier.py --quick
    .venv/bin/python bench/frontier.py --model tinygpt
    .venv/bin/python bench/frontier.py --verbose        # also print each gradckpt plan in full
    .venv/bin/python bench/frontier.py --device cuda    # on a GPU (bench/device_check.sh)

Nothing else CPU-heavy may run meanwhile: like ``bench/engine.py`` the script waits, asleep,
until other processes use at most ``--max-foreign-load`` cores before each timed round, discards
what it timed while they used more, and runs more rounds until each contender has ``--rounds``
undisturbed ones. On CPU it restarts itself with glibc keeping freed memory, as CUDA's caching
allocator does (``_common.keep_freed_memory``; with glibc's defaults a plain step of the Llama
took 8.7 s instead of 0.75 s, paying page faults that checkpointed steps avoid).

How it times (``gradckpt.side_by_side.time_side_by_side``, bracketed, through
``_common.timed_side_by_side``): a round runs a block of "none", then each other contender's
block followed by another block of "none", the contenders in an order shuffled afresh each
round (seeded by ``--seed``). A block is ``--warmup`` untimed steps, then ``--steps`` timed ones
(the block's time: their median), the contender installed around it, outside the timed steps;
a contender's time / none in a round is its block's time over the mean of the two none blocks
around it. Why: a step's time depends on the step before it (a plain step right after one of
torch's selective checkpointing took 10-15% longer than after another plain step), so every
timed step follows a step of its own kind, as in a training loop; and these machines speed up
and slow down by 10-20% over seconds, so each contender is compared with "none" run right
before and after it. A median over rounds still moves by several percent from run to run,
which is why the noise floor below is measured and printed in every run.

How to read the output:

- ``gradients``: every contender's loss and parameter gradients equal the plain model's, bit
  for bit, except a plan computing the loss in chunks (head/k): its sums run in another order,
  so it must match within float rounding (1e-5 of each tensor's largest magnitude; the largest
  difference is printed). A mismatch stops the script with exit status 1: timing contenders
  that compute different things would be meaningless.
- ``measured``: the peak of one training step (``measure_users_step``: the loop's second step,
  MemTracker's "Total" on CPU, in runs of its own, never while timing) and the step time divided
  by "none" (median over rounds; the middle half of the rounds and min - max show the spread);
  extra time = that ratio - 1.
- ``noise floor``: "gradckpt @ none" (gradckpt's plan at none's peak, which checkpoints nothing;
  if it ever does checkpoint, an added copy of "none") runs exactly what "none" runs, so its true
  ratio is 1. How far its middle half of rounds strays from 1 is the noise floor: an extra time
  within it cannot be told from nothing here.
- ``predictions``: for each contender, the cost model's peak and extra time (gradckpt's plans:
  ``predicted_peak_bytes``, ``predicted_overhead``; the anchors' layouts: the same model,
  ``gradckpt.cost.simulate``, for comparison) against the measured ones, extra time as a
  fraction of the plain step. Targets: peak within 5%; extra time within the larger of 15% of
  the measured extra and the noise floor (column "allowed"). The relative error is shown too
  where the measured extra is above the floor.
- ``part (a)`` (at each anchor's measured peak) and ``part (b)`` (at 90, 80, ..., 40% of the
  plain step's measured peak, and at the least budget): one row per point. "anchor" is the one
  compared: in (a) the anchor whose peak is the budget, in (b) the fastest anchor (by measured
  extra time) whose measured peak fits the budget; its measured peak and extra time. "gradckpt"
  is the plan at that budget: its layout, measured and predicted peak, measured and predicted
  extra time. "ratio" is gradckpt's measured extra time (0 where negative) over the anchor's;
  "goal met?" says whether it is at most 0.75 with gradckpt's measured peak within the budget;
  "pred. ratio" is the same ratio from the cost model's predictions (the anchor's from
  ``simulate``), not judged: it tells a miss the model foresaw from one the timing made.
  Instead of a ratio a row may say: "only gradckpt fits" (no anchor's peak fits the budget:
  met, when gradckpt's measured peak does), "NO PLAN where an anchor fits" (``solve`` raised
  ``BudgetError``: not met), "over budget" (gradckpt's measured peak above the budget: not
  met), "anchor within noise" (the anchor's extra time is within the noise floor, so a ratio
  would be noise over noise: met when gradckpt's extra time is within the floor too), "neither
  fits" (no anchor and no plan: not counted).
- The last line is the verdict: PASS when the goal is met at every counted point of (a) and
  (b), then the predictions' record; the exit status is 0 whatever it says.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise

import _common
import torch
from _common import describe_layout, mib, noise_floor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt
from gradckpt.cost import simulate
from gradckpt.engine import is_matmul_or_attention
from gradckpt.plan import Plan, Segment
from gradckpt.side_by_side import (
    RatioStats,
    Round,
    UsersStep,
    installed,
    measure_users_step,
)

GOAL_RATIO = 0.75  # gradckpt's extra time / the anchor's, at most, at every point
SHARES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)  # part (b)'s budgets: shares of the plain step's peak
LEAST = "least"  # part (b)'s last point: the least budget any plan reaches
PEAK_ERROR_TARGET = 0.05  # |predicted - measured| / measured peak
EXTRA_TIME_ERROR_TARGET = 0.15  # |predicted - measured| / measured extra time, or the floor
CONTROL = "none again (control)"  # the do-nothing contender when that plan does checkpoint

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
def anchor_installed(blocks: list[torch.nn.Module], anchor: Anchor) -> Iterator[None]:
    """Run the anchor's blocks through ``torch.utils.checkpoint`` while the context is open.

    An instance attribute ``forward`` shadows the block class's, which ``nn.Module.__call__``
    calls (Transformers' decoder layers call it too while their own checkpointing is off):
    parameters, hooks and ``state_dict`` stay as they are, and deleting the attribute restores
    the block exactly. Keyword arguments (a decoder layer's mask and positions) pass through.
    """
    wrapped = [blocks[i] for i in anchor.checkpointed_blocks(len(blocks))]
    options = {"use_reentrant": False}
    if anchor.selective:
        options["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, save_matmuls_policy
        )
    for block in wrapped:
        if "forward" in vars(block):
            raise RuntimeError("a block already has an instance-level forward; cannot wrap it")
        block.forward = functools.partial(torch_checkpoint, block.forward, **options)
    try:
        yield
    finally:
        for block in wrapped:
            del block.forward


# --------------------------------------------------------------------------------------------
# Contenders (what runs) and points (where gradckpt is compared with an anchor)
# --------------------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    layout: str  # the segments (and head chunks), in short
    install: Installer
    predicted_peak_bytes: int
    predicted_overhead: float
    plan: Plan | None = None  # gradckpt contenders only
    budgets: list[str] = field(default_factory=list)  # the points whose budget gave this plan
    peak_bytes: int = 0  # measured


def anchor_contenders(model: torch.nn.Module, measured: gradckpt.Profile) -> list[Contender]:
    """The anchors on the profile's chain of blocks, each with the cost model's prediction."""
    blocks = [model.get_submodule(block.name) for block in measured.blocks]
    contenders = []
    for anchor in ANCHORS:
        segments = anchor.segments(len(blocks))
        chain_peak, extra_seconds = simulate(measured, segments)
        contenders.append(
            Contender(
                name=anchor.name,
                layout=describe_layout(segments),
                install=functools.partial(anchor_installed, blocks, anchor),
                predicted_peak_bytes=measured.fixed_bytes + chain_peak,
                predicted_overhead=extra_seconds / measured.step_seconds,
            )
        )
    return contenders


def least_budget(measured: gradckpt.Profile) -> int:
    """The least peak any plan reaches: the budget a 1-byte budget's BudgetError names."""
    try:
        gradckpt.solve(measured, 1, "optimal")
    except gradckpt.BudgetError as error:
        return error.minimum_bytes
    raise SystemExit("FAIL: gradckpt found a plan within 1 byte")


def gradckpt_contenders(
    model: torch.nn.Module, measured: gradckpt.Profile, budgets: dict[str, int]
) -> tuple[list[Contender], dict[str, Contender | str]]:
    """One gradckpt contender per distinct plan for the budgets (by point name).

    Returns the contenders and, per point, the contender at its budget, or why there is none.
    """
    by_layout: dict[str, Contender] = {}  # by the plan's segments (policies in full) and head
    at_budget: dict[str, Contender | str] = {}
    for point, budget in budgets.items():
        try:
            plan = gradckpt.solve(measured, budget, "optimal")
        except gradckpt.BudgetError as error:
            at_budget[point] = f"no plan (least {mib(error.minimum_bytes)})"
            over = error.minimum_bytes / budget - 1
            print(f"  budget {point} ({mib(budget)} MiB): BudgetError, gradckpt's least "
                  f"predicted peak is {mib(error.minimum_bytes)} MiB, {100 * over:.2f}% above")
            continue
        layout = repr((plan.segments, plan.head_chunks))
        if layout not in by_layout:  # two budgets, same plan: run and measure it once
            by_layout[layout] = Contender(
                name=f"gradckpt @ {point}",
                layout=describe_layout(plan.segments, plan.head_chunks),
                install=functools.partial(installed, model, plan),
                predicted_peak_bytes=plan.predicted_peak_bytes,
                predicted_overhead=plan.predicted_overhead,
                plan=plan,
            )
        by_layout[layout].budgets.append(point)
        at_budget[point] = by_layout[layout]
    return list(by_layout.values()), at_budget


def do_nothing_contender(
    anchors: list[Contender], ours: list[Contender]
) -> tuple[Contender, Contender | None]:
    """The contender that runs exactly what "none" runs, whose time ratio is the noise floor.

    Normally gradckpt's plan at none's peak: it checkpoints nothing, installed and removed by
    ``gradckpt.apply``/``disable`` like every gradckpt plan. Should that plan change anything
    (a segment, the head in chunks), a copy of "none" is returned as a second, added contender.
    """
    for contender in ours:
        plan = contender.plan
        if plan is not None and not plan.segments and plan.head_chunks == 1:
            return contender, None
    none = anchors[0]
    control = Contender(
        CONTROL, none.layout, none.install, none.predicted_peak_bytes, none.predicted_overhead
    )
    return control, control


@dataclass
class Point:
    """Where gradckpt is compared with an anchor: a budget, the plan gradckpt makes for it,
    and the anchor it is compared with (None: no anchor's measured peak fits)."""

    part: str  # "a" or "b"
    name: str  # (a): the anchor's name; (b): "90%", ..., "least"
    budget_bytes: int
    ours: Contender | str  # the plan's contender, or why there is none
    anchor: Contender | None = None


def points_of(
    anchors: list[Contender], budgets: dict[str, int], at_budget: dict[str, Contender | str],
    extras: dict[str, float],
) -> list[Point]:
    """Part (a): each anchor but none at its own peak; part (b): each share and the least
    budget against the fastest anchor (measured extra time) whose measured peak fits."""
    by_name = {anchor.name: anchor for anchor in anchors}
    points = []
    for name, budget in budgets.items():
        if name == "none":
            continue  # the do-nothing plan: the noise floor, no comparison
        if name in by_name:
            points.append(Point("a", name, budget, at_budget[name], by_name[name]))
            continue
        fitting = [anchor for anchor in anchors if anchor.peak_bytes <= budget]
        fastest = min(fitting, key=lambda anchor: extras[anchor.name], default=None)
        points.append(Point("b", name, budget, at_budget[name], fastest))
    return points


# --------------------------------------------------------------------------------------------
# Gradient check, memory
# --------------------------------------------------------------------------------------------


def check_gradients(model: torch.nn.Module, step: UsersStep, contenders: list[Contender]) -> str:
    """Run each contender's step once; losses and gradients must equal the first's bit for bit,
    or within float rounding for a plan computing the loss in chunks."""
    steps = {c.name: _common.with_installed(model, step, c.install) for c in contenders}
    chunked = [c.name for c in contenders if c.plan is not None and c.plan.head_chunks > 1]
    check = _common.require_same_gradients(
        model, steps, {name: _common.CHUNKED_LOSS_ROUNDING for name in chunked}
    )
    exact = [name for name in steps if check.identical(name)]
    text = (
        f"gradients: {len(exact)} of {len(steps)} contenders == {check.reference}, bit for bit "
        f"({check.compared} tensors and the loss)"
    )
    rounded = [name for name in steps if name not in exact]
    if rounded:
        worst = max(check.largest_difference[name] for name in rounded)
        text += (
            f"; {len(rounded)} within {worst:.1e} of each tensor's largest value (the loss in "
            f"chunks, summed in another order; allowed {_common.CHUNKED_LOSS_ROUNDING:.0e}): "
            f"{', '.join(rounded)}"
        )
    return text


def measure_peak(model: torch.nn.Module, sample: dict[str, torch.Tensor], install: Installer,
                 seed: int) -> int:
    """The peak of the loop's second training step with ``install`` in effect."""
    return measure_users_step(model, sample, install, seed=seed).peak_bytes


# --------------------------------------------------------------------------------------------
# Report: what was measured, what was predicted
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
        rows.append((c.name, c.layout, mib(c.peak_bytes), f"{c.peak_bytes / none_peak:.3f}",
                     time_text, spread, extra))
    headers = ["contender", "layout", "peak MiB", "peak/none", "time/none",
               "middle half (min-max, rounds)", "extra time"]
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


def prediction_table(contenders: list[Contender], checks: dict[str, PredictionCheck]) -> str:
    rows = []
    for c in contenders:
        check = checks[c.name]
        relative = (
            "n/a (noise)"
            if check.relative_extra_error is None
            else f"{100 * check.relative_extra_error:+.1f}%"
        )
        rows.append((
            c.name,
            mib(c.predicted_peak_bytes),
            mib(c.peak_bytes),
            f"{100 * check.peak_error:+.1f}%{'' if check.peak_met else ' !'}",
            f"{check.predicted_extra:+.3f}",
            f"{check.measured_extra:+.3f}",
            f"{check.extra_difference:+.3f}{'' if check.extra_met else ' !'}",
            f"{check.extra_allowed:.3f}",
            relative,
        ))
    headers = ["contender", "pred. peak MiB", "meas. peak MiB", "peak err", "pred. extra",
               "meas. extra", "pred-meas", "allowed", "extra err"]
    return _common.format_table(headers, rows)


# --------------------------------------------------------------------------------------------
# Report: the points of parts (a) and (b), and the verdict
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    ratio: str  # the ratio, or what stands in its place
    met: bool | None  # None: not counted (neither fits)
    failure: str = ""  # why not met, in a word or two (or the ratio), for the verdict


def judge(point: Point, extras: dict[str, float], floor: float) -> Outcome:
    """Whether gradckpt met the goal at ``point`` (see the module's "How to read")."""
    ours, anchor = point.ours, point.anchor
    if isinstance(ours, str):
        if anchor is None:
            return Outcome("neither fits", None)
        return Outcome("NO PLAN where an anchor fits", False, "no plan")
    if ours.peak_bytes > point.budget_bytes:
        over = ours.peak_bytes / point.budget_bytes - 1
        return Outcome(f"over budget (+{100 * over:.2f}%)", False, "over budget")
    if anchor is None:
        return Outcome("only gradckpt fits", True)
    mine, theirs = extras[ours.name], extras[anchor.name]
    if theirs <= floor:
        met = mine <= floor
        return Outcome("anchor within noise", met, "" if met else "slower, anchor within noise")
    ratio = max(mine, 0.0) / theirs
    return Outcome(f"{ratio:.2f}", ratio <= GOAL_RATIO, f"{ratio:.2f}")


def point_table(points: list[Point], extras: dict[str, float], floor: float) -> str:
    rows = []
    for point in points:
        outcome = judge(point, extras, floor)
        anchor, ours = point.anchor, point.ours
        if anchor is None:
            anchor_cells = ["(none fits)", "-", "-"]
        else:
            anchor_cells = [anchor.name, mib(anchor.peak_bytes), f"{extras[anchor.name]:+.3f}"]
        if isinstance(ours, str):
            ours_cells = [ours, "-", "-", "-", "-"]
        else:
            ours_cells = [ours.layout, mib(ours.peak_bytes), mib(ours.predicted_peak_bytes),
                          f"{extras[ours.name]:+.3f}", f"{ours.predicted_overhead:+.3f}"]
        predicted = "-"
        if anchor is not None and not isinstance(ours, str) and anchor.predicted_overhead > 0:
            predicted = f"{max(ours.predicted_overhead, 0.0) / anchor.predicted_overhead:.2f}"
        met = {True: "yes", False: "NO", None: "-"}[outcome.met]
        rows.append([point.name, mib(point.budget_bytes), *anchor_cells, *ours_cells,
                     outcome.ratio, predicted, met])
    headers = ["point", "budget MiB", "anchor", "peak MiB", "extra", "gradckpt plan",
               "meas. peak", "pred. peak", "meas. extra", "pred. extra", "ratio", "pred. ratio",
               "goal met?"]
    return _common.format_table(headers, rows)


def verdict(points: list[Point], extras: dict[str, float], floor: float,
            checks: dict[str, PredictionCheck]) -> str:
    outcomes = [(point, judge(point, extras, floor)) for point in points]
    counted = [(point, outcome) for point, outcome in outcomes if outcome.met is not None]
    missed = [(point, outcome) for point, outcome in counted if not outcome.met]
    by_part = "; ".join(
        f"({part}) {sum(o.met for p, o in counted if p.part == part)}/"
        f"{sum(p.part == part for p, _ in counted)}" for part in ("a", "b")
    )
    ratios = [float(o.ratio) for _, o in counted if o.ratio[0].isdigit()]
    worst = f", worst ratio {max(ratios):.2f}" if ratios else ""
    no_plan = [p.name for p, o in missed if o.failure == "no plan"]
    peak_ok = sum(check.peak_met for check in checks.values())
    extra_ok = sum(check.extra_met for check in checks.values())
    by_target = [check.extra_met_by_target_alone for check in checks.values()
                 if check.extra_met_by_target_alone is not None]
    return (
        f"verdict: gradckpt's extra time <= {GOAL_RATIO}x the anchor's at every point, never "
        f"without a plan where an anchor fits: {'PASS' if not missed else 'FAIL'} (met {by_part}"
        f"{worst})"
        + (f" (missed: {', '.join(f'{p.name} {o.failure}' for p, o in missed)})" if missed
           else "")
        + f"; infeasible where an anchor fits: {', '.join(no_plan) if no_plan else 'never'}"
        + f"; gradckpt predictions: peak within {100 * PEAK_ERROR_TARGET:.0f}% "
        f"{peak_ok}/{len(checks)}, extra time within max({100 * EXTRA_TIME_ERROR_TARGET:.0f}%, "
        f"the noise floor) {extra_ok}/{len(checks)} (within "
        f"{100 * EXTRA_TIME_ERROR_TARGET:.0f}% alone: {sum(by_target)}/{len(by_target)} "
        "of those above the floor)"
    )


# --------------------------------------------------------------------------------------------
# Models and arguments
# --------------------------------------------------------------------------------------------

# Per model, the full run and --quick (a smoke test); explicit flags win over both.
# Llama: a plain step ~0.66 s on 2 CPU cores, 17 contenders, a round ~48 s (33 blocks of two
# steps), 1.3 minutes before the first: 20 rounds keep the run under 20 minutes on a quiet
# machine (40, as TinyGPT had, would take 33). One step's time strays by 10-15% here; on
# TinyGPT, with 16 rounds every layer checkpointed measured +0.40 to +0.59 in five runs, with
# 40 +0.477 twice. TinyGPT: a plain step ~0.35 s; 24 rounds keep its run near 10 minutes.
SIZES = {
    "llama": (
        dict(layers=10, batch=2, seq=768, embd=256, heads=4, vocab=2048, rounds=20, warmup=1,
             steps=1, patience=300.0),
        dict(layers=4, batch=2, seq=64, embd=64, heads=4, vocab=2048, rounds=3, warmup=1,
             steps=1, patience=0.0),
    ),
    "tinygpt": (
        dict(layers=8, batch=8, seq=128, embd=256, heads=4, rounds=24, warmup=1, steps=1,
             patience=300.0),
        dict(layers=4, batch=2, seq=32, embd=64, heads=2, rounds=3, warmup=1, steps=1,
             patience=0.0),
    ),
}
MODELS = {"llama": _common.LlamaRun, "tinygpt": _common.GPTRun}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The model first: its sizes are the other flags' defaults.
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--model", choices=SIZES, default="llama")
    full, quick = SIZES[chooser.parse_known_args(argv)[0].model]
    parser = argparse.ArgumentParser(
        description="Memory/time frontier: torch.utils.checkpoint anchors vs gradckpt "
        "'optimal' at each anchor's peak and at shares of the plain step's peak. Defaults in "
        "[brackets]: full run / --quick, for the --model chosen.",
    )
    parser.add_argument("--model", choices=SIZES, default="llama",
                        help="transformers.LlamaForCausalLM or gradckpt's TinyGPT [llama]")
    _common.add_run_arguments(
        parser,
        full,
        quick,
        {
            "embd": "model width (Llama: hidden size)",
            "vocab": "vocabulary size",
            "rounds": "undisturbed timed rounds wanted, each running every contender once "
            "between two blocks of 'none'",
            "warmup": "untimed steps at the start of every block",
            "steps": "timed steps in every block after those (the block's time: their median)",
        },
    )
    parser.add_argument("--verbose", action="store_true", help="print each gradckpt plan in full")
    # CPU by default (MemTracker peaks); on a GPU, peaks are the CUDA allocator's and times far
    # steadier than on a shared CPU.
    _common.add_device_argument(parser, "cpu")
    return _common.parse_run_arguments(parser, argv, full, quick)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    # MemTracker's module tracker warns when it loses track of which module runs (Transformers
    # models in backward); that changes nothing in the "Total" read here.
    warnings.filterwarnings("ignore", module="torch.distributed._tools.mod_tracker")
    started = time.monotonic()

    run = MODELS[args.model].from_args(args, device)
    model, sample = run.model, run.sample

    print("bench/frontier.py: memory/time frontier, torch.utils.checkpoint anchors vs gradckpt")
    print(f"command: {_common.command_line(argv)}")
    print(_common.describe_machine(device))
    print(f"gradckpt {gradckpt.__version__} from {os.path.dirname(gradckpt.__file__)}")
    print(run.description)
    print(f"load average before: {_common.load_average()}")
    print()

    # ---- profile once, measure the anchors' peaks, solve for each budget ------------------
    marks = [time.monotonic()]
    measured_profile = _common.quiet_profile(
        model, sample, max_foreign_cores=args.max_foreign_load,
        deadline=time.monotonic() + args.patience,
    ).profile
    marks.append(time.monotonic())
    anchors = anchor_contenders(model, measured_profile)
    for anchor in anchors:
        anchor.peak_bytes = measure_peak(model, sample, anchor.install, args.seed)
    plain_peak = anchors[0].peak_bytes
    budgets = {anchor.name: anchor.peak_bytes for anchor in anchors}
    budgets |= {f"{100 * share:.0f}%": int(share * plain_peak) for share in SHARES}
    budgets[LEAST] = least_budget(measured_profile)
    ours, at_budget = gradckpt_contenders(model, measured_profile, budgets)
    do_nothing, control = do_nothing_contender(anchors, ours)
    contenders = anchors + ours + ([control] if control else [])
    for c in contenders[len(anchors):]:
        c.peak_bytes = measure_peak(model, sample, c.install, args.seed)
    marks.append(time.monotonic())
    print()
    print("contenders:")
    width = max(len(c.name) for c in contenders)
    for index, c in enumerate(contenders):
        budget = f"  (budget of {', '.join(c.budgets)})" if c.budgets else ""
        print(f"  {index:>2}  {c.name:<{width}}  {c.layout}{budget}")
    if args.verbose:
        for c in ours:
            print(f"\n{c.name} (budget of {', '.join(c.budgets)}):\n{c.plan}")
    print()

    # One step for all: installing and removing a contender happens around its block of steps,
    # so that every contender runs the same model instance.
    step = UsersStep(model, sample, seed=args.seed)  # the same dropout masks for everyone
    print(check_gradients(model, step, contenders))
    marks.append(time.monotonic())
    profiling, peaks, gradients = (end - start for start, end in pairwise(marks))
    print(f"so far {(marks[-1] - started) / 60:.1f} minutes: profile {profiling:.0f} s, peaks "
          f"{peaks:.0f} s, gradients {gradients:.0f} s")
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
        cells = " ".join(
            "  - " if ratios[c.name] is None else f"{ratios[c.name]:.2f}" for c in others
        )
        loads = [turn.load for turn in measured.turns if turn.load is not None]
        foreign = f"max {max(loads):.2f}" if loads else "n/a"
        disturbed = sum(turn.disturbed for turn in measured.turns)
        note = f"  {disturbed} block(s) DISCARDED (machine busy)" if disturbed else ""
        print(f"  round {index + 1:>2}  none {measured.seconds('none'):.3f}s  {cells}  "
              f"foreign load {foreign}{note}", flush=True)

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
    print(prediction_table(contenders, checks))
    print()

    points = points_of(anchors, budgets, at_budget, extras)
    print(
        "part (a): gradckpt 'optimal' at each anchor's measured peak; ratio = gradckpt's extra "
        f"time / the anchor's (goal <= {GOAL_RATIO}); MiB and extra times measured unless "
        "marked pred."
    )
    print(point_table([p for p in points if p.part == "a"], extras, floor))
    print()
    print(
        f"part (b): gradckpt 'optimal' at {', '.join(f'{100 * s:.0f}' for s in SHARES)}% of the "
        f"plain step's measured peak ({mib(plain_peak)} MiB) and at the least budget any plan "
        "reaches, against the fastest anchor whose measured peak fits"
    )
    print(point_table([p for p in points if p.part == "b"], extras, floor))
    print()
    print(f"runtime: {(time.monotonic() - started) / 60:.1f} minutes, of which timing "
          f"{(time.monotonic() - marks[-1]) / 60:.1f}")
    print(verdict(points, extras, floor, {c.name: checks[c.name] for c in ours}))
    return 0


if __name__ == "__main__":
    _common.keep_freed_memory()
    sys.exit(main())
