"""Under ``torch.compile``, does a gradckpt plan beat compile's own memory knob?

The question: ``torch.compile`` has its own way of trading time for memory,
``torch._functorch.config.activation_memory_budget`` (1.0: the default partitioner; 0.0:
recompute as much as it can; in between: a knapsack of what to recompute), which users set
instead of checkpointing. A model with a gradckpt plan applied compiles too, each planned block
becoming a ``torch.utils.checkpoint`` region (``src/gradckpt/engine/compiled.py``). On the same
Llama (``transformers.LlamaConfig``, fp32, labels in the batch, the step as users write it:
``out = model(**batch); out.loss.backward()`` with ``out`` alive), compiled with inductor on CPU:
at each of the knob's peaks, does a gradckpt plan reach that peak or lower with less extra time?
And is a gradckpt byte budget honoured once compiled? Contenders, all in one run:

    knob 1.0, 0.5, 0.2, 0.0     ``activation_memory_budget`` set before ``torch.compile``, no
                                plan; "knob 1.0" is compiled plain, the reference
    gradckpt every-layer        ``gradckpt.solve(profile, None, "every-layer")``, applied, compiled
    gradckpt optimal @ knob K   ``gradckpt.solve(profile, B, "optimal")``, applied, compiled, with B
                                knob K's measured compiled peak as bytes of the eager step (the
                                profile's fixed bytes, parameters and inputs, plus the peak above
                                the base)
    gradckpt optimal @ P% eager peak
                                the same with B a quarter, half and three quarters of the way
                                from the least feasible peak to the plain eager peak (P: B as a
                                share of the plain eager peak); a grid independent of the knob
    Where B is below the least feasible budget, that one instead ("least"); none where B reaches
    the plain eager peak (nothing to checkpoint). Plans equal to one already listed are left out.
    --quick: knob 1.0 and one plan (optimal, halfway) on a 2-layer Llama: no knob below 1.0,
    so no knob verdict.

The full model: 6 layers, hidden 256, 4 heads (2 key/value heads), vocab 1000, batch 2 x seq
512 (4.8M parameters; activations about 7x the parameters; a plain step about 0.23 s eager,
0.21 s compiled). Compiling it takes 12-25 s per contender here (from scratch), 3-6 s from the
run's inductor cache, which keeps a fresh process per timing run affordable.

The profile is eager (``gradckpt.profile`` in the main process, taken once other processes
use at most ``--max-foreign-load`` cores or ``--patience`` seconds have passed, as in
``bench/frontier.py``: its times choose the optimal plans): the plans, their budgets and
``plan.predicted_peak_bytes`` are about the eager step. The knob stays at 1.0 for gradckpt's
contenders. No Llama here has dropout, so ``torch._inductor.config.fallback_random`` changes
nothing (no random op is compiled). Every process sets
``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True``: Transformers'
attention forward (through the ``kernels`` package) sets a context variable, a side effect
Dynamo refuses inside a checkpoint region, so without it every checkpointed block becomes a
graph break (plain ``torch.utils.checkpoint`` around the layers too, not only gradckpt's).
Each process reports how many graphs Dynamo made and its graph-break count (gradckpt's
contenders show 2: its Hugging Face adapter's forward pre-hook on the whole model, which runs
eagerly before the single graph).

How it measures memory (MemTracker cannot see inside compiled graphs): each contender in a
fresh subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` in its environment, so that glibc gives
every freed block of 64 KiB or more back to the OS; it compiles and runs 2 more steps, writes 5
to ``/proc/self/clear_refs`` (which resets ``VmHWM``), reads ``VmRSS`` as the base, runs one
step and reads ``VmHWM``. The peak is ``VmHWM - base``: what the step adds to the parameters,
the inputs, torch and the compiled code (gradients are set to None before and after each step,
as ``optimizer.zero_grad()`` does; the base is printed too). These runs are never timed, and
they compile from scratch (a fresh inductor cache for the whole run; the timing runs reuse it).
As a check of the method, the eager plain step is measured the same way and compared with the
profile's MemTracker peak (``peak_bytes - fixed_bytes``): they agree where the step's tensors
are 64 KiB or more (within 0.1% on the full model); ``--quick``'s tiny model has many smaller
ones, which glibc serves from heap pages already touched, so its RSS peaks read low. Each memory
process also reports the loss and the gradients' norm of one step: contenders that compute
different things would be meaningless.

How it times: each contender needs its own compile, so each is timed in its own process, with
the glibc settings of ``_common.keep_freed_memory`` (``MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=1073741824``: freed memory kept, as CUDA's
caching allocator keeps it), never with the memory runs' setting: the compile (from the cache)
and ``--warmup`` untimed steps, then ``--steps`` timed ones, the process's time being their
median. Processes run in ``--rounds`` rounds; a round runs every contender but compiled plain
once, in an order shuffled afresh each round (seeded by ``--seed``), and compiled plain runs
before the first round and after each round, so each round sits between two plain runs. A
contender's ratio in a round: its time over the mean of the plain runs before and after that
round; extra time = the median ratio over rounds - 1 (spread: min-max over rounds). Each timing
process, compiled and warmed up, waits, asleep, until other processes use at most
``--max-foreign-load`` cores before its timed steps (until ``--patience`` seconds after the
first timing process started, at the latest); a process during whose timed steps they used
more is marked disturbed, run again (at most twice, while patience lasts) and, if still
disturbed, left out of the ratios (all are used if every one was). On this 2-core machine a
busy neighbour does not just add 10-20%: with torch's two OpenMP threads competing for the
cores, steps took 10 to 100 times longer, so disturbed processes are not comparable at all.

How to read the output: one table, a row per contender: peak above base (MiB) and as % of
compiled plain's, step time (median over rounds of the processes' medians, and min-max), extra
time vs compiled plain (median ratio - 1, min-max); for gradckpt's plans also the budget and the
eager step's predicted peak, both above the profile's fixed bytes so that they compare with the
RSS peaks, and the eager step's predicted extra time (``plan.predicted_overhead``). Then, for
each knob setting below 1.0, the fastest gradckpt contender at its peak or lower ("YES" when its
median extra time is below the knob's; whether the two min-max ranges over rounds overlap is
stated, no noise threshold is applied), and for each budgeted plan its compiled peak (fixed
bytes + the peak above base) against its budget and against its eager prediction; the last line
but one is the verdict. The exit status is 0 whatever the verdict, 1 only if a contender's loss
differs from compiled plain's by more than 1e-4 (relative). From run to run (three runs here):
a compiled peak moved by up to 3 MiB (about 2%), so a plan whose compiled peak lands within 2%
of its budget can read honoured in one run and not in the next; a step time by 5-10%; and the
plan "optimal" makes for the same budget changed with the profile's times.

    .venv/bin/python bench/compile.py               # 10.5 minutes on a quiet 2-core CPU
    .venv/bin/python bench/compile.py --rounds 2    # 8 minutes
    .venv/bin/python bench/compile.py --quick       # tiny model, plain and one plan: 1 minute
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import _common
import torch
from _common import command_line, describe_segments

import gradckpt
from gradckpt.plan import Plan
from gradckpt.side_by_side import RatioStats, summarize_ratios
from gradckpt.solvers.optimal import minimum_peak_bytes

FULL: dict[str, Any] = dict(layers=6, batch=2, seq=512, embd=256, heads=4, rounds=3, warmup=2,
                            steps=8, patience=300.0)
QUICK: dict[str, Any] = dict(layers=2, batch=2, seq=128, embd=128, heads=2, rounds=1, warmup=1,
                             steps=2, patience=0.0)
KNOBS = (1.0, 0.5, 0.2, 0.0)
# Budgets of "optimal" besides the knob's peaks: these shares of the way from the least feasible
# peak to the plain eager peak.
GRID = (0.25, 0.5, 0.75)
QUICK_GRID = (0.5,)
PLAIN = "knob 1.0"  # compiled plain: the reference for memory and time
VOCAB = 1000
LOSS_TOLERANCE = 1e-4  # relative; compiled graphs that recompute may round differently
MEMORY_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536"}
RETRIES = 2  # a disturbed timing process is run again at most this often, while patient
WORKER_TIMEOUT = 900  # seconds; a compile that takes longer has gone wrong
MIB = _common.MIB


# --------------------------------------------------------------------------------------------
# The worker: one contender, compiled in a process of its own
# --------------------------------------------------------------------------------------------


def build(spec: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The Llama and its batch, the same in every process (seeded)."""
    import transformers

    torch.manual_seed(spec["seed"])
    embd, heads = spec["embd"], spec["heads"]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=embd, intermediate_size=embd * 8 // 3,
        num_hidden_layers=spec["layers"], num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1), max_position_embeddings=spec["seq"],
    )
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(3, VOCAB, (spec["batch"], spec["seq"]),
                        generator=torch.Generator().manual_seed(spec["seed"] + 1))
    return model, {"input_ids": ids, "labels": ids}


