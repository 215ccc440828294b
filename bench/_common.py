"""Helpers shared by the benchmark scripts in ``bench/``: timing, memory, machine load, tables.

The rules they implement are DESIGN.md's "Measuring" section:

- Time is quoted as ratios measured side by side in one process: every contender gets warm-up
  steps, then the contenders run in turn, round after round, and each round gives one ratio per
  pair. The median over rounds is the result; min and max show the spread. Within a round the
  order rotates (A B C, B C A, C A B, ...) so that no contender always runs right after the same
  neighbour (a step that follows a memory-hungry step can pay for the allocator's page faults).
- Memory is a measured peak, never a guess: ``torch.cuda.max_memory_allocated()`` on CUDA,
  ``MemTracker``'s "peak" snapshot ("Total") on CPU. MemTracker slows every operation down, so
  memory is measured in its own runs, never while timing.
- Two processes measuring at once on a 2-core machine make every timing meaningless, so
  ``ForeignLoad`` measures how much CPU the rest of the machine used during each round; a round
  in which other processes were busy is discarded and run again.

Nothing here imports gradckpt: the scripts measure the library from the outside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MIB = 1024 * 1024


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer read afterwards covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Round:
    """One timed round: each contender's step time, and what the rest of the machine did."""

    seconds: dict[str, float]
    foreign_cores: float | None  # CPU other processes used meanwhile (see ForeignLoad)
    disturbed: bool  # foreign_cores above the threshold: the round is not used


@dataclass
class Timings:
    """Every round ``alternate_timings`` ran, and which of them count."""

    rounds: list[Round]
    wanted: int  # how many undisturbed rounds were asked for

    @property
    def used(self) -> list[Round]:
        """The undisturbed rounds; all rounds when every one was disturbed."""
        clean = [r for r in self.rounds if not r.disturbed]
        return clean or self.rounds

    @property
    def reliable(self) -> bool:
        """Whether the wanted number of undisturbed rounds was reached."""
        return sum(1 for r in self.rounds if not r.disturbed) >= self.wanted

    def seconds(self, name: str) -> list[float]:
        """The step times of contender ``name`` over the used rounds."""
        return [r.seconds[name] for r in self.used]


def alternate_timings(
    steps: dict[str, Callable[[], Any]],
    rounds: int,
    warmup_rounds: int,
    device: torch.device,
    on_round: Callable[[int, Round], None] | None = None,
    max_foreign_cores: float = 0.1,
    patience_seconds: float = 900.0,
    log: Callable[[str], None] = print,
) -> Timings:
    """Time each step of ``steps`` once per round, the contenders interleaved.

    ``warmup_rounds`` untimed rounds come first. Round ``r`` runs the contenders in the order of
    ``steps`` rotated by ``r`` places. Before each round we wait (asleep, so as not to disturb
    anyone else's measurement) until other processes use at most ``max_foreign_cores`` cores; a
    round during which they used more anyway is marked disturbed and run again. After
    ``patience_seconds`` of timing we stop waiting and retrying: the result then has fewer
    undisturbed rounds than asked for (``Timings.reliable`` is False). ``max_foreign_cores=inf``
    turns all this off. ``on_round(r, round)`` is called after each timed round.
    """
    names = list(steps)
    for _ in range(warmup_rounds):
        for name in names:
            steps[name]()
    synchronize(device)
    deadline = time.monotonic() + patience_seconds
    timings = Timings([], wanted=rounds)
    clean = 0
    attempt = 0
    while clean < rounds:
        patient = time.monotonic() < deadline
        if not patient and attempt >= rounds:
            break
        if patient:
            wait_for_quiet(max_foreign_cores, deadline, log)
        shift = attempt % len(names)
        this_round: dict[str, float] = {}
        load = ForeignLoad()
        load.start()
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            this_round[name] = time.perf_counter() - start
        foreign_cores = load.stop()
        disturbed = foreign_cores is not None and foreign_cores > max_foreign_cores
        measured = Round({name: this_round[name] for name in names}, foreign_cores, disturbed)
        timings.rounds.append(measured)
        clean += not disturbed
        if on_round is not None:
            on_round(attempt, measured)
        attempt += 1
    return timings


def wait_for_quiet(
    max_foreign_cores: float, deadline: float, log: Callable[[str], None] = print
) -> bool:
    """Sleep until other processes use at most ``max_foreign_cores`` cores (1 s samples).

    Returns False if ``deadline`` (``time.monotonic()``) came first or the load cannot be read.
    """
    waited_since = None
    while True:
        load = ForeignLoad()
        load.start()
        time.sleep(0.5)
        cores = load.stop()
        if cores is None:
            return False
        if cores <= max_foreign_cores:
            if waited_since is not None:
                log(f"  machine quiet again after {time.monotonic() - waited_since:.0f} s")
            return True
        if waited_since is None:
            waited_since = time.monotonic()
            log(f"  other processes are using {cores:.2f} cores; waiting for them to finish")
        if time.monotonic() >= deadline:
            log("  gave up waiting: out of patience, timing on a busy machine")
            return False
        time.sleep(1.5)


