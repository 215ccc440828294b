"""Are plans right on the models people fine-tune? Predicted against measured peaks, per family.

The question (issue 13, item 3): on the model families of ``gradckpt.integrations.hf_families``
(GPT-2, Llama, Qwen2, BERT (masked LM), T5 and ViT built from configs and called with their
labels, a CNN with BatchNorm, and frozen bases with adapters: hand-written LoRA and PEFT), does
the plan ``gradckpt`` makes for 70% and 45% of the plain peak (or the smallest feasible budget,
when 45% is below it) fit, as the step users write measures it? The step is a loop's second step
(``out = model(**batch); out.loss.backward()``): the model's output alive through backward, and
the first step's until the second's forward returns, as ``profile`` assumes by default (no
optimizer here: ``tests/test_enable_training_loop.py`` measures loops with one).

For each model and budget it prints the budget, the predicted and the measured peak (the memory
meter: MemTracker's "Total" on CPU; plans and the plain step measured side by side on one model,
``gradckpt.side_by_side.compare_plans``), measured against budget and against prediction, and
whether the gradients equal the plain model's bit for bit. The closing verdict line asks for
every measured peak within budget + 3%, every plan's prediction within 3% of the measured peak,
the plain step never under-predicted (the budgets are shares of it), and identical gradients.

    .venv/bin/python bench/predictions.py            # about 2 minutes on a 2-core CPU
    .venv/bin/python bench/predictions.py --only llama,t5

Memory is exact to the byte on CPU, so nothing else running matters here (no time is measured).
"""

from __future__ import annotations

import argparse
import sys

import torch

import gradckpt
from gradckpt.integrations.hf_families import Family, families
from gradckpt.side_by_side import compare_plans, plans_at_shares

SHARES = (0.7, 0.45)
ALLOWANCE = 0.03


def run_case(family: Family) -> list[dict]:
    """The plain step and a plan per share of ``SHARES``, each measured side by side on one
    model (``gradckpt.side_by_side.compare_plans``: peaks and gradients, no timing)."""
    sample = family.sample()
    model = family.fresh()
    measured = gradckpt.profile(model, sample, loss_fn=family.loss_fn, repeats=1,
                                progress=False)
    # The plain step's prediction is the cost model's, like every plan's (not the profile's
    # own measured peak, which would hide an error common to all plans).
    plain = gradckpt.solve(measured, None, "none")
    plans = plans_at_shares(measured, SHARES)
    compared = compare_plans(model, sample, {"plain": None, **plans}, loss_fn=family.loss_fn,
                             rounds=0)
    return [{"model": family.name, "budget": label,
             "budget_bytes": None if label == "plain" else plan.budget_bytes,
             "predicted": plan.predicted_peak_bytes, "measured": compared.peak_bytes[label],
             "identical": compared.identical(label)}
            for label, plan in {"plain": plain, **plans}.items()]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated families: " +
                        ", ".join(family.name for family in families()))
    args = parser.parse_args(argv)
    try:
        chosen = families(args.only)
    except ValueError as error:
        parser.error(str(error))
    print(f"bench/predictions.py: torch {torch.__version__}, cpu, step with the output kept")
    header = (f"{'model':<11} {'budget':<11} {'budget MiB':>10} {'predicted':>10} "
              f"{'measured':>10} {'vs budget':>10} {'vs pred.':>9}  gradients")
    print(header)
    print("-" * len(header))
    worst_budget = worst_prediction = 0.0
    plain_under = False
    all_identical = True
    for family in chosen:
        for row in run_case(family):
            over = (row["measured"] / row["budget_bytes"] - 1) if row["budget_bytes"] else None
            error = (row["predicted"] - row["measured"]) / row["measured"]
            if over is None:
                plain_under |= error < -0.001
            else:
                worst_budget = max(worst_budget, over)
                worst_prediction = max(worst_prediction, abs(error))
            all_identical &= row["identical"]
            print(f"{row['model']:<11} {row['budget']:<11} {_mib(row['budget_bytes']):>10} "
                  f"{_mib(row['predicted']):>10} {_mib(row['measured']):>10} "
                  f"{'-' if over is None else f'{over:+.2%}':>10} {error:>+9.2%}  "
                  f"{'identical' if row['identical'] else 'DIFFERENT'}")
        sys.stdout.flush()
    fits = worst_budget <= ALLOWANCE
    close = worst_prediction <= ALLOWANCE
    print(f"\nverdict: measured over budget at most {worst_budget:+.2%} (limit +3%): "
          f"{'PASS' if fits else 'FAIL'}; plan predictions within {worst_prediction:.2%} of "
          f"the measured peak (limit 3%): {'PASS' if close else 'FAIL'}; plain step never "
          f"under-predicted: {'FAIL' if plain_under else 'PASS'}; gradients identical: "
          f"{'PASS' if all_identical else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