def status_bytes(key: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile one contender and measure it: ``spec["mode"]`` is "memory" or "time"."""
    model, batch = build(spec)
    if spec["plan"] is not None:
        gradckpt.apply(model, Plan.from_json(spec["plan"]))  # before compiling: compile sees it
    torch._functorch.config.activation_memory_budget = spec["knob"]  # read when compiling
    torch._dynamo.config.cache_size_limit = 64  # a recompile would show in "graphs" below
    # Transformers' attention (with the ``kernels`` package installed) sets a context variable
    # in its forward; inside a checkpoint region Dynamo refuses that side effect and breaks the
    # graph at every checkpointed block, unless told not to replay it in the recomputation.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    runner = torch.compile(model) if spec["compile"] else model

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)  # optimizer.zero_grad(): no gradients between steps
        out = runner(**batch)
        out.loss.backward()  # ``out`` (the logits) alive until backward ends
        loss = out.loss.detach()
        del out
        return loss

    start = time.perf_counter()
    step()  # compiles
    result: dict[str, Any] = {"compile_seconds": time.perf_counter() - start}
    for _ in range(spec["warmup"]):
        step()
    model.zero_grad(set_to_none=True)
    if spec["mode"] == "memory":
        gc.collect()
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS
        base = status_bytes("VmRSS")
        step()
        model.zero_grad(set_to_none=True)
        result |= {"base_bytes": base, "peak_bytes": status_bytes("VmHWM") - base}
        loss = step()
        norms = [p.grad.double().norm() ** 2 for p in model.parameters() if p.grad is not None]
        result |= {"loss": loss.item(), "grad_norm": math.sqrt(sum(norms).item())}
    else:
        # Wait here, after compiling, so that nothing starts between the wait and the steps.
        if spec["quiet"] is not None and time.time() < spec["quiet_until"]:
            waited = time.monotonic()
            _common.wait_for_quiet(spec["quiet"], time.monotonic() + spec["quiet_until"]
                                   - time.time(), log=lambda line: None)
            result["waited_seconds"] = time.monotonic() - waited
        gc.collect()
        gc.freeze()
        load = _common.ForeignLoad()
        load.start()
        seconds = []
        for _ in range(spec["steps"]):
            begin = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - begin)
        result |= {"seconds": seconds, "foreign_cores": load.stop()}
    counters = torch._dynamo.utils.counters
    result |= {"graphs": counters["stats"]["unique_graphs"],
               "graph_breaks": sum(counters["graph_break"].values())}
    return result


def run_worker(spec: dict[str, Any], environment: dict[str, str]) -> dict[str, Any]:
    """Run ``worker(spec)`` in a fresh process; its result, or ``{"error": ...}``."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        done = subprocess.run(command, env=environment, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {WORKER_TIMEOUT} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit status {done.returncode}: {tail}"}


