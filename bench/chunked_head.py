"""For a 32k-vocabulary model, what does the chunked head buy?

The question: a language model's output head makes logits of tokens x vocabulary, and its loss
takes a float copy and a log-softmax of them, all alive until backward; for a small model with a
32,000-word vocabulary they are most of the step's activations. gradckpt can compute the head
and the loss in chunks of tokens, each chunk's logits recomputed in backward
(``gradckpt.linear_cross_entropy``; the Hugging Face integration routes a causal language
model's loss through it when the applied plan says so). How far does that lower the least
feasible peak, what does it cost in time, and are the predictions of those plans right?

The model is the README's Llama (``transformers.LlamaConfig(vocab_size=32000, hidden_size=128,
intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
max_position_embeddings=256)``, fp32, 8.5M parameters, two untied 32000 x 128 tables), its batch
``{"input_ids": ids, "labels": ids}`` with ids of shape 2 x 256, trained with AdamW. One profile
(``gradckpt.profile(model, batch, optimizer="adamw")``, taken on a quiet machine as in
``bench/frontier.py``) gives four contenders, all run on the same model instance:

    plain                       no gradckpt at all: the reference for time and gradients
    chunked head alone          the plain blocks, the head in k chunks
                                (``gradckpt.cost.plan_for(profile, "none", None, [],
                                head_chunks=k)``), k the count row 4's plan uses
    least without chunked head  ``solve(profile, B, output_head="plain")``, B the least
                                feasible budget of the plain head (``minimum_peak_bytes``)
    least with chunked head     ``solve(profile, B, output_head="auto")``, B the least over
                                the chunked steps the profile measured
                                (``minimum_peak_bytes(profile.with_chunked_head(k))``)

How it measures (``gradckpt.side_by_side``, docs/planning.md "What `profile` measures"):
memory with ``compare_plans`` (``measure_users_step``: the peak of the loop's second step,
``out = model(**batch); out.loss.backward(); optimizer.step(); optimizer.zero_grad()`` with
``out`` alive until the next forward returns, a real ``torch.optim.AdamW``, MemTracker's
"Total" on CPU), each plan applied with ``gradckpt.apply`` (which installs the head's chunking:
the script checks that a chunked contender's ``out.logits`` is empty, i.e. that the chunked loss
ran); time with ``time_side_by_side`` through ``_common.timed_side_by_side`` (the same step,
each contender's turn between two turns of plain, in an order shuffled each round; a turn is
``--warmup`` untimed and ``--steps`` timed steps, the optimizer stepped; turns during which other
processes used more than ``--max-foreign-load`` cores are discarded and run again, for up to
``--patience`` seconds): ``compare_plans`` times the same step with the same protocol but
without watching the machine. Gradients: one step of each contender from the same weights,
compared with plain's (the chunked loss sums in another order, so it matches within float
rounding, not bit for bit: the largest relative difference, over the loss and each gradient
tensor's norm of difference / its norm, is printed; above 1e-4 the script exits 1).

How to read the output: the table has per contender the checkpointed blocks and head, the
budget, the predicted and the measured peak (MiB) and measured / predicted, the predicted extra
time (``plan.predicted_overhead``) and the measured one (median over rounds of time / plain, -1;
the middle half and min-max of the rounds), and the gradients' difference. Then the least
feasible peak without and with the chunked head (the budgets of rows 3 and 4, and their measured
peaks) and the verdict line: whether the least peak fell to at most a quarter, and whether every
contender's measured peak is within its predicted peak + 3%. With AdamW the parameters, their
gradients and the optimizer's two states are fixed bytes the head cannot lower, so the least
peak may not fall as far as the activations alone would. On CPU the script restarts itself with
glibc keeping freed memory (``_common.keep_freed_memory``).

    .venv/bin/python bench/chunked_head.py            # 3-4 minutes of work on a 2-core CPU,
                                                      # more while it waits for a quiet one
    .venv/bin/python bench/chunked_head.py --quick    # vocab 8000, seq 64, 2 layers: ~30 s
    .venv/bin/python bench/chunked_head.py --optimizer none  # forward and backward only

The exit status is 0 whatever the verdict, 1 only if a contender's gradients differ from plain's
beyond rounding.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import _common
import torch
from _common import describe_segments, mib

import gradckpt
from gradckpt.cost import plan_for
from gradckpt.plan import Plan
from gradckpt.side_by_side import (
    Contender,
    RatioStats,
    UsersStep,
    compare_plans,
    installed,
    summarize_ratios,
)
from gradckpt.solvers.optimal import minimum_peak_bytes

FULL: dict[str, Any] = dict(vocab=32000, layers=4, batch=2, seq=256, embd=128, heads=4,
                            rounds=10, warmup=1, steps=3, repeats=3, patience=120.0)
QUICK: dict[str, Any] = dict(vocab=8000, layers=2, batch=2, seq=64, embd=128, heads=4,
                             rounds=3, warmup=0, steps=1, repeats=1, patience=0.0)
PEAK_ALLOWANCE = 0.03  # a measured peak within its prediction + 3% counts as predicted
LEAST_TARGET = 0.25  # the least feasible peak at most a quarter of the plain head's
GRADIENT_TOLERANCE = 1e-4  # relative; the chunked loss sums in another order
PLAIN = "plain"
ALONE = "chunked head alone"
LEAST_PLAIN = "least without chunked head"
LEAST_CHUNKED = "least with chunked head"


@dataclass
class Row:
    """One contender: what runs, what was predicted and what was measured."""

    name: str
    contender: Contender  # None: the model as it is
    plan: Plan  # the predictions (for plain: the cost model's plain step)
    peak_bytes: int = 0
    gradient_difference: float = 0.0  # relative, against plain; 0.0: bit for bit
    logits_width: int | None = None  # out.logits.shape[-1] in its step

    @property
    def chunks(self) -> int:
        return self.plan.head_chunks

    @property
    def layout(self) -> str:
        head = f"head in {self.chunks} chunks" if self.chunks > 1 else "plain head"
        return f"{describe_segments(self.plan.segments)}; {head}"

    @property
    def peak_error(self) -> float:
        return self.peak_bytes / self.plan.predicted_peak_bytes - 1


# --------------------------------------------------------------------------------------------
# The model and the contenders
# --------------------------------------------------------------------------------------------


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor], str]:
    """The Llama, its batch and a line describing them (seeded by ``--seed``)."""
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.embd, intermediate_size=2 * args.embd,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(args.heads // 2, 1), max_position_embeddings=max(args.seq, 256),
    )
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(args.seed + 1))
    count = sum(p.numel() for p in model.parameters())
    logits = args.batch * args.seq * args.vocab * 4
    description = (
        f"model: Llama {args.layers} layers, hidden {args.embd}, {args.heads} heads, vocab "
        f"{args.vocab}, fp32, {count / 1e6:.2f}M parameters ({mib(4 * count)} MiB); batch "
        f"{args.batch} x seq {args.seq}, labels = input_ids (one logits tensor {mib(logits)} MiB); "
        "AdamW"
    )
    return model, {"input_ids": ids, "labels": ids}, description


def least_budgets(profile: gradckpt.Profile) -> tuple[int, int]:
    """The least feasible budget with the plain head, and over the chunked steps measured."""
    plain = minimum_peak_bytes(profile)
    chunked = min(minimum_peak_bytes(profile.with_chunked_head(head.chunks))
                  for head in profile.chunked_heads)
    return plain, chunked


def contenders(profile: gradckpt.Profile) -> list[Row]:
    """The four rows (see the module)."""
    least_plain, least_chunked = least_budgets(profile)
    with_head = gradckpt.solve(profile, least_chunked, "optimal", output_head="auto")
    without = gradckpt.solve(profile, least_plain, "optimal", output_head="plain")
    alone = plan_for(profile, "none", None, [], head_chunks=with_head.head_chunks)
    return [
        Row(PLAIN, None, plan_for(profile, "none", None, [])),
        Row(ALONE, alone, alone),
        Row(LEAST_PLAIN, without, without),
        Row(LEAST_CHUNKED, with_head, with_head),
    ]


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------


def compare_gradients_within_rounding(
    model: torch.nn.Module, sample: dict[str, torch.Tensor], rows: list[Row], seed: int
) -> None:
    """One step of each contender from the same weights (no optimizer): its loss and gradients
    against the first row's, as the largest relative difference (0.0: bit for bit); also the
    width of the logits the step returned (0: the chunked loss ran, no whole logits)."""
    step = UsersStep(model, sample, seed=seed)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    found = []
    for row in rows:
        with installed(model, row.contender):
            loss = step()
            row.logits_width = step.out.output.logits.shape[-1]
            step.out.output = None
        found.append((loss.detach().clone(), [p.grad.detach().clone() for _, p in named]))
        model.zero_grad(set_to_none=True)
    reference_loss, reference = found[0]
    for row, (loss, gradients) in zip(rows, found, strict=True):
        worst = abs(float(loss) / float(reference_loss) - 1)
        for mine, theirs in zip(gradients, reference, strict=True):
            if not torch.equal(mine, theirs):
                norm = float(theirs.norm())
                difference = float((mine - theirs).norm())
                worst = max(worst, difference / norm if norm else math.inf)
        row.gradient_difference = worst


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def extra_text(stats: RatioStats | None, disturbed: bool) -> tuple[str, str]:
    """The extra time (median ratio - 1) and its spread, as the table prints them."""
    if stats is None:
        return "1 (reference)", ""
    spread = (f"{stats.lower_quartile - 1:+.1%} to {stats.upper_quartile - 1:+.1%} "
              f"({stats.low - 1:+.1%} to {stats.high - 1:+.1%}, n={stats.rounds})")
    return f"{stats.median - 1:+.1%}{' (busy)' if disturbed else ''}", spread


def table(rows: list[Row], extras: dict[str, tuple[RatioStats | None, bool]],
          seconds: dict[str, float | None]) -> str:
    body = []
    for index, row in enumerate(rows, 1):
        budget = "-" if row.plan.budget_bytes is None else mib(row.plan.budget_bytes)
        predicted_extra = "0" if row.contender is None else f"{row.plan.predicted_overhead:+.1%}"
        extra, spread = extra_text(*extras[row.name])
        step = "-" if seconds[row.name] is None else f"{seconds[row.name]:.3f}"
        gradients = ("reference" if index == 1 else "bit for bit" if row.gradient_difference == 0
                     else f"{row.gradient_difference:.1e}")
        body.append([f"{index} {row.name}", row.layout, budget, mib(row.plan.predicted_peak_bytes),
                     mib(row.peak_bytes), f"{row.peak_error:+.2%}", predicted_extra, step, extra,
                     spread, gradients])
    headers = ["contender", "checkpointed blocks; head", "budget MiB", "predicted MiB",
               "measured MiB", "meas./pred.", "pred. extra", "step s", "extra time",
               "middle half (min to max, rounds)", "gradients vs plain"]
    return _common.format_table(headers, body)


def verdict(rows: list[Row]) -> list[str]:
    """The least peak's reduction, then the verdict line."""
    by_name = {row.name: row for row in rows}
    without, with_head = by_name[LEAST_PLAIN], by_name[LEAST_CHUNKED]
    least_before, least_after = without.plan.budget_bytes, with_head.plan.budget_bytes
    share = least_after / least_before
    measured_share = with_head.peak_bytes / without.peak_bytes
    lines = [
        f"least feasible peak {mib(least_before)} MiB -> {mib(least_after)} MiB ({share:.2f}x); "
        f"measured {mib(without.peak_bytes)} MiB -> {mib(with_head.peak_bytes)} MiB "
        f"({measured_share:.2f}x)"
    ]
    within = [row for row in rows if row.peak_error <= PEAK_ALLOWANCE]
    worst = max(rows, key=lambda row: row.peak_error)
    quarter = share <= LEAST_TARGET and measured_share <= LEAST_TARGET
    lines.append(
        f"verdict: least feasible peak at most a quarter with the chunked head: "
        f"{'YES' if quarter else 'NO'} ({share:.2f}x predicted, {measured_share:.2f}x measured); "
        f"measured peak within predicted + 3%: {'YES' if len(within) == len(rows) else 'NO'} "
        f"({len(within)} of {len(rows)}, worst {worst.name} {worst.peak_error:+.2%})"
    )
    return lines


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="What the chunked output head buys a 32k-vocabulary Llama: the least "
        "feasible peak, time and predictions. Defaults in [brackets]: full run / --quick.",
    )
    _common.add_run_arguments(parser, FULL, QUICK, {
        "vocab": "vocabulary size",
        "embd": "hidden size (intermediate: twice it)",
        "rounds": "timed rounds; per round each contender between two turns of plain",
        "warmup": "untimed steps at the start of every turn",
        "steps": "timed steps in every turn (the turn's time: their median)",
        "repeats": "gradckpt.profile's repeats (times: their median)",
    })
    parser.add_argument(
        "--optimizer", choices=["adamw", "none"], default="adamw",
        help="the loop's optimizer: adamw (its state and step planned for and run) or none "
        "(forward and backward only, where the head's share of the step shows whole) [adamw]",
    )
    return _common.parse_run_arguments(parser, argv, FULL, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # MemTracker's module tracker warns when it loses track of which module runs (Transformers
    # models in backward); that changes nothing in the "Total" read here.
    warnings.filterwarnings("ignore", module="torch.distributed._tools.mod_tracker")
    started = time.monotonic()
    model, sample, description = build(args)
    if args.optimizer == "none":
        description = description.replace("; AdamW", "; no optimizer step")
    print("bench/chunked_head.py: what the chunked output head buys")
    print(f"command: {_common.command_line(argv)}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; machine: {os.cpu_count()} CPU cores; "
          f"{_common.describe_machine(torch.device('cpu'))}")
    print(f"gradckpt {gradckpt.__version__} from {os.path.dirname(gradckpt.__file__)}")
    print(description)
    print(f"load average before: {_common.load_average()}")
    print()

    profile = _common.quiet_profile(
        model, sample, max_foreign_cores=args.max_foreign_load,
        deadline=time.monotonic() + args.patience, optimizer=args.optimizer,
        repeats=args.repeats,
    ).profile
    if not profile.chunked_heads:
        raise SystemExit(f"FAIL: the profile offers no chunked head: "
                         f"{profile.notes.get('chunked_head')}")
    print("  chunked steps measured: " + "; ".join(
        f"{head.chunks} chunks: peak {mib(head.peak_bytes)} MiB, head {mib(head.head_bytes)} "
        f"MiB, least {mib(minimum_peak_bytes(profile.with_chunked_head(head.chunks)))} MiB, "
        f"+{head.extra_seconds:.3f} s" for head in profile.chunked_heads))
    rows = contenders(profile)
    alone, least = rows[1].plan, rows[3].plan
    if (alone.segments, alone.head_chunks) == (least.segments, least.head_chunks):
        print(f"  ({LEAST_CHUNKED}'s plan checkpoints no block: it is {ALONE}'s layout, run "
              "twice)")
    print()

    optimizer = torch.optim.AdamW(model.parameters()) if args.optimizer == "adamw" else None
    compared = compare_plans(model, sample, {row.name: row.contender for row in rows},
                             optimizer=optimizer, rounds=0, seed=args.seed,
                             check_gradients=False)
    for row in rows:
        row.peak_bytes = compared.peak_bytes[row.name]
    compare_gradients_within_rounding(model, sample, rows, args.seed)
    unapplied = [row.name for row in rows if row.chunks > 1 and row.logits_width != 0]
    if unapplied:
        raise SystemExit(f"FAIL: {', '.join(unapplied)}: the plan chunks the head, but the step "
                         "returned whole logits (the chunked loss did not run)")
    print(f"head check: chunked contenders' out.logits have width 0 (the chunked loss ran); "
          f"plain head's: {rows[0].logits_width}")

    block = f"{args.warmup} untimed + {args.steps} timed step(s)"
    print(f"time: {args.rounds} rounds; per round plain, then each contender followed by plain, "
          f"shuffled (seed {args.seed}); a turn is {block}, "
          f"{'AdamW stepped' if optimizer else 'no optimizer step'}")
    step = UsersStep(model, sample, optimizer=optimizer, seed=args.seed)
    times = _common.timed_side_by_side(
        {row.name: step for row in rows}, args.rounds, warmup_rounds=0,
        warmup_steps=args.warmup, timed_steps=args.steps, bracketed=True,
        shuffle_seed=args.seed,
        setup={row.name: (lambda contender=row.contender: installed(model, contender))
               for row in rows},
        max_foreign_cores=args.max_foreign_load, patience_seconds=args.patience,
    )
    extras: dict[str, tuple[RatioStats | None, bool]] = {PLAIN: (None, False)}
    for row in rows[1:]:
        ratios, disturbed = _common.ratios_or_all(times, row.name)
        extras[row.name] = (summarize_ratios(ratios), disturbed)
    seconds = {row.name: times.median_seconds(row.name)
               or times.median_seconds(row.name, include_disturbed=True) for row in rows}
    discarded = sum(turn.disturbed for measured in times.rounds for turn in measured.turns)
    print(f"  {len(times.rounds)} rounds run, {discarded} turns discarded (other processes used "
          f"more than {args.max_foreign_load} core); load average after: "
          f"{_common.load_average()}")
    if not times.reliable:
        print("WARNING: fewer undisturbed rounds than asked for; the extra times are suspect.")
    print()

    print("peaks: the loop's 2nd step (compare_plans, MemTracker); predicted: "
          "plan.predicted_peak_bytes (plain: the cost model's plain step); extra time: median "
          "over rounds of time / plain - 1")
    print(table(rows, extras, seconds))
    print()
    for line in verdict(rows):
        print(line)
    print(f"runtime: {(time.monotonic() - started) / 60:.1f} minutes")
    bad = [row.name for row in rows if row.gradient_difference > GRADIENT_TOLERANCE]
    if bad:
        print(f"FAIL: gradients of {', '.join(bad)} differ from plain's beyond "
              f"{GRADIENT_TOLERANCE:.0e} (relative)")
        return 1
    return 0


if __name__ == "__main__":
    _common.keep_freed_memory()
    sys.exit(main())