@dataclass(frozen=True)
class RatioStats:
    """Per-round ratios ``numerator / denominator``, summarized.

    ``lower_quartile`` .. ``upper_quartile`` hold the middle half of the rounds: a better picture
    of the noise than ``low`` .. ``high``, which one stray round sets.
    """

    median: float
    lower_quartile: float
    upper_quartile: float
    low: float
    high: float
    rounds: int


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> RatioStats:
    """Median, quartiles, min and max of the round-by-round ratios of two lists of times."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("need two equally long, non-empty lists of times")
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    if len(ratios) > 1:
        lower_quartile, _, upper_quartile = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        lower_quartile = upper_quartile = ratios[0]
    return RatioStats(
        statistics.median(ratios),
        lower_quartile,
        upper_quartile,
        min(ratios),
        max(ratios),
        len(ratios),
    )


class ForeignLoad:
    """How many cores' worth of CPU time *other* processes used between ``start()`` and ``stop()``.

    Busy time of the whole machine (``/proc/stat``) minus this process's own (``/proc/self/stat``,
    all threads), less two clock ticks of rounding slack. Anything above ~0.1 core on a 2-core
    machine means the timings were disturbed. The kernel counts in ticks (10 ms), so intervals
    under ``MIN_SECONDS`` cannot be judged: ``stop()`` returns None for them, as it does where
    ``/proc`` is missing (not Linux).
    """

    MIN_SECONDS = 0.25

    def start(self) -> None:
        self._begin = (_machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter())

    def stop(self) -> float | None:
        machine_begin, own_begin, wall_begin = self._begin
        machine_end, own_end = _machine_busy_seconds(), _own_cpu_seconds()
        if None in (machine_begin, own_begin, machine_end, own_end):
            return None
        wall = time.perf_counter() - wall_begin
        if wall < self.MIN_SECONDS:
            return None
        foreign = (machine_end - machine_begin) - (own_end - own_begin) - 2 / _ticks_per_second()
        return max(foreign, 0.0) / wall


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = sum(fields[:8]) - idle
    return busy / _ticks_per_second()


def _own_cpu_seconds() -> float | None:
    try:
        with open("/proc/self/stat") as stat:
            # fields after the ")" that ends the command name; utime and stime are 14 and 15
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _ticks_per_second()


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, or "n/a"."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


# Help for the flags ``add_run_arguments`` makes from a script's FULL/QUICK keys.
RUN_ARGUMENT_HELP = {
    "layers": "transformer blocks",
    "batch": "batch size",
    "seq": "sequence length",
    "embd": "model width (n_embd)",
    "heads": "attention heads",
    "rounds": "timed rounds",
    "warmup": "untimed rounds before them",
    "patience": "seconds to wait for a quiet machine before giving up",
}
NON_NEGATIVE = ("warmup", "patience")  # every other sized flag must be positive


def add_run_arguments(
    parser: argparse.ArgumentParser,
    full: dict[str, float],
    quick: dict[str, float],
    help_texts: dict[str, str] | None = None,
) -> None:
    """The flags every benchmark script has: one per key of ``full`` (sizes, rounds, ...),
    defaulting to ``full``'s value or, with ``--quick``, to ``quick``'s; ``--seed``,
    ``--max-foreign-load`` and ``--quick``. ``parse_run_arguments`` fills in the defaults.

    ``help_texts`` overrides ``RUN_ARGUMENT_HELP`` per key; each help ends with
    "[full / quick]".
    """
    help_texts = {**RUN_ARGUMENT_HELP, **(help_texts or {})}
    for key, value in full.items():
        parser.add_argument(
            f"--{key}",
            type=type(value),
            default=None,
            help=f"{help_texts[key]} [{value} / {quick[key]}]",
        )
    parser.add_argument("--seed", type=int, default=0, help="[0]")
    parser.add_argument(
        "--max-foreign-load",
        type=float,
        default=0.1,
        metavar="CORES",
        help="wait before, and rerun, rounds in which other processes use more CPU than this "
        "(inf: never) [0.1]",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, few rounds: a smoke test of seconds"
    )


def parse_run_arguments(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    full: dict[str, float],
    quick: dict[str, float],
) -> argparse.Namespace:
    """Parse ``argv``; sized flags not given take ``full``'s or (``--quick``) ``quick``'s value."""
    args = parser.parse_args(argv)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    positive = [key for key in full if key not in NON_NEGATIVE]
    if any(getattr(args, key) < 1 for key in positive):
        parser.error(f"{', '.join('--' + key for key in positive)} must be positive")
    non_negative = [key for key in NON_NEGATIVE if key in full]
    if any(getattr(args, key) < 0 for key in non_negative):
        parser.error(f"{' and '.join('--' + key for key in non_negative)} cannot be negative")
    return args


def describe_machine(device: torch.device) -> str:
    """One line: torch version, device, and the CPU threads torch uses."""
    text = f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} CPU threads"
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    return text