def environments(cache: str) -> tuple[dict[str, str], dict[str, str]]:
    """The memory runs' and the timing runs' environments (both share the inductor cache)."""
    shared = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    memory = {k: v for k, v in shared.items() if k not in _common.FREED_MEMORY_KEPT}
    timing = {k: v for k, v in shared.items() if k not in MEMORY_ENVIRONMENT}
    return memory | MEMORY_ENVIRONMENT, timing | _common.FREED_MEMORY_KEPT


# --------------------------------------------------------------------------------------------
# Contenders
# --------------------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    knob: float = 1.0
    plan: Plan | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # the memory run's result
    timed: list[dict[str, Any]] = field(default_factory=list)  # one per timing process

    @property
    def failed(self) -> str | None:
        runs = [self.memory, *self.timed]
        return next((run["error"] for run in runs if "error" in run), None)

    @property
    def peak(self) -> int | None:
        return self.memory.get("peak_bytes")


def spec_for(args: argparse.Namespace, contender: Contender, mode: str,
             compiled: bool = True, quiet_until: float = 0.0) -> dict[str, Any]:
    """What ``worker`` runs; a timing worker waits for a quiet machine until ``quiet_until``
    (``time.time()``) at the latest."""
    sizes = {key: getattr(args, key) for key in ("layers", "batch", "seq", "embd", "heads")}
    quiet = None if args.max_foreign_load == float("inf") else args.max_foreign_load
    return sizes | {
        "seed": args.seed, "mode": mode, "knob": contender.knob, "compile": compiled,
        "plan": None if contender.plan is None else contender.plan.to_json(),
        "warmup": 2 if mode == "memory" else args.warmup, "steps": args.steps,
        "quiet": quiet, "quiet_until": quiet_until,
    }


