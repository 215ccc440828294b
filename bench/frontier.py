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

Run it (about 2 minutes on a quiet 2-core CPU; ``--quick`` is a smoke test of seconds):

    .venv/bin/python bench/frontier.py
    .venv/bin/python bench/frontier.py --quick
    .venv/bin/python bench/frontier.py --verbose        # also print each gradckpt plan in full

Nothing else CPU-heavy may run meanwhile: like ``bench/engine.py`` the script waits, asleep,
until other processes use at most ``--max-foreign-load`` cores before each timed round, and
discards and reruns a round during which they used more.

How to read the output:

- ``gradients``: every contender's loss and parameter gradients equal the plain model's, bit for
  bit (dropout on, so RNG replay is exercised). A mismatch stops the script with exit status 1:
  timing contenders that compute different things would be meaningless.
- ``measured``: the peak of one training step (MemTracker "peak"/"Total", in runs of its own,
  never while timing) and the step time divided by "none" in the same round (median over rounds,
  [min - max]); extra time = that ratio - 1.
- ``predictions``: for each gradckpt plan, its ``predicted_peak_bytes`` and
  ``predicted_overhead`` against the measured peak and extra time (targets: peak within 5%,
  extra time within 15%). The anchors' layouts get the same cost-model prediction
  (``gradckpt.plan.simulate``), for comparison.
- ``frontier``: for each anchor, gradckpt's extra time divided by the anchor's, counted only when
  gradckpt's measured peak is at most the anchor's. Below 1: gradckpt recomputes less for the
  same memory. The last line is the verdict; the exit status is 0 whatever it says.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import _common
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import gradckpt
from gradckpt.measure import measure_peak_bytes
from gradckpt.models import GPTConfig, TinyGPT
from gradckpt.plan import Plan, Segment, simulate
from gradckpt.policies import is_matmul_or_attention

PEAK_ERROR_TARGET = 0.05  # |predicted - measured| / measured peak
EXTRA_TIME_ERROR_TARGET = 0.15  # |predicted - measured| / measured extra time
NEVER_WORSE_SLACK = 0.05  # extra-time ratio still counted as "not worse": this machine's noise
CLEARLY_BETTER = 0.8  # extra-time ratio counted as "clearly better"
# Measured extra time below this is noise (here a plan identical to "none" measured -0.041):
# no relative error or ratio is computed from it.
TINY_EXTRA = 0.05
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


@contextlib.contextmanager
def plan_installed(model: TinyGPT, plan: Plan) -> Iterator[None]:
    """``gradckpt.apply`` the plan while the context is open, ``gradckpt.disable`` after."""
    gradckpt.apply(model, plan)
    try:
        yield
    finally:
        gradckpt.disable(model)


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


def describe_segments(segments: list[Segment]) -> str:
    """Segments in short: "0-1 2-3" (block ranges), "(4-7: 4-5)" nesting, "+m" save-matmuls."""
    if not segments:
        return "no checkpointing"

    def one(segment: Segment) -> str:
        text = str(segment.start)
        if segment.end > segment.start:
            text += f"-{segment.end}"
        if segment.policy == "save-matmuls":
            text += "+m"
        elif segment.policy:
            text += f"+{segment.policy}"
        if segment.children:
            text = f"({text}: {' '.join(one(child) for child in segment.children)})"
        return text

    return " ".join(one(segment) for segment in segments)


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
                install=functools.partial(plan_installed, model, plan),
                predicted_peak_bytes=plan.predicted_peak_bytes,
                predicted_overhead=plan.predicted_overhead,
                plan=plan,
            )
        by_layout[layout].budgets.append(anchor.name)
        at_budget[anchor.name] = by_layout[layout]
    return list(by_layout.values()), at_budget


# --------------------------------------------------------------------------------------------
# Profiling
# --------------------------------------------------------------------------------------------


