"""How long does an 8B estimate take, start to end, on this machine?

The question (issue 26, item 5): someone trying five settings of a fine-tuning run on a GPU
they do not have ("LoRA on a 4090 at 8k tokens?") waits for ``gradckpt plan llama-3-8b
--estimate ...`` each time. Is each answer back in under 10 seconds, for full fine-tuning and
for LoRA, at 1k and at 8k tokens, batch 1?

Each setting is the command a user types (``python -m gradckpt plan llama-3-8b --estimate``,
the ``SETTINGS`` below), run in a fresh process and timed from its start to its exit: the
imports (torch, Transformers, PEFT), Llama-3-8B built on the meta device, the LoRA adapters
(PEFT, all-linear, r=16), the step estimated on fake tensors, the plan solved and the tables
printed. Wall seconds are what a user waits; the process's CPU seconds (user + system) say how
much of that was its own work. ``--rounds`` runs per setting, the median reported with min and
max. Like ``bench/engine.py`` it waits, asleep, for other processes to use at most
``--max-foreign-load`` cores before each run, and runs again one that they disturbed (for at
most ``--patience`` seconds over the whole run); a run kept though disturbed is marked.

What of that is the imports alone is timed too, in a fresh process that only imports what the
command does (``gradckpt.cli``, Transformers' Llama, PEFT for LoRA, which imports bitsandbytes
where it is installed), each round beside the command: the "imports s" column, and "estimate
s", the median of the command's wall less its round's imports (the model built, the adapters,
the estimate, the plan and the tables).

The closing verdict lines say whether every setting's median wall time is under 10 s, start to
end and without the imports, and the slowest. The exit status is 0 whatever they say, 1 if a
command fails.

    .venv/bin/python bench/estimate_speed.py            # 4 settings x 3 rounds: ~3 minutes
    .venv/bin/python bench/estimate_speed.py --rounds 1
    .venv/bin/python bench/estimate_speed.py --quick    # a 5-layer Llama, in this process

``--quick`` is a smoke test of seconds: the same four settings on a small Llama config (5
layers, so that identical layers are measured once, as on the 8B) at 16 and 64 tokens, each
estimated once in this process (imports paid before, not timed): not the question's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _common
import torch

import gradckpt

FULL = dict(rounds=3, patience=600.0)
QUICK = dict(rounds=1, patience=0.0)
LIMIT_SECONDS = 10.0  # the goal for one estimate, start to end

# The settings, as ``gradckpt plan MODEL --estimate`` arguments after the model: full
# fine-tuning in bf16 with AdamW on an H100, LoRA r=16 (all linear layers) on an RTX 4090.
SETTINGS = {
    "full 1k": "--device h100-80gb --batch 1 --seq 1024 --optimizer adamw",
    "full 8k": "--device h100-80gb --batch 1 --seq 8192 --optimizer adamw",
    "LoRA 1k": "--device rtx4090 --batch 1 --seq 1024 --lora 16 --optimizer adamw",
    "LoRA 8k": "--device rtx4090 --batch 1 --seq 8192 --lora 16 --optimizer adamw",
}
# --quick: the same settings on a small Llama, at these sequence lengths for "1k" and "8k".
QUICK_SEQ = {"1024": "16", "8192": "64"}
QUICK_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


@dataclass
class Timing:
    """One setting's runs: wall and CPU seconds each, and which ran on a busy machine."""

    name: str
    command: list[str]
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    imports: list[float] = field(default_factory=list)  # each round's (not in --quick)
    disturbed: int = 0

    def median_wall(self) -> float:
        return statistics.median(self.wall)

    def median_estimate(self) -> float:
        """The median of the runs' wall seconds less their rounds' imports (all of the wall
        in --quick, whose imports are paid before)."""
        if not self.imports:
            return self.median_wall()
        return statistics.median(w - i for w, i in zip(self.wall, self.imports, strict=True))


def commands(quick: bool, config: Path | None) -> dict[str, list[str]]:
    """Each setting's arguments to ``gradckpt`` (after the program)."""
    model = str(config) if quick else "llama-3-8b"
    found = {}
    for name, arguments in SETTINGS.items():
        words = arguments.split()
        if quick:
            words = [QUICK_SEQ.get(word, word) for word in words]
        found[name] = ["plan", model, "--estimate", *words]
    return found