def plan_contenders(profile: gradckpt.Profile, knob_rows: list[Contender], quick: bool
                    ) -> tuple[list[Contender], list[str]]:
    """gradckpt's contenders: every-layer; optimal at each knob's compiled peak (as bytes of
    the eager step); optimal at ``GRID`` (``QUICK_GRID`` alone with ``quick``) of the way from
    the least feasible to the plain eager peak. Returns them, and notes on budgets that gave
    no new plan."""
    least, plain = minimum_peak_bytes(profile), profile.peak_bytes
    targets = [] if quick else [(row.name, profile.fixed_bytes + row.peak) for row in knob_rows
                                if row.knob < 1.0 and row.peak is not None]
    for share in QUICK_GRID if quick else GRID:
        budget = round(least + share * (plain - least))
        targets.append((f"{100 * budget / plain:.0f}% eager peak", budget))
    plans: list[Contender] = []
    if not quick:
        plans.append(Contender("gradckpt every-layer",
                               plan=gradckpt.solve(profile, None, "every-layer")))
    notes = []
    for label, budget in targets:
        name = f"gradckpt optimal @ {label}"
        if budget >= plain:
            notes.append(f"{name}: budget {budget / MIB:.1f} MiB reaches the plain eager peak "
                         f"({plain / MIB:.1f} MiB): nothing to checkpoint")
            continue
        if budget < least:
            notes.append(f"{name}: budget {budget / MIB:.1f} MiB is below the least feasible "
                         f"{least / MIB:.1f} MiB; solved for that instead")
            budget, name = least, f"{name} (least)"
        plan = gradckpt.solve(profile, budget, "optimal")
        same = next((c for c in plans if c.plan.segments == plan.segments), None)
        if same is not None:
            notes.append(f"{name}: the same plan as {same.name}; left out")
            continue
        plans.append(Contender(name, plan=plan))
    return plans, notes


# --------------------------------------------------------------------------------------------
# Timing rounds
# --------------------------------------------------------------------------------------------


def time_contenders(args: argparse.Namespace, contenders: list[Contender],
                    environment: dict[str, str]) -> int:
    """Run the timing processes, filling each contender's ``timed`` (compiled plain's: before
    the first round and after each round, so ``rounds + 1``); returns how many were rerun."""
    plain, others = contenders[0], [c for c in contenders[1:] if not c.failed]
    rng = random.Random(args.seed)
    deadline = time.time() + args.patience
    reruns = 0

    def one(contender: Contender) -> dict[str, Any]:
        nonlocal reruns
        for attempt in range(1 + RETRIES):
            result = run_worker(spec_for(args, contender, "time", quiet_until=deadline),
                                environment)
            if "error" in result:
                print(f"    {contender.name}: FAILED {result['error']}", flush=True)
                return result
            foreign = result["foreign_cores"]
            result["disturbed"] = foreign is not None and foreign > args.max_foreign_load
            mark = "  DISTURBED" if result["disturbed"] else ""
            load = "n/a" if foreign is None else f"{foreign:.2f}"
            waited = result.get("waited_seconds", 0.0)
            wait = f", waited {waited:.0f} s for quiet" if waited >= 1 else ""
            print(f"    {contender.name:<40} {statistics.median(result['seconds']):.3f} s "
                  f"(compile {result['compile_seconds']:.0f} s{wait}, foreign load {load}){mark}",
                  flush=True)
            if not result["disturbed"] or time.time() >= deadline or attempt == RETRIES:
                return result
            reruns += 1
            print("    (run again)", flush=True)
        raise AssertionError("unreachable")

    print("  plain, before round 1")
    plain.timed.append(one(plain))
    for index in range(args.rounds):
        print(f"  round {index + 1}")
        for contender in rng.sample(others, len(others)):
            contender.timed.append(one(contender))
        print(f"  plain, after round {index + 1}")
        plain.timed.append(one(plain))
    return reruns