def quiet_profile(
    model: TinyGPT, sample: dict[str, torch.Tensor], max_foreign_cores: float, patience: float
) -> gradckpt.Profile:
    """``gradckpt.profile`` on a quiet machine, saying how quiet it stayed.

    The profile's times set every predicted extra time, so a profile taken while another
    process ran would skew all predictions alike; wait first, and report the foreign load.
    """
    if max_foreign_cores != float("inf"):
        _common.wait_for_quiet(max_foreign_cores, time.monotonic() + patience)
    load = _common.ForeignLoad()
    load.start()
    # The progress bar only helps on a terminal; piped into a file it is noise.
    measured = gradckpt.profile(model, sample, progress=sys.stderr.isatty())
    foreign_cores = load.stop()
    foreign = "n/a" if foreign_cores is None else f"{foreign_cores:.2f}"
    print(
        f"gradckpt.profile: peak {mib(measured.peak_bytes)} MiB, fixed "
        f"{mib(measured.fixed_bytes)} MiB, plain step {measured.step_seconds:.3f} s; "
        f"foreign load meanwhile {foreign}"
    )
    if foreign_cores is not None and foreign_cores > max_foreign_cores:
        print("WARNING: other processes ran while profiling; predicted times are suspect.")
    return measured


# --------------------------------------------------------------------------------------------
# Steps, gradient check, memory
# --------------------------------------------------------------------------------------------


def make_step(
    model: TinyGPT, sample: dict[str, torch.Tensor], install: Installer, seed: int
) -> Callable[[], torch.Tensor]:
    """One training step (gradients reset, forward, loss, backward) with ``install`` in effect.

    Installing and removing the checkpointing inside the step keeps every contender on the same
    model instance; it costs microseconds against a step of a fraction of a second.
    """

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the same dropout masks for every contender
        with install():
            loss = model(**sample)
            loss.backward()
        return loss.detach()

    return step


