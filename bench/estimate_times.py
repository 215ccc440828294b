"""Do ``estimate``'s roofline times predict the *shares* that choose plans? Checked on this CPU.

The question: ``gradckpt.estimate(model, sample, device="this")`` prices every operation with a
roofline of this machine (its throughput and bandwidth, measured once and cached). A roofline is
a lower bound in seconds; the solvers only need the shares to come out right: each block's
forward as a share of the step, and a plan's extra (recomputation) time as a share of the step,
which ``Plan.predicted_overhead`` reports. On a handful of the families of
``gradckpt.integrations.hf_families`` (GPT-2, Llama, T5, ViT, a CNN, a LoRA stack), at sizes
where a step takes 0.07-0.1 s, how close are those shares to the real ones?

For each model it runs ``gradckpt.profile`` (the measured profile, ``repeats`` times each) and
``gradckpt.estimate`` on the same model and sample, then:

- ``steps``: the plain step measured (the profile's) and estimated, and their ratio: how far
  from its roofline this CPU runs;
- ``blocks``: per block, its forward as a share of the step (``forward_seconds /
  step_seconds``), its backward likewise, and its recomputation over its forward
  (``recompute_seconds() / forward_seconds``: what one checkpointed block adds), measured and
  estimated;
- ``plans``: plans solved from the *measured* profile: ``"every-layer"`` (no budget) and
  ``"optimal"`` at ``--budget-share`` (50%) of the measured plain peak (or the smallest budget
  it can meet, marked "least"). Each plan's extra time as a share of the step predicted from the
  estimate (the same segments priced with the estimate's times, ``gradckpt.cost.plan_for``),
  predicted from the measured profile (``Plan.predicted_overhead``), and measured: the plan
  applied (``gradckpt.apply``) and its steps timed against the plain step in the same run.

How it times (``gradckpt.side_by_side.time_side_by_side``, bracketed, through
``_common.timed_side_by_side``, as ``bench/frontier.py``): per round a block of
plain steps, then each plan's block followed by another plain block, in an order shuffled each
round; a block is ``--warmup`` untimed steps then ``--steps`` timed ones (its time: their
median); a plan's time / plain is its block over the mean of the two plain blocks around it.
Its extra time is the median of that ratio over the rounds, minus 1; the middle half of the
rounds and min-max show the spread. A do-nothing plan (``"none"``, applied and removed like the
others) runs what the plain step runs: how far its ratio strays from 1 is the noise floor.
Like ``bench/engine.py`` it waits, asleep, for other processes to use at most
``--max-foreign-load`` cores before each round and discards what they disturbed, for at most
``--patience`` seconds over the whole run.

The closing verdict line says how far the estimate's extra-time shares are from the measured
ones (median and worst, in shares of the step, and estimate/measured), next to the measured
profile's own predictions and the noise floor, and the same for the blocks' forward shares.
Each counts only rows whose measurements other processes left alone (column "disturbed";
the estimate runs on a modeled clock, so its comparison needs undisturbed timing only). No
threshold: it reports what came out. The exit status is 0 whatever it says.

    .venv/bin/python bench/estimate_times.py            # about 7 minutes on a quiet 2-core CPU
    .venv/bin/python bench/estimate_times.py --only llama,cnn
    .venv/bin/python bench/estimate_times.py --quick    # one small model, a smoke test

Add the time it waits for other processes (``--patience``, 600 s at most by default): the run
in docs/results/estimate_times_cpu.txt took 18 minutes on a shared machine, 11 of them waiting.
``--rounds 8`` or fewer models (``--only``) make it shorter.

The script restarts itself with glibc keeping freed memory (``_common.keep_freed_memory``, as
``bench/frontier.py``): with glibc's defaults a plain step pays page faults that checkpointed
steps do not, which makes recomputation look nearly free on CPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _common
import torch
from _common import describe_segments, noise_floor

import gradckpt
from gradckpt.cost import plan_for
from gradckpt.integrations.hf_families import Family, families
from gradckpt.predict.devices import device_spec, format_device
from gradckpt.side_by_side import (
    RatioStats,
    UsersStep,
    installed,
    plans_at_shares,
    summarize_ratios,
)

# Sizes (the arguments of each family's ``make_sample``), chosen so that a plain step takes
# roughly 0.07-0.1 s on a quiet 2-core CPU (about the estimate's own step here): long enough for
# the wall clock, short enough for 12 rounds of 7 blocks per model.
# The default run takes a handful of families that differ in how their time splits (two
# decoders: GPT-2's attention in matmuls, Llama's through SDPA; an encoder-decoder with a chain
# break; a vision transformer; convolutions; a frozen base with adapters); --only takes any of
# them (Qwen2, BERT and PEFT sized like their neighbours, not timed when these were chosen).
SIZES = {
    "gpt2": (16, 128),
    "llama": (20, 128),
    "qwen2": (20, 128),
    "bert": (16, 128),
    "t5": (20, 96),
    "vit": (128, 64, 64),
    "cnn": (96, 48, 48),
    "lora": (32, 64, 128),
    "peft-llama": (20, 128),
}
DEFAULT_CASES = ("gpt2", "llama", "t5", "vit", "cnn", "lora")
QUICK_CASE, QUICK_SIZE = "gpt2", (2, 64)

# Three timed steps a block (four with the warm-up, ~0.3 s): ForeignLoad cannot judge a block
# shorter than 0.25 s (it returns None, and the block counts as undisturbed).
FULL = dict(rounds=12, warmup=1, steps=3, repeats=5, patience=600.0)
QUICK = dict(rounds=2, warmup=1, steps=1, repeats=2, patience=0.0)
HELP = {
    "rounds": "undisturbed timed rounds wanted per model, each running every plan once "
    "between two blocks of plain steps",
    "warmup": "untimed steps at the start of every block",
    "steps": "timed steps in every block after those (the block's time: their median)",
    "repeats": "gradckpt.profile's repeats (each time in the measured profile: their median)",
    "patience": "seconds, over the whole run, to wait for a quiet machine before timing anyway",
}

PLAIN = "plain"
PROFILE_ATTEMPTS = 3
DO_NOTHING = "none (noise floor)"


@dataclass
class Timed:
    """One plan, timed: what it is, what was predicted and what was measured."""

    label: str  # "every-layer", "optimal 50%", ...
    layout: str
    plan: gradckpt.Plan
    from_estimate: float  # extra time / step, the same segments priced with the estimate
    from_profile: float  # extra time / step, predicted from the measured profile
    measured: RatioStats | None = None  # plan step / plain step, over the rounds
    disturbed: bool = False  # no undisturbed round: the ratios are from disturbed ones
    also: list[str] = field(default_factory=list)  # other labels that solved to this layout

    @property
    def measured_extra(self) -> float | None:
        return None if self.measured is None else self.measured.median - 1


@dataclass
class Result:
    """Everything measured and estimated for one model."""

    name: str
    size: str
    measured: gradckpt.Profile
    estimated: gradckpt.Profile
    plans: list[Timed]
    control: Timed  # the do-nothing plan: its ratio's spread is the noise floor
    plain_seconds: float | None  # the plain step's median block time while timing
    profile_disturbed: bool  # other processes ran while profiling: its times are suspect

    @property
    def floor(self) -> float | None:
        return None if self.control.measured is None else noise_floor(self.control.measured)


# --------------------------------------------------------------------------------------------
# Measuring and estimating one model
# --------------------------------------------------------------------------------------------


def solved_plans(measured: gradckpt.Profile, share: float) -> list[tuple[str, gradckpt.Plan]]:
    """The plans the measured profile gives: every layer, and optimal at ``share`` of the
    measured plain peak (or at the least budget it can meet)."""
    plans = [("every-layer", gradckpt.solve(measured, None, "every-layer"))]
    plans += [(f"optimal {label}", plan)
              for label, plan in plans_at_shares(measured, [share]).items()]
    return plans


def priced(measured: gradckpt.Profile, estimated: gradckpt.Profile, label: str,
           plan: gradckpt.Plan) -> Timed:
    """The plan's extra-time share from both profiles: the same segments, each's own times."""
    from_estimate = plan_for(estimated, plan.strategy, plan.budget_bytes, plan.segments)
    return Timed(label, describe_segments(plan.segments), plan,
                 from_estimate.predicted_overhead, plan.predicted_overhead)


def time_plans(model: torch.nn.Module, sample: Any, family: Family, timed: list[Timed],
               args: argparse.Namespace, deadline: float) -> float | None:
    """Time every plan of ``timed`` against the plain step; fills in their ``measured``.
    Returns the plain step's median block time.

    One step as users write it for all (``UsersStep``, seeded: the same dropout masks for
    every plan), each plan applied around its blocks, outside the timed steps, so that every
    plan runs the same model."""
    step = UsersStep(model, sample, family.loss_fn)
    timings = _common.timed_side_by_side(
        {PLAIN: step} | {entry.label: step for entry in timed}, args.rounds, warmup_rounds=0,
        warmup_steps=args.warmup, timed_steps=args.steps, bracketed=True, shuffle_seed=args.seed,
        setup={entry.label: functools.partial(installed, model, entry.plan) for entry in timed},
        max_foreign_cores=args.max_foreign_load,
        patience_seconds=max(0.0, deadline - time.monotonic()),
        log=lambda line: print(line, flush=True),
    )
    for entry in timed:
        ratios, entry.disturbed = _common.ratios_or_all(timings, entry.label)
        entry.measured = summarize_ratios(ratios) if ratios else None
    return (timings.median_seconds(PLAIN)
            or timings.median_seconds(PLAIN, include_disturbed=True))


def run_case(family: Family, shape: tuple[int, ...], args: argparse.Namespace,
             deadline: float) -> Result:
    sample = family.make_sample(*shape)
    model = family.fresh()
    # Every share the measured profile predicts rests on its times: taken on a quiet machine,
    # again (at most three times, while patience lasts) if others ran meanwhile.
    quiet = _common.quiet_profile(model, sample, max_foreign_cores=args.max_foreign_load,
                                  deadline=deadline, attempts=PROFILE_ATTEMPTS, report=None,
                                  loss_fn=family.loss_fn, repeats=args.repeats)
    measured, disturbed = quiet.profile, quiet.disturbed
    foreign = quiet.foreign + (", DISTURBED" if disturbed else "")
    # A fresh model of the same weights: estimate swaps parameters for fake ones while it runs.
    estimated = gradckpt.estimate(family.fresh(), sample, loss_fn=family.loss_fn,
                                  device="this")
    names = [block.name for block in measured.blocks]
    if names != [block.name for block in estimated.blocks]:
        raise SystemExit(f"{family.name}: estimate found other blocks than profile: {names}")
    by_layout: dict[str, Timed] = {}
    for label, plan in solved_plans(measured, args.budget_share):
        entry = priced(measured, estimated, label, plan)
        if entry.layout in by_layout:  # the same segments: timed once, listed under both
            by_layout[entry.layout].also.append(label)
        else:
            by_layout[entry.layout] = entry
    plans = list(by_layout.values())
    control = priced(measured, estimated, DO_NOTHING, gradckpt.solve(measured, None, "none"))
    size = "x".join(str(n) for n in shape)
    print(f"{family.name} {size}: profiled (foreign load meanwhile {foreign}), estimated; timing "
          f"{len(plans) + 1} plans x {args.rounds} rounds", flush=True)
    plain_seconds = time_plans(model, sample, family, [*plans, control], args, deadline)
    return Result(family.name, size, measured, estimated, plans, control, plain_seconds,
                  disturbed)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def share(value: float) -> str:
    return f"{value:.3f}"


def signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


def steps_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        forward_m = sum(b.forward_seconds for b in r.measured.blocks) / r.measured.step_seconds
        forward_e = sum(b.forward_seconds for b in r.estimated.blocks) / r.estimated.step_seconds
        rows.append((
            r.name, r.size,
            f"{r.measured.step_seconds * 1e3:.1f}",
            "-" if r.plain_seconds is None else f"{r.plain_seconds * 1e3:.1f}",
            f"{r.estimated.step_seconds * 1e3:.2f}",
            f"{r.measured.step_seconds / r.estimated.step_seconds:.1f}x",
            share(forward_m), share(forward_e),
        ))
    headers = ["model", "size", "step ms (profile)", "step ms (timed)", "step ms (estimate)",
               "profile/estimate", "blocks' fwd share meas.", "est."]
    return _common.format_table(headers, rows)


def block_shares(profile: gradckpt.Profile) -> list[tuple[float, float, float]]:
    """Per block: forward / step, backward / step, recomputation / forward."""
    step = profile.step_seconds
    return [(b.forward_seconds / step, b.backward_seconds / step,
             b.recompute_seconds() / b.forward_seconds if b.forward_seconds else 0.0)
            for b in profile.blocks]


def blocks_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        for block, mine, theirs in zip(r.measured.blocks, block_shares(r.measured),
                                       block_shares(r.estimated), strict=True):
            rows.append((
                r.name, block.name,
                share(mine[0]), share(theirs[0]), signed(theirs[0] - mine[0]),
                share(mine[1]), share(theirs[1]),
                f"{mine[2]:.2f}", f"{theirs[2]:.2f}",
            ))
    headers = ["model", "block", "fwd/step meas.", "est.", "est-meas", "bwd/step meas.", "est.",
               "recompute/fwd meas.", "est."]
    return _common.format_table(headers, rows)


def spread(entry: Timed) -> str:
    stats = entry.measured
    if stats is None:
        return "-"
    return (f"{stats.lower_quartile - 1:+.3f}..{stats.upper_quartile - 1:+.3f} "
            f"({stats.low - 1:+.3f}..{stats.high - 1:+.3f}, n={stats.rounds})")


def disturbance(result: Result, entry: Timed) -> str:
    """What other processes disturbed for this row: the profile, the timing, both or nothing."""
    parts = (["profile"] if result.profile_disturbed else []) + (
        ["timing"] if entry.disturbed else [])
    return "+".join(parts) or "-"


def plans_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        for entry in [*r.plans, r.control]:
            measured = entry.measured_extra
            label = " = ".join([entry.label, *entry.also])
            ratio = ("-" if measured is None or measured <= 0 or not entry.plan.segments
                     else f"{entry.from_estimate / measured:.2f}")
            rows.append((
                r.name, label, entry.layout,
                signed(entry.from_estimate), signed(entry.from_profile), signed(measured),
                spread(entry),
                "-" if measured is None else signed(entry.from_estimate - measured),
                ratio,
                "-" if measured is None else signed(entry.from_profile - measured),
                disturbance(r, entry),
            ))
    headers = ["model", "plan", "checkpointed", "extra: estimate", "profile", "measured",
               "middle half (min-max, rounds)", "est-meas", "est/meas", "prof-meas",
               "disturbed"]
    return _common.format_table(headers, rows)


def median_worst(errors: list[tuple[float, str]]) -> str:
    if not errors:
        return "n/a (nothing measured)"
    worst = max(errors, key=lambda e: abs(e[0]))
    return (f"median {statistics.median(abs(e) for e, _ in errors):.3f}, worst "
            f"{worst[0]:+.3f} ({worst[1]})")


def counted(rows: list[tuple[Result, Timed]], keep: Callable[[Result, Timed], bool]
            ) -> tuple[list[tuple[Result, Timed]], str]:
    """The rows ``keep`` accepts (all of them, if it accepts none) and a note saying which."""
    kept = [(r, entry) for r, entry in rows if keep(r, entry)]
    if kept:
        return kept, f"{len(kept)} of {len(rows)} plans"
    return rows, f"all {len(rows)} plans, DISTURBED"


def verdict(results: list[Result]) -> str:
    """The closing line: distances in shares of the step, no threshold.

    A busy 2-core machine can slow a step tenfold, so each comparison counts only the rows
    whose own measurements other processes left alone (if none, all rows, and it says so):
    the estimate against the measured extra time needs undisturbed timing (the estimate itself
    runs on a modeled clock); the measured profile's predictions and its block shares need an
    undisturbed profile as well.
    """
    rows = [(r, entry) for r in results for entry in r.plans if entry.measured is not None]
    timed, timed_note = counted(rows, lambda r, entry: not entry.disturbed)
    both, both_note = counted(rows, lambda r, entry: disturbance(r, entry) == "-")
    estimate_errors = [(e.from_estimate - e.measured_extra, f"{r.name} {e.label}")
                       for r, e in timed]
    profile_errors = [(e.from_profile - e.measured_extra, f"{r.name} {e.label}")
                      for r, e in both]
    ratios = [e.from_estimate / e.measured_extra for _, e in timed if e.measured_extra > 0]
    profiles = [r for r in results if not r.profile_disturbed]
    profiles_note = (f"{len(profiles)} of {len(results)} models" if profiles
                     else f"all {len(results)} models, DISTURBED")
    profiles = profiles or results
    forward_errors = [
        (theirs[0] - mine[0], f"{r.name} {block.name}")
        for r in profiles
        for block, mine, theirs in zip(r.measured.blocks, block_shares(r.measured),
                                       block_shares(r.estimated), strict=True)
    ]
    floors = [r.floor for r in results if r.floor is not None and not r.control.disturbed]
    floor = f"{statistics.median(floors):.3f} (worst {max(floors):.3f})" if floors else "n/a"
    steps = [r.measured.step_seconds / r.estimated.step_seconds for r in profiles]
    ratio_text = (f"; estimate/measured {min(ratios):.2f}-{max(ratios):.2f} (median "
                  f"{statistics.median(ratios):.2f})" if ratios else "")
    return (
        f"verdict: extra-time share of the plain step from the estimate vs measured "
        f"({timed_note}): {median_worst(estimate_errors)}{ratio_text}; from the measured "
        f"profile vs measured ({both_note}): {median_worst(profile_errors)}; noise floor "
        f"(do-nothing plan) median {floor}; block forward shares, estimate vs profile "
        f"({profiles_note}): {median_worst(forward_errors)}; measured step "
        f"{min(steps):.1f}-{max(steps):.1f}x the estimate's"
    )


# --------------------------------------------------------------------------------------------
# Arguments and main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Estimated (roofline, device='this') vs measured time shares on this CPU. "
        "Defaults in [brackets]: full run / --quick.")
    _common.add_run_arguments(parser, FULL, QUICK, HELP)
    parser.add_argument("--only", help="comma-separated models: " + ", ".join(SIZES) +
                        f" [{','.join(DEFAULT_CASES)} / {QUICK_CASE} at a small size]")
    parser.add_argument("--budget-share", type=float, default=0.5,
                        help="'optimal' plans' budget, a share of the measured plain peak [0.5]")
    return _common.parse_run_arguments(parser, argv, FULL, QUICK)


def chosen(args: argparse.Namespace) -> list[tuple[Family, tuple[int, ...]]]:
    """The (family, size) pairs to run, in catalogue order."""
    names = args.only or (QUICK_CASE if args.quick else ",".join(DEFAULT_CASES))
    try:
        picked = families(names)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    # --quick shrinks the sample too: it is a smoke test of seconds, not a measurement.
    return [(family, QUICK_SIZE if args.quick and family.name == QUICK_CASE
             else SIZES[family.name]) for family in picked]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    picked = chosen(args)
    # MemTracker's module tracker warns when it loses track of which module runs (Transformers
    # models in backward); only its attribution suffers, not the memory profile reads.
    warnings.filterwarnings("ignore", module="torch.distributed._tools.mod_tracker")
    started = time.monotonic()
    print("bench/estimate_times.py: estimated (roofline) vs measured time shares, this CPU")
    print(f"command: {_common.command_line(argv)}")
    print(_common.describe_machine(torch.device("cpu")))
    print(f"estimate device: {format_device(device_spec('this'))}")
    print(f"gradckpt {gradckpt.__version__} from {os.path.dirname(gradckpt.__file__)}; "
          f"profile repeats {args.repeats}; timing {args.rounds} rounds of {args.warmup} untimed "
          f"+ {args.steps} timed step(s) per block; load average before: "
          f"{_common.load_average()}")
    print()
    deadline = time.monotonic() + args.patience  # for waiting on others, over the whole run
    results = [run_case(family, shape, args, deadline) for family, shape in picked]
    print()
    print("steps: the plain step measured (gradckpt.profile; and timed between the plans, "
          "median), estimated, and each's blocks' forwards summed as a share of the step")
    print(steps_table(results))
    print()
    print("blocks: forward and backward as shares of the step, recomputation over forward "
          "(what checkpointing the block alone adds), measured profile vs estimate")
    print(blocks_table(results))
    print()
    print("plans (solved from the measured profile): extra time as a share of the plain step, "
          "predicted from the estimate (same segments), from the measured profile, and "
          "measured (median over rounds of plan step / plain step, minus 1)")
    print(plans_table(results))
    print()
    print(f"load average after: {_common.load_average()}; {time.monotonic() - started:.0f} s")
    print(verdict(results))
    return 0


if __name__ == "__main__":
    _common.keep_freed_memory()
    sys.exit(main())