def usable(runs: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The runs that count (None in place of those that do not): undisturbed, or all when
    every one was disturbed."""
    good = [run for run in runs if "seconds" in run]
    keep = [run for run in good if not run["disturbed"]] or good
    return [run if any(run is k for k in keep) else None for run in runs]


def time_spreads(contenders: list[Contender]) -> dict[str, tuple[RatioStats, RatioStats] | None]:
    """Per contender: step seconds (over its processes' medians) and ratio to plain (round by
    round, against the mean of the plain runs around the round)."""
    plain_runs = usable(contenders[0].timed)
    plain_seconds = [None if run is None else statistics.median(run["seconds"])
                     for run in plain_runs]
    found: dict[str, tuple[RatioStats, RatioStats] | None] = {}
    for index, contender in enumerate(contenders):
        runs = usable(contender.timed)
        seconds = [statistics.median(run["seconds"]) for run in runs if run is not None]
        if not seconds:
            found[contender.name] = None
            continue
        if index == 0:
            found[contender.name] = (summarize_ratios(seconds), summarize_ratios([1.0]))
            continue
        ratios = []
        for round_index, run in enumerate(runs):
            around = [s for s in plain_seconds[round_index:round_index + 2] if s is not None]
            if run is not None and around:
                ratios.append(statistics.median(run["seconds"]) / statistics.mean(around))
        found[contender.name] = ((summarize_ratios(seconds), summarize_ratios(ratios)) if ratios
                                 else None)
    return found


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def table(contenders: list[Contender], times: dict[str, tuple[RatioStats, RatioStats] | None],
          fixed: int) -> str:
    plain_peak = contenders[0].peak
    rows = []
    for c in contenders:
        if c.failed and c.peak is None:
            rows.append([c.name, "FAILED", "", "", "", "", "", "", ""])
            continue
        share = f"{100 * c.peak / plain_peak:.0f}%" if plain_peak else "-"
        budget = predicted = predicted_extra = "-"
        if c.plan is not None:
            predicted = f"{(c.plan.predicted_peak_bytes - fixed) / MIB:.1f}"
            predicted_extra = f"{100 * c.plan.predicted_overhead:+.1f}%"
            if c.plan.budget_bytes is not None:
                budget = f"{(c.plan.budget_bytes - fixed) / MIB:.1f}"
        timing = times.get(c.name)
        if timing is None:
            step = extra = "FAILED" if c.failed else "-"
        else:
            seconds, ratio = timing
            step = f"{seconds.median:.3f} ({seconds.low:.3f}-{seconds.high:.3f})"
            extra = (f"{100 * (ratio.median - 1):+.1f}% ({100 * (ratio.low - 1):+.1f} to "
                     f"{100 * (ratio.high - 1):+.1f})")
        rows.append([c.name, f"{c.peak / MIB:.1f}", share, budget, predicted, predicted_extra,
                     step, extra, f"{c.memory['base_bytes'] / MIB:.0f}"])
    headers = ["configuration", "peak MiB", "% plain", "budget MiB", "eager pred. MiB",
               "eager pred. extra", "step s median (min-max)", "extra time (min to max)",
               "base MiB"]
    return _common.format_table(headers, rows)


def verdict(knobs: list[Contender], plans: list[Contender],
            times: dict[str, tuple[RatioStats, RatioStats] | None], fixed: int) -> list[str]:
    """One line per knob setting below 1.0 and per budgeted plan, then the verdict line."""
    lines = []
    answers = []  # "YES"/"NO"/"n/a" per knob setting below 1.0
    ranked = [c for c in plans if c.peak is not None and times.get(c.name)]
    below_plain = [k for k in knobs if k.knob < 1.0]
    for knob in below_plain:
        if knob.peak is None or not times.get(knob.name):
            lines.append(f"  at {knob.name}'s peak: the knob's run failed")
            answers.append(f"n/a at {knob.name}")
            continue
        knob_ratio = times[knob.name][1]
        head = (f"  at {knob.name}'s peak ({knob.peak / MIB:.1f} MiB, "
                f"{100 * (knob_ratio.median - 1):+.1f}%):")
        fits = [c for c in ranked if c.peak <= knob.peak]
        if not fits:
            lines.append(f"{head} NO: no gradckpt plan reached that peak or lower")
            answers.append(f"NO at {knob.name}")
            continue
        best = min(fits, key=lambda c: times[c.name][1].median)
        ratio = times[best.name][1]
        answer = "YES" if ratio.median < knob_ratio.median else "NO"
        overlap = ratio.low <= knob_ratio.high and knob_ratio.low <= ratio.high
        lines.append(
            f"{head} {answer}: fastest gradckpt plan at or below it: {best.name}, "
            f"{best.peak / MIB:.1f} MiB, {100 * (ratio.median - 1):+.1f}% (min-max ranges over "
            f"rounds {'overlap' if overlap else 'do not overlap'})")
        answers.append(f"{answer} at {knob.name}{' (ranges overlap)' if overlap else ''}")
    budgeted = [c for c in plans if c.plan.budget_bytes is not None and c.peak is not None]
    honoured = 0
    gaps = []  # compiled peak above fixed / eager prediction above fixed - 1
    for c in budgeted:
        compiled = fixed + c.peak  # in the eager step's terms: fixed bytes + the step's peak
        budget, predicted = c.plan.budget_bytes, c.plan.predicted_peak_bytes
        honoured += compiled <= budget
        gaps.append(c.peak / (predicted - fixed) - 1)
        lines.append(
            f"  budget of {c.name}: {'honoured' if compiled <= budget else 'NOT honoured'}: "
            f"compiled {compiled / MIB:.1f} MiB (fixed + peak) vs budget {budget / MIB:.1f} MiB "
            f"({100 * (compiled / budget - 1):+.1f}%); eager-predicted "
            f"{predicted / MIB:.1f} MiB: compiled {100 * (compiled / predicted - 1):+.1f}% of "
            f"it, {100 * gaps[-1]:+.1f}% above fixed")
    knob_part = ", ".join(answers) if answers else "no knob setting below 1.0 in this run"
    if budgeted:
        budget_part = (f"honoured by {honoured} of {len(budgeted)} plans; compiled peak above "
                       f"fixed {100 * min(gaps):+.1f}% to {100 * max(gaps):+.1f}% of the eager "
                       "prediction")
    else:
        budget_part = "no budgeted plan measured"
    lines.append(f"verdict: a gradckpt plan at the knob's peak or lower with less extra time: "
                 f"{knob_part}; byte budget {budget_part}")
    return lines


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="torch.compile's activation_memory_budget vs gradckpt's compiled plans, "
        "on a Llama (CPU, inductor). Defaults in [brackets]: full run / --quick.",
    )
    _common.add_run_arguments(parser, FULL, QUICK, {
        "rounds": "timing rounds, each running every contender once (plain between rounds)",
        "warmup": "untimed steps after the compiling one, in every timing process",
        "steps": "timed steps in every timing process (its time: their median)",
    })
    return _common.parse_run_arguments(parser, argv, FULL, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Killed, still remove the inductor cache (and the running worker: subprocess.run kills it).
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    started = time.monotonic()
    print("bench/compile.py: torch.compile's activation_memory_budget vs gradckpt's compiled "
          "plans")
    print(f"command: {command_line(argv)}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; machine: {os.cpu_count()} CPU "
          f"cores; {_common.describe_machine(torch.device('cpu'))}")
    print(f"gradckpt {gradckpt.__version__}; memory runs: {MEMORY_ENVIRONMENT}, timing runs: "
          "the malloc settings above")
    model, batch = build(spec_for(args, Contender(PLAIN), "memory"))
    count = sum(p.numel() for p in model.parameters())
    print(f"model: Llama {args.layers} layers, hidden {args.embd}, {args.heads} heads, vocab "
          f"{VOCAB}, fp32, {count / 1e6:.2f}M parameters; batch {args.batch} x seq {args.seq}")
    print(f"load average before: {_common.load_average()}")
    print()

    cache = tempfile.mkdtemp(prefix="gradckpt-compile-bench-")
    memory_environment, timing_environment = environments(cache)
    try:
        print("memory runs (fresh processes, compiling from scratch; the knob first):")
        knobs = [Contender(f"knob {k:.1f}", knob=k) for k in (KNOBS[:1] if args.quick else KNOBS)]
        measure_memory(args, knobs, memory_environment)
        # Its times choose the optimal plans: taken on a quiet machine, as bench/frontier.py does.
        profile = _common.quiet_profile(
            model, batch, max_foreign_cores=args.max_foreign_load,
            deadline=time.monotonic() + args.patience).profile
        fixed = profile.fixed_bytes
        print(f"  (eager; fixed = parameters and inputs; least feasible optimal peak "
              f"{minimum_peak_bytes(profile) / MIB:.1f} MiB)")
        del model, batch
        eager = run_worker(spec_for(args, Contender("eager plain"), "memory", compiled=False),
                           memory_environment)
        if "error" in eager:
            print(f"  eager plain: FAILED {eager['error']}")
        else:
            profiled = profile.peak_bytes - fixed
            print(f"  eager plain (not compiled, the method's check): "
                  f"{eager['peak_bytes'] / MIB:.1f} MiB above base; MemTracker in the profile: "
                  f"{profiled / MIB:.1f} MiB ({100 * (eager['peak_bytes'] / profiled - 1):+.1f}%)")
        plans, notes = plan_contenders(profile, knobs, args.quick)
        for note in notes:
            print(f"  {note}")
        measure_memory(args, plans, memory_environment)
        contenders = knobs + plans
        check = check_losses(contenders)
        print(check)
        print()

        print(f"timing runs: {args.rounds} round(s), {args.warmup} untimed + {args.steps} timed "
              "steps per process")
        reruns = time_contenders(args, contenders, timing_environment)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    times = time_spreads(contenders)
    disturbed = sum(run.get("disturbed", False) for c in contenders for run in c.timed)
    total = sum(len(c.timed) for c in contenders)
    print(f"  {disturbed} of {total} timing processes kept were disturbed, {reruns} run again "
          f"(others used more than {args.max_foreign_load} core); load average after: "
          f"{_common.load_average()}")
    print()

    print("layouts: " + "; ".join(f"{c.name}: {describe_segments(c.plan.segments)}"
                                  for c in plans))
    print("peak: VmHWM - VmRSS base of one compiled step (MiB); budget and eager pred. MiB: "
          f"gradckpt's eager bytes minus the profile's fixed {fixed / MIB:.1f} MiB "
          "(plan.predicted_peak_bytes predicts the eager step, not the compiled one); eager "
          "pred. extra: plan.predicted_overhead (eager, too); step: median over processes; "
          "extra time: vs compiled plain, median over rounds")
    print(table(contenders, times, fixed))
    print()
    print("at each knob setting's peak, and each budget:")
    for line in verdict(knobs, plans, times, fixed):
        print(line)
    print(f"runtime: {(time.monotonic() - started) / 60:.1f} minutes")
    return 1 if check.startswith("FAIL") else 0


def measure_memory(args: argparse.Namespace, contenders: list[Contender],
                   environment: dict[str, str]) -> None:
    for c in contenders:
        c.memory = run_worker(spec_for(args, c, "memory"), environment)
        if "error" in c.memory:
            print(f"  {c.name}: FAILED {c.memory['error']}", flush=True)
            continue
        graphs = c.memory["graphs"]
        breaks = c.memory["graph_breaks"]
        shape = f", {graphs} graphs" if graphs != 1 else ""
        shape += f", {breaks} graph breaks" if breaks else ""
        print(f"  {c.name:<40} peak {c.peak / MIB:7.1f} MiB above base "
              f"{c.memory['base_bytes'] / MIB:.0f} MiB (compile "
              f"{c.memory['compile_seconds']:.0f} s{shape})", flush=True)


def check_losses(contenders: list[Contender]) -> str:
    """Whether every contender's loss and gradient norm match compiled plain's."""
    reference = contenders[0].memory
    if "loss" not in reference:
        return "losses: compiled plain failed; nothing to compare with"
    worst_loss = worst_norm = 0.0
    for c in contenders[1:]:
        if "loss" in c.memory:
            worst_loss = max(worst_loss, abs(c.memory["loss"] / reference["loss"] - 1))
            worst_norm = max(worst_norm, abs(c.memory["grad_norm"] / reference["grad_norm"] - 1))
    status = "FAIL" if worst_loss > LOSS_TOLERANCE else "ok"
    return (f"{status}: losses within {worst_loss:.1e} and gradient norms within "
            f"{worst_norm:.1e} (relative) of compiled plain's "
            f"({reference['loss']:.6f}, {reference['grad_norm']:.6f})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print("RESULT " + json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    _common.keep_freed_memory()
    sys.exit(main())