def check_gradients(model: TinyGPT, steps: dict[str, Callable[[], torch.Tensor]]) -> str:
    """Run each step once; losses and gradients must equal the first step's bit for bit."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    results = {}
    for name, step in steps.items():
        loss = step()
        results[name] = (loss, [p.grad.detach().clone() for _, p in named])
    reference_name = next(iter(steps))
    reference_loss, reference_grads = results[reference_name]
    for name, (loss, grads) in results.items():
        differing = [
            parameter_name
            for (parameter_name, _), mine, theirs in zip(named, reference_grads, grads, strict=True)
            if not torch.equal(mine, theirs)
        ]
        if differing or not torch.equal(reference_loss, loss):
            sys.exit(
                f"FAIL: gradients of {name!r} differ from {reference_name!r} (loss "
                f"{loss.item()!r} vs {reference_loss.item()!r}; {len(differing)} of {len(named)} "
                f"gradient tensors differ, first: {differing[:3]})"
            )
    model.zero_grad(set_to_none=True)
    return (
        f"gradients: all {len(steps)} contenders == {reference_name}, bit for bit "
        f"({len(named)} tensors and the loss)"
    )


def measure_peak(model: TinyGPT, sample: dict[str, torch.Tensor], step: Callable) -> int:
    model.zero_grad(set_to_none=True)  # as in gradckpt.profile: gradients are made in the step
    peak = measure_peak_bytes(step, model, *sample.values())
    model.zero_grad(set_to_none=True)
    return peak


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def mib(nbytes: int) -> str:
    return f"{nbytes / _common.MIB:.2f}"


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def measured_table(contenders: list[Contender], ratios: dict[str, _common.RatioStats]) -> str:
    none_peak = contenders[0].peak_bytes
    rows = []
    for c in contenders:
        stats = ratios[c.name]
        rows.append(
            (
                c.name,
                c.layout,
                mib(c.peak_bytes),
                f"{c.peak_bytes / none_peak:.3f}",
                f"{stats.median:.3f} [{stats.low:.3f}-{stats.high:.3f}]",
                f"{stats.median - 1:+.3f}",
            )
        )
    headers = [
        "contender",
        "checkpointed blocks",
        "peak MiB",
        "peak/none",
        "time/none median [min-max]",
        "extra time",
    ]
    return _common.format_table(headers, rows)


@dataclass(frozen=True)
class PredictionCheck:
    peak_error: float
    extra_error: float | None  # None: measured extra time is noise-sized


def check_prediction(contender: Contender, measured_extra: float) -> PredictionCheck:
    peak_error = relative_error(contender.predicted_peak_bytes, contender.peak_bytes)
    extra_error = None
    if abs(measured_extra) >= TINY_EXTRA:
        extra_error = relative_error(contender.predicted_overhead, measured_extra)
    return PredictionCheck(peak_error, extra_error)


def prediction_table(
    contenders: list[Contender], extras: dict[str, float], checks: dict[str, PredictionCheck]
) -> str:
    rows = []
    for c in contenders:
        check = checks[c.name]
        peak_flag = " !" if abs(check.peak_error) > PEAK_ERROR_TARGET else ""
        if check.extra_error is None:
            extra_error = "n/a (~0)"
        else:
            flag = " !" if abs(check.extra_error) > EXTRA_TIME_ERROR_TARGET else ""
            extra_error = f"{100 * check.extra_error:+.1f}%{flag}"
        rows.append(
            (
                c.name,
                mib(c.predicted_peak_bytes),
                mib(c.peak_bytes),
                f"{100 * check.peak_error:+.1f}%{peak_flag}",
                f"{c.predicted_overhead:+.3f}",
                f"{extras[c.name]:+.3f}",
                extra_error,
            )
        )
    headers = [
        "contender",
        "pred. peak MiB",
        "meas. peak MiB",
        "peak err",
        "pred. extra",
        "meas. extra",
        "extra err",
    ]
    return _common.format_table(headers, rows)


@dataclass(frozen=True)
class FrontierRow:
    anchor: str
    text: str  # the row's comparison, or why there is none
    ratio: float | None  # gradckpt extra / anchor extra, when comparable


def frontier_rows(
    anchors: list[Contender],
    at_budget: dict[str, Contender | str],
    extras: dict[str, float],
    seconds: dict[str, list[float]],
) -> list[FrontierRow]:
    rows = []
    for anchor in anchors:
        found = at_budget[anchor.name]
        if isinstance(found, str):
            rows.append(FrontierRow(anchor.name, found, None))
            continue
        memory = f"peak {mib(found.peak_bytes)} vs {mib(anchor.peak_bytes)} MiB"
        paired = _common.ratio_stats(seconds[found.name], seconds[anchor.name])
        time_text = (
            f"step time gradckpt/anchor {paired.median:.3f} [{paired.low:.3f}-{paired.high:.3f}]"
        )
        extra_text = f"extra time {extras[found.name]:+.3f} vs {extras[anchor.name]:+.3f}"
        if extras[anchor.name] >= TINY_EXTRA:
            ratio = max(extras[found.name], 0.0) / extras[anchor.name]
            extra_text += f" -> gradckpt/anchor {ratio:.2f}"
        if found.peak_bytes > anchor.peak_bytes:
            over = found.peak_bytes / anchor.peak_bytes - 1
            text = (
                f"{NOT_AT_MEMORY} ({memory}, +{100 * over:.1f}%), not counted: "
                f"{extra_text}; {time_text}"
            )
            rows.append(FrontierRow(anchor.name, text, None))
        elif extras[anchor.name] < TINY_EXTRA:
            text = f"anchor has no extra time to beat ({extra_text}); {memory}; {time_text}"
            rows.append(FrontierRow(anchor.name, text, None))
        else:
            text = f"{extra_text}; {memory}; {time_text}"
            rows.append(FrontierRow(anchor.name, text, ratio))
    return rows


def verdict(rows: list[FrontierRow], checks: dict[str, PredictionCheck]) -> str:
    compared = [row for row in rows if row.ratio is not None]
    worse = [row.anchor for row in compared if row.ratio > 1 + NEVER_WORSE_SLACK]
    better = [row.anchor for row in compared if row.ratio <= CLEARLY_BETTER]
    not_comparable = [row.anchor for row in rows if row.text.startswith(NOT_AT_MEMORY)]
    no_plan = [row.anchor for row in rows if row.text.startswith(NO_PLAN)]
    never_worse = "PASS" if not (worse or not_comparable or no_plan) else "FAIL"
    peak_ok = sum(abs(c.peak_error) <= PEAK_ERROR_TARGET for c in checks.values())
    timed = [c for c in checks.values() if c.extra_error is not None]
    extra_ok = sum(abs(c.extra_error) <= EXTRA_TIME_ERROR_TARGET for c in timed)
    return (
        f"verdict: never worse (extra-time ratio <= {1 + NEVER_WORSE_SLACK:.2f} at <= memory) "
        f"{never_worse}"
        + (f" (worse: {', '.join(worse)})" if worse else "")
        + (f" (more memory: {', '.join(not_comparable)})" if not_comparable else "")
        + (f" (no plan that low: {', '.join(no_plan)})" if no_plan else "")
        + f"; clearly better (<= {CLEARLY_BETTER}) vs {len(better)} of {len(compared)} anchors"
        + (f" ({', '.join(better)})" if better else "")
        + f"; gradckpt predictions: peak within {100 * PEAK_ERROR_TARGET:.0f}% "
        f"{peak_ok}/{len(checks)}, extra time within {100 * EXTRA_TIME_ERROR_TARGET:.0f}% "
        f"{extra_ok}/{len(timed)}"
    )


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

# Sizes and repetitions: the full run (a plain step ~0.5 s on 2 CPU cores, up to 10 contenders a
# round, the script about 2 minutes) and --quick (a smoke test of seconds). Explicit flags win.
FULL = dict(layers=8, batch=8, seq=128, embd=256, heads=4, rounds=15, warmup=1, patience=300.0)
QUICK = dict(layers=4, batch=2, seq=32, embd=64, heads=2, rounds=3, warmup=1, patience=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Memory/time frontier: torch.utils.checkpoint anchors vs gradckpt 'optimal' "
        "at each anchor's peak, on TinyGPT (CPU). Defaults in [brackets]: full run / --quick.",
    )
    _common.add_run_arguments(
        parser, FULL, QUICK, {"rounds": "timed rounds, each running every contender once"}
    )
    parser.add_argument("--verbose", action="store_true", help="print each gradckpt plan in full")
    return _common.parse_run_arguments(parser, argv, FULL, QUICK)


def command_line(argv: list[str] | None) -> str:
    """The command as typed from the repository root (interpreter path relative when inside)."""
    python = sys.executable
    relative = os.path.relpath(python)
    if not relative.startswith(".."):
        python = relative
    return shlex.join([python, sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu")  # the frontier is a CPU benchmark (MemTracker peaks)

    torch.manual_seed(args.seed)
    config = GPTConfig(
        n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq
    )
    model = TinyGPT(config).train()  # train(): dropout on, RNG replay exercised
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))
    sample = {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    parameter_count = sum(p.numel() for p in model.parameters())

    print("bench/frontier.py: memory/time frontier, torch.utils.checkpoint anchors vs gradckpt")
    print(f"command: {command_line(argv)}")
    print(_common.describe_machine(device))
    print(f"gradckpt {gradckpt.__version__} from {os.path.dirname(gradckpt.__file__)}")
    print(
        f"model: TinyGPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, "
        f"dropout {config.dropout}, {parameter_count / 1e6:.2f}M parameters; "
        f"batch {args.batch} x seq {args.seq}"
    )
    print(f"load average before: {_common.load_average()}")
    print()

    # ---- profile once, measure the anchors' peaks, solve for each -------------------------
    measured_profile = quiet_profile(model, sample, args.max_foreign_load, args.patience)
    anchors = anchor_contenders(model, measured_profile)
    for anchor in anchors:
        anchor.peak_bytes = measure_peak(
            model, sample, make_step(model, sample, anchor.install, args.seed)
        )
    ours, at_budget = gradckpt_contenders(model, measured_profile, anchors)
    for name, found in at_budget.items():
        if isinstance(found, str):
            print(f"  budget {name}: {found}")
    contenders = anchors + ours
    steps = {c.name: make_step(model, sample, c.install, args.seed) for c in contenders}
    for c in ours:
        c.peak_bytes = measure_peak(model, sample, steps[c.name])
    print()
    print("contenders:")
    for index, c in enumerate(contenders):
        budget = f"  (budget = peak of {', '.join(c.budgets)})" if c.budgets else ""
        print(f"  {index:>2}  {c.name:<28} {c.layout}{budget}")
    if args.verbose:
        for c in ours:
            print(f"\n{c.name} (budget = peak of {', '.join(c.budgets)}):\n{c.plan}")
    print()

    print(check_gradients(model, steps))
    print()

    # ---- time: side by side, rotating order -----------------------------------------------
    print(
        f"time: {args.warmup} warm-up round(s), then {args.rounds} rounds; per round the step "
        "time of each contender / none, in the order listed above"
    )

    def show_round(index: int, measured: _common.Round) -> None:
        base = measured.seconds["none"]
        ratios = " ".join(f"{measured.seconds[c.name] / base:.2f}" for c in contenders[1:])
        foreign = "n/a" if measured.foreign_cores is None else f"{measured.foreign_cores:.2f}"
        note = "  DISCARDED (machine busy)" if measured.disturbed else ""
        print(
            f"  round {index + 1:>2}  none {base:.3f}s  {ratios}  foreign load {foreign}{note}",
            flush=True,
        )

    timings = _common.alternate_timings(
        steps,
        args.rounds,
        args.warmup,
        device,
        show_round,
        max_foreign_cores=args.max_foreign_load,
        patience_seconds=args.patience,
    )
    seconds = {name: timings.seconds(name) for name in steps}
    ratios = {name: _common.ratio_stats(seconds[name], seconds["none"]) for name in steps}
    extras = {name: stats.median - 1 for name, stats in ratios.items()}
    discarded = len(timings.rounds) - sum(1 for r in timings.rounds if not r.disturbed)
    plain_seconds = statistics.median(seconds["none"])
    print(
        f"rounds: {len(timings.used)} used, {discarded} discarded (other processes above "
        f"{args.max_foreign_load} core); load average after: {_common.load_average()}"
    )
    # Predicted extra times are fractions of the profile's plain step: if that differs from the
    # plain step timed here, every prediction is off by the same factor.
    print(
        f"plain step: {plain_seconds:.3f} s here (median), {measured_profile.step_seconds:.3f} s "
        f"in gradckpt.profile (ratio {measured_profile.step_seconds / plain_seconds:.3f})"
    )
    if not timings.reliable:
        print("WARNING: fewer undisturbed rounds than asked for; the time ratios are suspect.")
    print()

    # ---- report -------------------------------------------------------------------------
    print("measured: peak of one step (MemTracker), step time / none (same rounds)")
    print(measured_table(contenders, ratios))
    print()

    checks = {c.name: check_prediction(c, extras[c.name]) for c in contenders}
    print(
        "predictions (gradckpt cost model) vs measured; targets: peak within "
        f"{100 * PEAK_ERROR_TARGET:.0f}%, extra time within {100 * EXTRA_TIME_ERROR_TARGET:.0f}% "
        "(! = missed)"
    )
    print(prediction_table(contenders, extras, checks))
    print()

    print("frontier: gradckpt 'optimal' at each anchor's measured peak")
    rows = frontier_rows(anchors, at_budget, extras, seconds)
    width = max(len(row.anchor) for row in rows)
    for row in rows:
        print(f"  {row.anchor:<{width}}  {row.text}")
    print()
    print(verdict(rows, {c.name: checks[c.name] for c in ours}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