def run_apart(arguments: list[str]) -> tuple[float, float]:
    """``python -m gradckpt ARGUMENTS`` in a fresh process: its wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gradckpt", *arguments],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"FAIL: gradckpt {' '.join(arguments)} exited {done.returncode}:\n"
                         f"{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def imports_apart(arguments: list[str]) -> float:
    """The wall seconds of a fresh process that imports what ``gradckpt ARGUMENTS`` does,
    and nothing else."""
    modules = ["gradckpt.cli", "transformers.models.llama.modeling_llama"]
    if "--lora" in arguments:
        modules.append("peft")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {', '.join(modules)}"], check=True,
                   capture_output=True)
    return time.perf_counter() - start


def run_here(arguments: list[str]) -> tuple[float, float]:
    """``gradckpt.cli.main(ARGUMENTS)`` in this process (imports already paid)."""
    from gradckpt.cli import main

    start, cpu_start = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = main(arguments)
    if status != 0:
        raise SystemExit(f"FAIL: gradckpt {' '.join(arguments)} returned {status}")
    return time.perf_counter() - start, time.process_time() - cpu_start


def measure(timings: list[Timing], args: argparse.Namespace) -> None:
    """``--rounds`` runs of every setting, in turn, each on a quiet machine if one comes."""
    deadline = time.monotonic() + args.patience
    run = run_here if args.quick else run_apart
    for _ in range(args.rounds):
        for timing in timings:
            while True:
                _common.wait_for_quiet(args.max_foreign_load, deadline)
                load = _common.ForeignLoad()
                load.start()
                wall, cpu = run(timing.command)
                cores = load.stop()
                if cores is not None and not args.quick:  # the command's own process is not
                    cores = max(0.0, cores - cpu / wall)  # another's
                busy = cores is not None and cores > args.max_foreign_load
                if not busy or time.monotonic() >= deadline:
                    break
                print(f"  {timing.name}: other processes used {cores:.2f} cores; again")
            timing.wall.append(wall)
            timing.cpu.append(cpu)
            timing.disturbed += busy
            if not args.quick:
                timing.imports.append(imports_apart(timing.command))


def table(timings: list[Timing], quick: bool) -> str:
    rows = []
    for timing in timings:
        spread = f"{min(timing.wall):.1f} to {max(timing.wall):.1f}"
        imports = f"{statistics.median(timing.imports):.1f}" if timing.imports else "-"
        rows.append([timing.name, f"{timing.median_wall():.1f}", spread,
                     f"{statistics.median(timing.cpu):.1f}", imports,
                     f"{timing.median_estimate():.1f}",
                     f"{len(timing.wall)}" + (f" ({timing.disturbed} busy)"
                                              if timing.disturbed else ""),
                     "gradckpt " + " ".join(timing.command)])
    wall = "wall s in this process" if quick else "wall s, start to end"
    return _common.format_table(
        ["setting", wall, "min to max", "CPU s", "imports s", "estimate s", "runs", "command"],
        rows)


def verdicts(timings: list[Timing]) -> list[str]:
    """Whether every setting is under the limit, start to end and without the imports."""
    lines = []
    for what, median in (("start to end", Timing.median_wall),
                         ("without the imports", Timing.median_estimate)):
        slowest = max(timings, key=median)
        under = all(median(timing) < LIMIT_SECONDS for timing in timings)
        lines.append(f"verdict: every estimate under {LIMIT_SECONDS:.0f} s {what}: "
                     f"{'YES' if under else 'NO'} (slowest {slowest.name}, "
                     f"{median(slowest):.1f} s median wall)")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="How long the Llama-3-8B estimate takes, start to end: full fine-tuning "
        "and LoRA at 1k and 8k tokens. Defaults in [brackets]: full run / --quick.",
    )
    _common.add_run_arguments(parser, FULL, QUICK, {
        "rounds": "runs of each setting (the median is reported)",
    })
    return _common.parse_run_arguments(parser, argv, FULL, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("bench/estimate_speed.py: how long an 8B estimate takes, start to end")
    print(f"command: {_common.command_line(argv)}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; machine: {os.cpu_count()} CPU cores; "
          f"{_common.describe_machine(torch.device('cpu'))}")
    print(f"gradckpt {gradckpt.__version__} from {os.path.dirname(gradckpt.__file__)}")
    print(f"load average before: {_common.load_average()}")
    with tempfile.TemporaryDirectory() as folder:
        config = None
        if args.quick:
            config = Path(folder) / "config.json"
            config.write_text(json.dumps(QUICK_CONFIG))
            print("--quick: a 5-layer Llama (hidden 32, vocab 256) at 16 and 64 tokens, in this "
                  "process, imports paid before: not the question's figures")
            with contextlib.suppress(ImportError):
                import peft  # noqa: F401  (LoRA's import, paid before the timing)
        timings = [Timing(name, command)
                   for name, command in commands(args.quick, config).items()]
        measure(timings, args)
    print()
    print(table(timings, args.quick))
    print()
    print(f"load average after: {_common.load_average()}")
    for line in verdicts(timings):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
